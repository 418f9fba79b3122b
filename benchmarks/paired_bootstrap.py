# SPDX-License-Identifier: Apache-2.0
"""A confidence interval for the ratio of two perplexities measured on the same tokens.

The ratio is `exp(mean(nll_a - nll_b))` over the per-token negative log-likelihoods of the two
configurations. Neighbouring tokens' differences are correlated (a passage one model finds hard
stays hard for a while), so tokens are not resampled one by one: a moving-block bootstrap draws
whole runs of `block` consecutive tokens, the same runs for both configurations (paired), and the
interval is the percentiles of the resampled ratios.
"""

from __future__ import annotations

import numpy as np


def ratio_interval(
    nll: np.ndarray,
    nll_reference: np.ndarray,
    *,
    block: int = 16,
    draws: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """The `level` percentile interval of `exp(mean(nll - nll_reference))` (a perplexity ratio)
    from a paired moving-block bootstrap: each draw concatenates blocks of `block` consecutive
    tokens, starting anywhere, up to the text's length. `nll`, `nll_reference`: `[tokens]`."""
    a, b = np.asarray(nll, np.float64), np.asarray(nll_reference, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"nll {a.shape} and nll_reference {b.shape} must be the same tokens' `[tokens]`")
    if not 1 <= block <= a.size:
        raise ValueError(f"block {block} must be between 1 and the {a.size} tokens")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level} must lie between 0 and 1")
    diff = a - b
    blocks = -(-diff.size // block)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, diff.size - block + 1, size=(draws, blocks))
    # [draws, blocks * block] token indices, cut to the text's length
    index = (starts[..., None] + np.arange(block)).reshape(draws, -1)[:, : diff.size]
    ratios = np.exp(diff[index].mean(axis=1))
    tail = (1.0 - level) / 2
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)
