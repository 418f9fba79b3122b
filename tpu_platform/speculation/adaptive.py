# SPDX-License-Identifier: Apache-2.0
"""How many drafts a step should carry: the one that maximizes expected tokens per second.

A verify step of n requests with k drafts each computes n * (1 + k) rows. Where extra rows are
nearly free (one request on a CPU; hundreds of rows on an accelerator) drafting pays even at
modest acceptance; where the step is already compute-bound (a CPU batch of 16) a verify step costs
about as much as decoding its rows one step at a time, so even well-accepted drafts lose. Neither
a fixed k nor a batch-size schedule knows which holds on the machine at hand, so the runner times
its own step shapes at warm-up (`StepCosts`) and keeps a running estimate of how often the drafts
at each position are kept (`AcceptanceEstimate`); `choose_draft_count` weighs the two.

The choice changes only how many drafts a step carries, never which tokens are emitted: greedy
output stays identical to no speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

# Each verified step's weight in the running acceptance estimate decays by this factor, so the
# estimate follows a workload that changes (a new prompt, a request that stops copying its input).
DECAY = 0.98
# The estimate before any draft is verified: each draft kept with probability one half (the first
# j all kept: 1 / 2^j), worth this many drafts of evidence (the first verified steps move it).
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class StepCosts:
    """Measured step seconds: `seconds[r][k]`, a step of r requests (a request-row bucket) with
    k drafts each (k = 0: the plain decode step)."""

    seconds: Mapping[int, Mapping[int, float]]

    def for_requests(self, num_requests: int) -> Mapping[int, float]:
        """The costs of the smallest timed bucket holding `num_requests` (the largest timed one
        beyond it: the policy reads only the ratios between k values, which change slowly with r)."""
        buckets = sorted(self.seconds)
        if not buckets:
            raise ValueError("StepCosts has no timed bucket; build it from at least one timed shape")
        return self.seconds[next((r for r in buckets if r >= num_requests), buckets[-1])]


class AcceptanceEstimate:
    """A decaying count, per draft position j, of the drafts offered there and of those kept with
    every draft before them: `prefix_rates()[j - 1]` estimates P(the first j drafts all kept)."""

    def __init__(self, max_drafts: int):
        self.offered = np.full(max_drafts, PRIOR_WEIGHT)
        self.kept = PRIOR_WEIGHT * PRIOR_RATE ** np.arange(1, max_drafts + 1)

    def record(self, num_drafts: np.ndarray, accepted: np.ndarray) -> None:
        """Adds one verified step: each request's drafts (`num_drafts`) and how many of them it
        kept (`accepted`, a prefix)."""
        positions = np.arange(1, self.offered.size + 1)[None, :]
        self.offered = self.offered * DECAY + (num_drafts[:, None] >= positions).sum(axis=0)
        self.kept = self.kept * DECAY + (accepted[:, None] >= positions).sum(axis=0)

    def relax(self) -> None:
        """Moves the estimate one step toward the prior, on a step that drafted nothing: an
        estimate that fell low enough to stop drafting gets no more evidence, so without this it
        would stop drafting for good even after the workload turns to one worth drafting."""
        prior = PRIOR_RATE ** np.arange(1, self.offered.size + 1)
        self.offered = self.offered * DECAY + PRIOR_WEIGHT * (1 - DECAY)
        self.kept = self.kept * DECAY + PRIOR_WEIGHT * (1 - DECAY) * prior

    def prefix_rates(self) -> np.ndarray:
        """float[max_drafts]: P(the first j drafts all kept), j = 1 ..., non-increasing."""
        rates = np.minimum(self.kept / self.offered, 1.0)
        return np.minimum.accumulate(rates)


def expected_accepted(prefix_rates: Sequence[float], k: int) -> float:
    """E[drafts kept of k] = sum over j <= k of P(the first j all kept)."""
    return float(np.sum(prefix_rates[:k]))


def choose_draft_count(
    num_requests: int, num_drafted: int, seconds: Mapping[int, float], prefix_rates: Sequence[float]
) -> int:
    """The drafts a request (k, a key of `seconds` other than 0; or 0: none) that maximize
    expected tokens per second for a step of `num_requests` of which `num_drafted` get drafts.

    Each request emits one token plus, when drafted, the drafts it keeps; the step's time is the
    plain step's (`seconds[0]`) plus the drafted share of the extra a full verify step of k costs
    (`seconds[k] - seconds[0]`, measured with every request drafted). Ties go to fewer drafts.
    """
    if num_requests < 1 or not 0 <= num_drafted <= num_requests:
        raise ValueError(f"num_drafted={num_drafted} must lie in 0..num_requests={num_requests} (>= 1)")
    plain = seconds[0]
    best_k, best_rate = 0, num_requests / plain
    share = num_drafted / num_requests
    for k in sorted(k for k in seconds if k > 0):
        tokens = num_requests + num_drafted * expected_accepted(prefix_rates, k)
        rate = tokens / (plain + share * (seconds[k] - plain))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
