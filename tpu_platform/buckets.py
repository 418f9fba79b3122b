# SPDX-License-Identifier: Apache-2.0
"""Padding buckets: every step shape is rounded up to one of a few fixed sizes.

The set of compiled programs is then finite and known before serving starts.
"""

from __future__ import annotations

import bisect
import dataclasses


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, ...]:
    """Tokens-per-step buckets: x4 steps up to 16 (1, 4, 16) and a full decode batch
    (`max_num_seqs`, when below 16), then x2, capped at the maximum.

    Steps of a few tokens (decode batches, short prompts) cost about what streaming the weights
    costs whatever their padding (attention skips padding rows), so coarse buckets there save
    programs, except that a full batch of decode rows keeps its own. From 16 tokens on the dense
    layers are compute-bound and every padded token costs about as much as a real one, so the
    buckets double.
    """
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError(
            "max_num_batched_tokens and max_num_seqs must be >= 1, "
            f"got {max_num_batched_tokens} and {max_num_seqs}"
        )
    sizes, size = {max_num_batched_tokens}, 1
    if max_num_seqs < min(16, max_num_batched_tokens):
        sizes.add(max_num_seqs)
    while size < max_num_batched_tokens:
        sizes.add(size)
        size = size * 4 if size < 16 else size * 2
    return tuple(sorted(sizes))


def request_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Request-count buckets of the verification program: powers of two, then `max_num_seqs`.

    Each request brings 1 + k rows to its LM head, so padding 5 requests to 16 (as the token
    buckets' coarse steps would) computes 80 rows for 25; the programs are small, so finer steps
    cost little at warm-up.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = {max_num_seqs}, 1
    while size < max_num_seqs:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def round_up(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def verify_shapes(
    tokens: tuple[int, ...], max_num_seqs: int, max_num_batched_tokens: int, query_rows: int
) -> tuple[tuple[int, int], ...]:
    """Speculative decoding's `(T, R)` step shapes: T = r requests of `query_rows` (1 + k) rows
    each, for r = 1, 2, 4, ... up to `max_num_seqs`, and R the token buckets' smallest sequence-row
    count that holds r (so no sampler shape is added).

    A verify step would otherwise round up to the next token bucket and its sequence rows (one
    request's 5 rows to 16 tokens and 16 logits rows; 16 requests' 80 to 128). The CPU's dense
    kernels skip the trailing zero rows of padding tokens, but the LM head still runs on every
    sequence row and the row-wise XLA ops on every token row.
    """
    if query_rows < 2:
        raise ValueError(f"query_rows is 1 + the drafts a request, at least 2; got {query_rows}")
    plain = {(t, min(t, max_num_seqs)) for t in tokens}
    seq_rows = sorted({r for _, r in plain})
    shapes, r = set(), 1
    while r <= max_num_seqs and r * query_rows <= max_num_batched_tokens:
        shapes.add((r * query_rows, round_up(r, tuple(seq_rows))))
        r *= 2
    return tuple(sorted(shapes - plain))


@dataclasses.dataclass(frozen=True, slots=True)
class StepBuckets:
    """The padded shapes of a step: one program per shape.

    Tokens per step round up to a bucket of `token_buckets` (`tokens`). The sequence rows follow from it,
    `min(T, max_num_seqs)`, since a step never has more sequences than tokens; and the block
    table is always `max_pages` wide, because attention walks only the pages in use. With
    speculative decoding, `verify` adds `(T, R)` shapes of R requests of 1 + k rows
    (`verify_shapes`); a step takes the smallest T whose R holds its sequences. So the set of
    compiled forward programs is exactly `tokens` and `verify`.
    """

    tokens: tuple[int, ...]
    max_seqs: int
    max_pages: int
    verify: tuple[tuple[int, int], ...] = ()  # (T, R), sorted

    @classmethod
    def for_limits(
        cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int,
        min_pages: int = 1, spec_tokens: int = 0,
    ) -> StepBuckets:  # fmt: skip
        """`min_pages`: the block table's least width (a hybrid model's 1 + k state blocks a
        request under speculative decoding, `tpu_platform.state_cache`); `spec_tokens`: the
        drafts a request under speculative decoding (k; 0: none)."""
        tokens = token_buckets(max_num_batched_tokens, max_num_seqs)
        verify = ()
        if spec_tokens:
            verify = verify_shapes(tokens, max_num_seqs, max_num_batched_tokens, 1 + spec_tokens)
        return cls(
            tokens=tokens,
            max_seqs=max_num_seqs,
            max_pages=max(-(-max_model_len // page_size), min_pages),
            verify=verify,
        )

    def seqs_for(self, padded_tokens: int) -> int:
        return min(padded_tokens, self.max_seqs)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every padded `(T, R, P)` a step can have."""
        plain = [(t, self.seqs_for(t)) for t in self.tokens]
        return [(t, r, self.max_pages) for t, r in sorted(plain + list(self.verify))]

    def shape_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int, int]:
        """Padded `(T, R, P)` for a step of `num_tokens` tokens over `num_seqs` sequences."""
        t_pad = round_up(num_tokens, self.tokens)
        if num_seqs > self.seqs_for(t_pad):
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs={self.max_seqs}")
        r_pad = self.seqs_for(t_pad)
        for t, r in self.verify:  # few: one per sequence-row count
            if t > t_pad:
                break
            if t >= num_tokens and r >= num_seqs:
                return t, r, self.max_pages
        return t_pad, r_pad, self.max_pages
