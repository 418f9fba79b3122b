# SPDX-License-Identifier: Apache-2.0
"""The statistical check of draft verification: N independent rows draft the same tokens over
the same target logits; what `rejection.verify_drafts` keeps must follow the target's
distribution as sampling without speculation would (chi-square), and the drafts must be kept as
often as the rule says. Shared by the verification's own test and the proposers' (EAGLE-3)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from tpu_platform.sampling import SamplerFlags, SamplingTensors
from tpu_platform.sampling.tensors import FilterTensors, RandomTensors
from tpu_platform.speculation.rejection import verify_drafts


def random_tensors(
    rows: int, temperature: float = 1.0, seed: int = 0, top_k: int | None = None
) -> SamplingTensors:
    """Sampling tensors of `rows` unseeded rows at `temperature` (with `top_k`: filters on)."""
    rng = np.random.default_rng(seed)
    random = RandomTensors(
        rng.integers(0, 2**32, (rows, 2), dtype=np.uint32),
        np.zeros(rows, np.uint32),
        np.zeros(rows, np.int32),
    )
    filters = None
    if top_k is not None:
        filters = FilterTensors(
            np.full(rows, top_k, np.int32), np.ones(rows, np.float32), np.zeros(rows, np.float32)
        )
    return SamplingTensors(temperature=np.full(rows, temperature, np.float32), random=random, filters=filters)


def chi_square_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    """Goodness of fit of sampled `tokens` to distribution `p`, the tokens whose expected count
    is under 5 lumped into one bin (the test's approximation needs counts of 5 or more)."""
    observed = np.bincount(tokens, minlength=p.size).astype(np.float64)
    p = np.asarray(p, np.float64)
    expected = p / p.sum() * tokens.size
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


def check_follows_target(
    logits: np.ndarray, drafts: np.ndarray, *, rows: int, seed: int, temperature: float = 1.0
) -> None:
    """Verifies `drafts [2]` over the target's `logits [3, V]` (the positions before and after
    each draft) in `rows` independent rows at `temperature`, and checks that the first token
    follows p0 = softmax(logits[0] / temperature), the second given the first draft was kept p1,
    and that the drafts are kept with probability p0(d0) and p0(d0) * p1(d1)."""
    scaled = np.asarray(logits, np.float64) / temperature
    p = np.exp(scaled - scaled.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    batch = np.broadcast_to(logits.astype(np.float32), (rows, *logits.shape))
    tokens, counts = verify_drafts(
        batch, np.tile(drafts.astype(np.int32), (rows, 1)), np.full(rows, drafts.size, np.int32),
        random_tensors(rows, temperature, seed=seed), flags=SamplerFlags(),
    )  # fmt: skip
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    assert chi_square_pvalue(tokens[:, 0], p[0]) > 1e-3
    after_first = tokens[tokens[:, 0] == drafts[0]]
    assert chi_square_pvalue(after_first[:, 1], p[1]) > 1e-3
    kept_first, kept_both = p[0, drafts[0]], p[0, drafts[0]] * p[1, drafts[1]]
    assert abs((counts >= 2).mean() - kept_first) < 4 * np.sqrt(kept_first * (1 - kept_first) / rows) + 1e-3
    assert abs((counts == 3).mean() - kept_both) < 4 * np.sqrt(kept_both * (1 - kept_both) / rows) + 1e-3
