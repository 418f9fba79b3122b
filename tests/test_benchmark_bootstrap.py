# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/paired_bootstrap.py` on synthetic losses whose spread is known: its interval for a
perplexity ratio against the normal-theory interval (independent tokens) and against the exact
standard error of an AR(1) series' mean (correlated tokens, where resampling single tokens would be
too narrow)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark

ratio_interval = load_benchmark("paired_bootstrap").ratio_interval
TOKENS = 320


def _ar1(rng: np.random.Generator, phi: float, n: int) -> np.ndarray:
    """An AR(1) series of unit marginal variance."""
    x = np.empty(n)
    x[0] = rng.standard_normal()
    for t in range(1, n):
        x[t] = phi * x[t - 1] + np.sqrt(1 - phi**2) * rng.standard_normal()
    return x


def _half_width(nll, reference, **kwargs) -> float:
    """Half the interval's width in log-ratio units (mean loss difference)."""
    low, high = ratio_interval(nll, reference, **kwargs)
    return (np.log(high) - np.log(low)) / 2


def test_the_same_losses_give_exactly_one():
    nll = np.random.default_rng(0).exponential(3.0, TOKENS)
    assert ratio_interval(nll, nll) == (1.0, 1.0)


def test_pairing_cancels_what_both_configurations_share():
    # Losses that vary a lot from token to token but differ by a constant between the two runs:
    # every resample's mean difference is that constant, so the interval is the ratio itself.
    rng = np.random.default_rng(1)
    reference = rng.exponential(3.0, TOKENS)
    low, high = ratio_interval(reference + 0.03, reference)
    assert low == pytest.approx(np.exp(0.03), rel=1e-12) and high == pytest.approx(np.exp(0.03), rel=1e-12)


def test_independent_tokens_match_the_normal_interval():
    rng = np.random.default_rng(2)
    reference = rng.exponential(3.0, TOKENS)
    diff = 0.04 + 0.3 * rng.standard_normal(TOKENS)
    low, high = ratio_interval(reference + diff, reference, block=1, draws=20_000)
    half = 1.96 * diff.std() / np.sqrt(TOKENS)
    assert np.log(low) == pytest.approx(diff.mean() - half, abs=0.08 * half)
    assert np.log(high) == pytest.approx(diff.mean() + half, abs=0.08 * half)


def test_blocks_cover_correlated_tokens_where_single_tokens_do_not():
    # AR(1) differences (phi 0.5: a correlation length of a few tokens). The exact standard error
    # of their mean is sqrt(sum over i, j of phi^|i - j|) / n; resampling tokens one by one sees
    # only the marginal variance (about 0.58 of that), blocks of 16 see nearly all of it.
    phi, series = 0.5, 20
    lags = np.abs(np.subtract.outer(np.arange(TOKENS), np.arange(TOKENS)))
    exact = 1.96 * np.sqrt((phi**lags).sum()) / TOKENS
    rng = np.random.default_rng(3)
    reference = rng.exponential(3.0, TOKENS)
    single, blocks = [], []
    for seed in range(series):
        diff = 0.3 * _ar1(rng, phi, TOKENS)
        single.append(_half_width(reference + diff, reference, block=1, draws=1_000, seed=seed))
        blocks.append(_half_width(reference + diff, reference, block=16, draws=1_000, seed=seed))
    assert np.mean(single) / (0.3 * exact) < 0.7
    assert 0.85 < np.mean(blocks) / (0.3 * exact) < 1.1


def test_bad_input_is_named():
    nll = np.ones(TOKENS)
    with pytest.raises(ValueError, match=r"must be the same tokens"):
        ratio_interval(nll, nll[:-1])
    with pytest.raises(ValueError, match=r"block 400 must be between 1 and the 320 tokens"):
        ratio_interval(nll, nll, block=400)
    with pytest.raises(ValueError, match=r"level 1.5"):
        ratio_interval(nll, nll, level=1.5)
