# SPDX-License-Identifier: Apache-2.0
"""The sampler's inputs and outputs: static flags and per-step pytree dataclasses.

Shapes: R padded rows, V vocabulary, W = ceil(V / 32) bitmask words, L penalty window, B sparse
entries per row, N the number of top logprobs. Every per-request parameter is an array, so new
values never recompile; only `SamplerFlags` and the bucketed widths L and B select a program.
Optional groups are None when their flag is off (nothing is transferred for them).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import jax
import numpy as np

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
EXTRA_FEATURES = ("penalties", "sparse", "allowed", "grammar")

# Kinds of the sparse per-row (token id, value) entries, in the order vLLM applies them.
KIND_PAD = 0
KIND_BAN = 1  # bad word: the token becomes -inf
KIND_STOP = 2  # min_tokens: stop/EOS token becomes -inf (undone under a grammar that allows nothing else)
KIND_BIAS = 3  # logit_bias: the value is added


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerFlags:
    """Static switches of `sample` (a `jax.jit` static argument): each combination is one program.

    `num_logprobs` is None (no logprobs) or the bucketed N of top logprobs returned per row.
    """

    all_greedy: bool = False
    filters: bool = False  # some row uses top-k, top-p or min-p
    penalties: bool = False  # some row uses presence, frequency or repetition penalties
    sparse: bool = False  # some row has bad words, active min_tokens stop ids or logit_bias
    allowed: bool = False  # some row has allowed_token_ids
    grammar: bool = False  # some row has a structured-output bitmask
    num_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"

    @property
    def argmax_only(self) -> bool:
        """Whether the sampled tokens are just the argmax of the logits as they come (all rows
        greedy, nothing that changes the logits, no logprobs): the forward computes those itself."""
        return (
            self.all_greedy
            and self.num_logprobs is None
            and not (self.penalties or self.sparse or self.allowed or self.grammar)
        )

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be None or >= 0, got {self.num_logprobs}")
        if self.all_greedy and self.filters:
            raise ValueError("filters (top-k/top-p/min-p) never apply when all rows are greedy")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RandomTensors:
    """Per-row PRNG inputs: key = fold_in(fold_in(key_data, salt), num_generated)."""

    key_data: np.ndarray  # uint32[R, 2] threefry key: the request seed, or the step seed if unseeded
    salt: np.ndarray  # uint32[R] 0 for seeded rows, the request's nonce for unseeded ones
    num_generated: np.ndarray  # int32[R] output tokens the request already has


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FilterTensors:
    """Top-k (V = off), top-p (1 = off), min-p (0 = off)."""

    top_k: np.ndarray  # int32[R]
    top_p: np.ndarray  # float32[R]
    min_p: np.ndarray  # float32[R]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyTensors:
    """A window of each row's token history: `token_ids[r, :prompt_len[r]]` count as prompt tokens,
    `token_ids[r, prompt_len[r]:length[r]]` as output tokens; ids < 0 are ignored."""

    token_ids: np.ndarray  # int32[R, L]
    prompt_len: np.ndarray  # int32[R]
    length: np.ndarray  # int32[R]
    presence: np.ndarray  # float32[R]
    frequency: np.ndarray  # float32[R]
    repetition: np.ndarray  # float32[R]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseTensors:
    """Bad-word bans, min_tokens stop ids and logit biases as (id, value, kind) entries per row."""

    token_ids: np.ndarray  # int32[R, B], V for padding
    values: np.ndarray  # float32[R, B] the bias for KIND_BIAS entries
    kinds: np.ndarray  # int8[R, B] KIND_*
    restore_stops: np.ndarray  # bool[R] structured-output rows (see KIND_STOP)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Everything `sample` needs for one step; build it with `SamplingBatch.prepare`."""

    temperature: np.ndarray  # float32[R] (< SAMPLING_EPS: greedy; padding rows are greedy)
    random: RandomTensors | None = None  # None when all rows are greedy
    filters: FilterTensors | None = None
    penalties: PenaltyTensors | None = None
    sparse: SparseTensors | None = None
    allowed_bitmask: np.ndarray | None = None  # int32[R, W] set bit = allowed (all bits set: no limit)
    grammar_bitmask: np.ndarray | None = None  # int32[R, W] xgrammar convention (set bit = allowed)
    grammar_rows: np.ndarray | None = None  # bool[R] rows the grammar bitmask applies to


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """`sampled_token_ids` always; the rest when `flags.num_logprobs` is set (vLLM LogprobsTensors:
    column 0 is the sampled token, then the top N by logprob; rank = 1 + #tokens with a higher one)."""

    sampled_token_ids: jax.Array  # int32[R]
    logprob_token_ids: jax.Array | None = None  # int32[R, N + 1]
    logprobs: jax.Array | None = None  # float32[R, N + 1]
    sampled_token_ranks: jax.Array | None = None  # int32[R]


def warmup_flag_sets(
    max_logprobs: int | None,
    *,
    logprobs_mode: str = "raw_logprobs",
    extra_features: Iterable[str] = (),
) -> list[SamplerFlags]:
    """The flag combinations worth compiling before serving.

    Always: greedy / random / random with filters, each without and with logprobs (N =
    `max_logprobs`, skipped when None). Each name in `extra_features` (from `EXTRA_FEATURES`)
    doubles the list with that feature switched on.
    """
    extras = tuple(extra_features)
    unknown = set(extras) - set(EXTRA_FEATURES)
    if unknown:
        raise ValueError(f"unknown extra features {sorted(unknown)}; choose from {EXTRA_FEATURES}")
    logprob_choices = (None,) if max_logprobs is None else (None, max_logprobs)
    flag_sets = []
    for greedy, filters in ((True, False), (False, False), (False, True)):
        for num_logprobs in logprob_choices:
            for switched in itertools.product((False, True), repeat=len(extras)):
                flag_sets.append(
                    SamplerFlags(
                        all_greedy=greedy,
                        filters=filters,
                        num_logprobs=num_logprobs,
                        logprobs_mode=logprobs_mode,
                        **dict(zip(extras, switched, strict=True)),
                    )
                )
    return flag_sets


def dummy_tensors(
    flags: SamplerFlags, padded_rows: int, vocab_size: int, *, penalty_width: int = 16, sparse_width: int = 16
) -> SamplingTensors:
    """Neutral tensors of the right shapes for `flags` (warm-up compiles); every row is a no-op."""
    rows = padded_rows
    words = -(-vocab_size // 32)
    zeros_f, zeros_i = np.zeros(rows, np.float32), np.zeros(rows, np.int32)
    random = filters = penalties = sparse = None
    if not flags.all_greedy:
        random = RandomTensors(np.zeros((rows, 2), np.uint32), np.zeros(rows, np.uint32), zeros_i)
    if flags.filters:
        filters = FilterTensors(np.full(rows, vocab_size, np.int32), np.ones(rows, np.float32), zeros_f)
    if flags.penalties:
        ids = np.full((rows, penalty_width), -1, np.int32)
        penalties = PenaltyTensors(ids, zeros_i, zeros_i, zeros_f, zeros_f, np.ones(rows, np.float32))
    if flags.sparse:
        sparse = SparseTensors(
            np.full((rows, sparse_width), vocab_size, np.int32),
            np.zeros((rows, sparse_width), np.float32),
            np.zeros((rows, sparse_width), np.int8),
            np.zeros(rows, bool),
        )
    full_mask = np.full((rows, words), -1, np.int32)
    return SamplingTensors(
        temperature=np.full(rows, 0.0 if flags.all_greedy else 1.0, np.float32),
        random=random,
        filters=filters,
        penalties=penalties,
        sparse=sparse,
        allowed_bitmask=full_mask if flags.allowed else None,
        grammar_bitmask=full_mask if flags.grammar else None,
        grammar_rows=np.zeros(rows, bool) if flags.grammar else None,
    )
