# SPDX-License-Identifier: Apache-2.0
"""Grids of test points split between the tiers: the fast tier takes a cover of a grid (every
value of each axis at least once), `make test` (the `slow` tier) the rest of the product."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest


def cover(first: Sequence, second: Sequence, shift: int = 0) -> set[tuple]:
    """Pairs of the two axes in which each value of each appears: the i-th of the longer axis with
    the (i + shift)-th of the shorter, cyclically. A `shift` pairs them differently, so that two
    covers (one for each value of a third axis) hold different pairs."""
    count = max(len(first), len(second))
    return {(first[i % len(first)], second[(i + shift) % len(second)]) for i in range(count)}


def split_product(first: Sequence, second: Sequence, fast: set[tuple]) -> list:
    """Every pair of the product as a test parameter (a tuple value spread into several arguments),
    marked `slow` unless it is in `fast`."""
    return [
        pytest.param(*_spread(a), *_spread(b), marks=() if (a, b) in fast else pytest.mark.slow)
        for a, b in itertools.product(first, second)
    ]


def _spread(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)
