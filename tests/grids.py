# SPDX-License-Identifier: Apache-2.0
"""Grids of test points split between the tiers: the fast tier takes hand-picked points of a grid
(one a code path), `make test` (the `slow` tier) the rest of the product."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest


def split_product(first: Sequence, second: Sequence, fast: set[tuple]) -> list:
    """Every pair of the product as a test parameter (a tuple value spread into several arguments),
    marked `slow` unless it is in `fast`."""
    missing = set(fast) - set(itertools.product(first, second))
    if missing:
        raise ValueError(f"fast points {sorted(missing)} are not in the grid: pick them from its axes")
    return [
        pytest.param(*_spread(a), *_spread(b), marks=() if (a, b) in fast else pytest.mark.slow)
        for a, b in itertools.product(first, second)
    ]


def _spread(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)
