# SPDX-License-Identifier: Apache-2.0
"""How many drafts a step should carry: the one that maximizes expected tokens per second.

A verify step of n requests with k drafts each computes n * (1 + k) rows. Where extra rows are
nearly free (one request on a CPU; hundreds of rows on an accelerator) drafting pays even at
modest acceptance; where the step is already compute-bound (a CPU batch of 16) a verify step costs
about as much as decoding its rows one step at a time, so even well-accepted drafts lose. Neither
a fixed k nor a batch-size schedule knows which holds on the machine at hand, so the runner times
its own step shapes at warm-up (`StepCosts`), refines them with the walls of the decode steps it
serves (`ServedCosts`), and keeps a running estimate of how often the drafts at each position are
kept (`AcceptanceEstimate`); `choose_draft_count` weighs the two, each step (`DraftCount`).

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
# A served step's weight in its shape's decaying mean wall.
SERVED_WEIGHT = 0.1
# Drafting must promise this many times the plain step's tokens a second: near break-even the
# estimates (walls on a shared machine, acceptance learned from other requests) cannot tell, and
# measured there a CPU batch lost a few percent with drafts; one stream's gain is far above it.
DRAFT_MARGIN = 1.1


@dataclasses.dataclass(frozen=True, slots=True)
class StepCosts:
    """Measured step seconds: `seconds[r][k]`, a step of r requests (a request-row bucket) with
    k drafts each (k = 0: the plain decode step)."""

    seconds: Mapping[int, Mapping[int, float]]

    def bucket_for(self, num_requests: int) -> int:
        """The smallest timed bucket holding `num_requests` (the largest timed one beyond it: the
        policy reads only the ratios between k values, which change slowly with r)."""
        buckets = sorted(self.seconds)
        if not buckets:
            raise ValueError("StepCosts has no timed bucket; build it from at least one timed shape")
        return next((r for r in buckets if r >= num_requests), buckets[-1])

    def for_requests(self, num_requests: int) -> Mapping[int, float]:
        """The costs of `bucket_for(num_requests)`."""
        return self.seconds[self.bucket_for(num_requests)]


class ServedCosts:
    """The warm-up's step costs refined by the walls of the steps served (from one proposal to
    the next: the step, its sampling, vLLM's scheduling and the proposing), which the warm-up's
    timing misses: attention over real contexts (a verify row attends to all of it), the host's
    work a step. A cost not served yet is the warm-up's plus the bucket's mean extra so far (host
    work adds about the same to every step)."""

    def __init__(self, warm: StepCosts):
        self.warm = warm
        self.walls: dict[tuple[int, int], float] = {}  # (bucket, k) -> a decaying mean

    def seconds(self, num_requests: int) -> dict[int, float]:
        """Each timed k's seconds for a step of `num_requests` (every one drafted)."""
        bucket = self.warm.bucket_for(num_requests)
        warm = self.warm.seconds[bucket]
        served = {k: self.walls[bucket, k] for k in warm if (bucket, k) in self.walls}
        extra = float(np.mean([served[k] - warm[k] for k in served])) if served else 0.0
        return {k: served.get(k, warm[k] + extra) for k in warm}

    def served(self, num_requests: int, k: int) -> bool:
        """Whether a step of `num_requests`' bucket with k drafts has been served (and timed)."""
        return (self.warm.bucket_for(num_requests), k) in self.walls

    def record(self, num_requests: int, num_drafted: int, k: int, wall: float) -> None:
        """Adds a served step of `num_requests` requests, `num_drafted` of them with up to k drafts
        (their verify program's), that took `wall` seconds; the step of every request drafted is
        read off it by the policy's own linear rule (when at least half were: less says little)."""
        bucket = self.warm.bucket_for(num_requests)
        if k not in self.warm.seconds[bucket] or (k and 2 * num_drafted < num_requests):
            return
        if k:
            plain = self.seconds(num_requests)[0]
            wall = plain + (wall - plain) * num_requests / num_drafted
        old = self.walls.get((bucket, k))
        self.walls[bucket, k] = wall if old is None else old + SERVED_WEIGHT * (wall - old)


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
    (`seconds[k] - seconds[0]`, measured with every request drafted). Ties go to fewer drafts,
    and drafting must promise `DRAFT_MARGIN` times the plain step's rate.
    """
    if num_requests < 1 or not 0 <= num_drafted <= num_requests:
        raise ValueError(f"num_drafted={num_drafted} must lie in 0..num_requests={num_requests} (>= 1)")
    plain = seconds[0]
    best_k, best_rate = 0, num_requests / plain * DRAFT_MARGIN
    share = num_drafted / num_requests
    for k in sorted(k for k in seconds if k > 0):
        tokens = num_requests + num_drafted * expected_accepted(prefix_rates, k)
        rate = tokens / (plain + share * (seconds[k] - plain))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


class DraftCount:
    """A runner's choice of each step's drafts a request: `choose_draft_count` over the costs
    timed at warm-up (`use_costs`; none: every step takes the limit it is given) as served steps
    refine them, and the acceptance so far (`acceptance`, fed by each verified step)."""

    def __init__(self, max_drafts: int, verify_tokens: Sequence[int]):
        self.acceptance = AcceptanceEstimate(max_drafts)
        self.costs: ServedCosts | None = None
        self._verify_tokens = tuple(sorted(verify_tokens))
        # The last proposal's start, requests, drafted requests and verify k (None: not a step
        # of decoding requests only, whose wall would say nothing of the shape's).
        self._last: tuple[float, tuple[str, ...], int, int] | None = None

    def use_costs(self, costs: StepCosts | None) -> None:
        self.costs = None if costs is None else ServedCosts(costs)

    def choose(self, limit: int, num_requests: int, num_drafted: int) -> int:
        """The drafts a request for the next step, at most `limit`."""
        if self.costs is None or num_drafted == 0 or limit == 0:
            return limit if self.costs is None else 0
        if not self.costs.served(num_requests, 0):
            # The plain step first: a verify step's extra wall over its warm-up time would
            # otherwise count as host work that every step pays, the plain one too.
            return 0
        seconds = {k: s for k, s in self.costs.seconds(num_requests).items() if k <= limit}
        chosen = choose_draft_count(num_requests, num_drafted, seconds, self.acceptance.prefix_rates())
        if chosen == 0:  # drafts forgone: the estimate gets no evidence
            self.acceptance.relax()
        return chosen

    def step_done(self, now: float, req_ids: Sequence[str], every_sampled: bool) -> None:
        """At the start of a proposal: the step since the last one took `now - start`, recorded
        when both proposals saw the same requests, every one of them with a new token (the step
        decoded and verified them only: no prompt, no request joining or leaving)."""
        last, self._last = self._last, None
        if self.costs is None or last is None or not every_sampled or last[1] != tuple(req_ids):
            return
        start, _, drafted, k = last
        self.costs.record(len(req_ids), drafted, k, now - start)

    def proposed(self, start: float, req_ids: Sequence[str], drafts: Sequence[Sequence[int]]) -> None:
        """At the end of a proposal that started at `start` with every request sampled."""
        most = max((len(d) for d in drafts), default=0)
        k = next((t for t in self._verify_tokens if t >= most), 0) if most else 0
        self._last = (start, tuple(req_ids), sum(1 for d in drafts if d), k)
