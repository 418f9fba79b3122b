# SPDX-License-Identifier: Apache-2.0
"""Host-side NumPy helpers of `SamplingBatch`: the token-history protocol, width buckets, bitmask
packing, seed words and the bad-words matcher."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

UINT64 = 2**64


class TokenHistory(Protocol):
    """What `prepare` reads; row r holds the prompt, then every output token generated so far.

    `token_ids[r, :num_prompt_tokens[r]]` is the prompt and `token_ids[r, num_prompt_tokens[r]:num_tokens[r]]`
    the outputs (not the token being sampled now). Negative ids (async placeholders) are ignored by
    penalties and never match a bad word, but still count as generated tokens.
    """

    token_ids: np.ndarray  # int[rows, max_len]
    num_tokens: np.ndarray  # int[rows]
    num_prompt_tokens: np.ndarray  # int[rows]


def width_buckets(minimum: int, maximum: int, factor: int = 4) -> tuple[int, ...]:
    """`minimum * factor**k` below `maximum`, then `maximum`: the few widths of compact id arrays."""
    widths = []
    width = minimum
    while width < maximum:
        widths.append(width)
        width *= factor
    widths.append(max(maximum, minimum))
    return tuple(widths)


def round_up(value: int, buckets: tuple[int, ...], factor: int = 4) -> int:
    for bucket in buckets:
        if value <= bucket:
            return bucket
    width = buckets[-1]
    while width < value:
        width *= factor
    return width


def pack_token_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32[ceil(V / 32)] with bit `t % 32` of word `t // 32` set for each id (xgrammar layout)."""
    bits = np.zeros(-(-vocab_size // 32) * 32, bool)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def grammar_rows(
    bitmasks: Sequence[np.ndarray | None] | None, num_rows: int, padded: int, words: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The `[padded, words]` grammar bitmask and `[padded]` has-grammar rows of `num_rows` rows'
    packed bitmasks (None: no grammar); None when no row has one."""
    if bitmasks is None or all(m is None for m in bitmasks):
        return None
    if len(bitmasks) != num_rows:
        raise ValueError(f"grammar_bitmasks has {len(bitmasks)} entries for {num_rows} rows")
    out = np.full((padded, words), -1, np.int32)
    has = np.zeros(padded, bool)
    for i, mask in enumerate(bitmasks):
        if mask is not None:
            # Words past the logits' vocabulary only describe tokens the model cannot emit.
            mask = np.asarray(mask, np.int32).reshape(-1)[:words]
            out[i, : mask.size], has[i] = mask, True
    return out, has


def seed_words(seed: int) -> tuple[int, int]:
    """Threefry key data (high word, low word) of a seed modulo 2**64: `jax.random.PRNGKey(seed)` for
    seeds below 2**32 (and for all seeds under `jax_enable_x64`)."""
    seed %= UINT64
    return seed >> 32, seed & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True, slots=True)
class BadWords:
    """A request's bad words, prefixes right-aligned so one comparison checks them all."""

    prefixes: np.ndarray  # int32[num_words, P], -1 left of a shorter prefix
    prefix_len: np.ndarray  # int32[num_words]
    last: np.ndarray  # int32[num_words] the token banned when the prefix matches

    @classmethod
    def build(cls, words: Sequence[Sequence[int]]) -> BadWords:
        width = max(len(w) for w in words) - 1
        prefixes = np.full((len(words), width), -1, np.int32)
        for i, word in enumerate(words):
            if len(word) > 1:
                prefixes[i, width - len(word) + 1 :] = word[:-1]
        prefix_len = np.array([len(w) - 1 for w in words], np.int32)
        return cls(prefixes, prefix_len, np.array([w[-1] for w in words], np.int32))

    def banned(self, output: np.ndarray) -> np.ndarray:
        """vLLM `_apply_bad_words_single_batch`: last tokens of words whose prefix ends the output."""
        width = self.prefixes.shape[1]
        tail = np.full(width, -2, np.int64)
        n = min(width, output.size)
        if n:
            tail[width - n :] = output[output.size - n :]
        fits = self.prefix_len <= output.size
        match = np.all((self.prefixes == tail) | (self.prefixes == -1), axis=1)
        return self.last[fits & match]
