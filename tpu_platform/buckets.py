# SPDX-License-Identifier: Apache-2.0
"""Padding buckets: every step shape is rounded up to one of a few fixed sizes.

The set of compiled programs is then finite and known before serving starts.
"""

from __future__ import annotations

import bisect
import dataclasses


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first one >= `maximum`... capped at `maximum`."""
    if maximum < 1:
        raise ValueError(f"bucket maximum must be >= 1, got {maximum}")
    sizes = []
    size = max(1, minimum)
    while size < maximum:
        sizes.append(size)
        size *= 2
    sizes.append(maximum)
    return tuple(sizes)


def round_up(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True, slots=True)
class StepBuckets:
    """Bucket sizes for tokens per step, sequences per step and pages per sequence."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @classmethod
    def for_limits(
        cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int
    ) -> StepBuckets:
        max_pages = -(-max_model_len // page_size)
        return cls(
            tokens=power_of_two_buckets(16, max_num_batched_tokens),
            seqs=power_of_two_buckets(1, max_num_seqs),
            pages=power_of_two_buckets(1, max_pages),
        )

    def shape_for(self, num_tokens: int, num_seqs: int, max_pages: int) -> tuple[int, int, int]:
        """Padded `(T, R, P)` for a step."""
        return (
            round_up(num_tokens, self.tokens),
            round_up(num_seqs, self.seqs),
            round_up(max_pages, self.pages),
        )
