# SPDX-License-Identifier: Apache-2.0
"""The cost-aware draft count (`tpu_platform.speculation.adaptive`), on hand-worked numbers."""

import numpy as np
import pytest

from tpu_platform.speculation.adaptive import (
    DECAY,
    DRAFT_MARGIN,
    PRIOR_RATE,
    PRIOR_WEIGHT,
    SERVED_WEIGHT,
    AcceptanceEstimate,
    DraftCount,
    ServedCosts,
    StepCosts,
    choose_draft_count,
    expected_accepted,
)


def test_expected_accepted_sums_the_prefix_probabilities():
    # P(first 1 kept) = 0.8, P(first 2) = 0.6, ...: E[kept of 2] = 0.8 + 0.6.
    assert expected_accepted([0.8, 0.6, 0.3, 0.1], 2) == pytest.approx(1.4)
    assert expected_accepted([0.8, 0.6, 0.3, 0.1], 0) == 0.0


def test_one_request_drafts_where_extra_rows_are_nearly_free():
    # One request: plain step 10 ms, with 4 drafts 12 ms. E[kept] = 0.9 + 0.8 + 0.7 + 0.6 = 3.0,
    # so k = 4 gives 4 tokens / 12 ms = 333/s against 1 / 10 ms = 100/s.
    rates = [0.9, 0.8, 0.7, 0.6]
    assert choose_draft_count(1, 1, {0: 0.010, 4: 0.012}, rates) == 4


def test_a_compute_bound_batch_does_not_draft():
    # 16 requests: plain 100 ms, with 4 drafts each 450 ms (80 rows). E[kept of 4] = 2.2:
    # 16 * 3.2 / 0.45 = 114/s against 16 / 0.1 = 160/s.
    rates = [0.8, 0.6, 0.5, 0.3]
    assert choose_draft_count(16, 16, {0: 0.100, 4: 0.450}, rates) == 0


def test_the_best_rate_among_several_counts():
    # 8 requests, rates 0.8 then 0.4 (E[kept of 1] = 0.8, of 2 = 1.2):
    # k=0: 8 / 0.1 = 80/s; k=1: 8 * 1.8 / 0.15 = 96/s; k=2: 8 * 2.2 / 0.2 = 88/s.
    costs = {0: 0.10, 1: 0.15, 2: 0.20}
    assert choose_draft_count(8, 8, costs, [0.8, 0.4]) == 1


def test_only_the_drafted_share_pays_for_drafts():
    # 16 requests, 4 of them drafted: time 0.1 + (4/16) * (0.40 - 0.1) = 0.175 s. Plain: 160/s;
    # drafting must promise DRAFT_MARGIN (1.1) times that, 176/s.
    costs = {0: 0.1, 4: 0.40}
    assert DRAFT_MARGIN == 1.1
    # E[kept] = 2.2: 16 + 4 * 2.2 = 24.8 tokens / 0.175 s = 142/s: no drafts.
    assert choose_draft_count(16, 4, costs, [0.8, 0.6, 0.5, 0.3]) == 0
    # E[kept] = 3.4: 29.6 tokens: 169/s, above the plain step's rate but within the margin.
    assert choose_draft_count(16, 4, costs, [1.0, 1.0, 1.0, 0.4]) == 0
    # E[kept] = 4 (every draft kept): 32 tokens: 183/s: drafts win.
    assert choose_draft_count(16, 4, costs, [1.0, 1.0, 1.0, 1.0]) == 4


def test_no_drafted_request_means_no_drafts():
    assert choose_draft_count(3, 0, {0: 0.01, 4: 0.011}, [1.0] * 4) == 0


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="num_drafted"):
        choose_draft_count(2, 3, {0: 0.01, 4: 0.02}, [0.5] * 4)


def test_costs_of_an_untimed_bucket_are_the_largest_timed_ones():
    costs = StepCosts({1: {0: 0.01, 4: 0.012}, 4: {0: 0.02, 4: 0.05}})
    assert costs.for_requests(1) == {0: 0.01, 4: 0.012}
    assert costs.for_requests(3) == {0: 0.02, 4: 0.05}
    assert costs.for_requests(16) == {0: 0.02, 4: 0.05}


def test_acceptance_estimate_counts_prefixes_with_decay():
    estimate = AcceptanceEstimate(3)
    prior = PRIOR_RATE ** np.arange(1, 4)  # the first 1, 2, 3 drafts all kept
    np.testing.assert_allclose(estimate.prefix_rates(), prior)
    # Request 0: 3 drafts, 2 kept; request 1: 1 draft, kept; request 2: 2 drafts, none kept.
    estimate.record(np.array([3, 1, 2]), np.array([2, 1, 0]))
    offered = PRIOR_WEIGHT * DECAY + np.array([3, 2, 1])  # drafts at positions 1, 2, 3
    kept = PRIOR_WEIGHT * prior * DECAY + np.array([2, 1, 0])  # first 1, 2, 3 all kept
    np.testing.assert_allclose(estimate.prefix_rates(), np.minimum.accumulate(kept / offered))


def test_acceptance_estimate_follows_a_workload_whose_drafts_are_all_kept():
    estimate = AcceptanceEstimate(4)
    for _ in range(300):
        estimate.record(np.array([4, 4]), np.array([4, 4]))
    assert estimate.prefix_rates().min() > 0.98
    for _ in range(300):
        estimate.record(np.array([4, 4]), np.array([0, 0]))
    assert estimate.prefix_rates().max() < 0.02


# -- the runner's speculation proposing with timed step costs ------------------------------------

CHEAP_DRAFTS = StepCosts({1: {0: 0.010, 4: 0.011}, 2: {0: 0.010, 4: 0.012}})
DEAR_DRAFTS = StepCosts({1: {0: 0.010, 4: 0.011}, 2: {0: 0.010, 4: 0.050}})


def _speculation(costs, *, per_batch_size=False, draft=None):
    from tests.tpu_platform.test_speculation import _speculation_with
    from tpu_platform.speculation import SpeculationConfig

    config = SpeculationConfig(num_tokens=4, min_n=1, max_n=3, per_batch_size=per_batch_size)
    speculation = _speculation_with(config)
    speculation.draft_count.use_costs(costs)
    if costs is not None:  # plain steps served as timed (else the first step of a bucket has none)
        for bucket, seconds in costs.seconds.items():
            speculation.draft_count.costs.record(bucket, 0, 0, seconds[0])
    speculation.draft = draft
    return speculation


def _propose(speculation, req_ids=("a", "b")):
    from tests.tpu_platform.test_speculation import _looping_table, _step

    speculation.apply(_step(list(req_ids), 4))
    return speculation.propose(_looping_table(), list(req_ids), [[1]] * len(req_ids))


def _propose_full(table):
    from tpu_platform.speculation import propose_ngram

    return propose_ngram(table.token_ids, table.num_tokens, k=4, min_n=1, max_n=3, max_model_len=64)


def test_ngram_drafts_follow_the_step_costs():
    from tests.tpu_platform.test_speculation import _looping_table

    full = _propose_full(_looping_table())
    assert _propose(_speculation(CHEAP_DRAFTS)) == full
    # Two requests whose verify step costs 5x the plain one: 2 * (1 + 2) tokens (the prior's
    # E[kept of 4] = 0.5 + 0.25 + ... < 1) do not pay 5x.
    assert _propose(_speculation(DEAR_DRAFTS)) == [[], []]
    # One request of the two buckets' costs: drafts again (1.1x the time for 1 + E[kept]).
    assert _propose(_speculation(DEAR_DRAFTS), ("a",)) == full[:1]


def test_the_users_per_batch_size_schedule_wins_over_the_step_costs():
    import types

    from tests.tpu_platform.test_speculation import _looping_table
    from tpu_platform.warm_up import time_speculation

    speculation = _speculation(None, per_batch_size=True)
    assert time_speculation(types.SimpleNamespace(speculation=speculation, mesh=None)) is None
    assert _propose(speculation) == _propose_full(_looping_table())


def test_a_model_proposer_does_not_run_on_a_step_that_drafts_nothing():
    class CountingDraft:
        calls = 0

        def propose(self, programs, table, rows, max_model_len):
            CountingDraft.calls += 1
            return np.array([[3, 4, 5, 6]] * rows.size, np.int32)

    assert _propose(_speculation(DEAR_DRAFTS, draft=CountingDraft())) == [[], []]
    assert CountingDraft.calls == 0
    assert _propose(_speculation(CHEAP_DRAFTS, draft=CountingDraft())) == [[3, 4, 5, 6]] * 2
    assert CountingDraft.calls == 1


def test_an_eagle3_head_runs_its_pass_but_drafts_for_nobody_on_such_a_step():
    from tpu_platform.speculation.eagle3 import Eagle3Proposer

    wanted_seen = []

    class Head(Eagle3Proposer):
        def __init__(self):  # no weights: only `propose` is called
            pass

        def propose(self, programs, table, wanted, max_model_len):
            wanted_seen.append(wanted.tolist())
            return np.array([[7, 8, 9, 10]] * wanted.size, np.int32).reshape(-1, 4)

    assert _propose(_speculation(DEAR_DRAFTS, draft=Head())) == [[], []]
    assert _propose(_speculation(CHEAP_DRAFTS, draft=Head())) == [[7, 8, 9, 10]] * 2
    assert wanted_seen == [[], [0, 1]]  # the pass ran both times (the head's cache), drafts once


def test_an_estimate_that_stopped_drafting_drifts_back_to_the_prior():
    estimate = AcceptanceEstimate(2)
    for _ in range(300):
        estimate.record(np.array([2]), np.array([0]))
    assert estimate.prefix_rates().max() < 0.02
    for _ in range(1000):  # steps without drafts
        estimate.relax()
    np.testing.assert_allclose(estimate.prefix_rates(), [PRIOR_RATE, PRIOR_RATE**2], rtol=0.01)


def test_served_walls_refine_the_warm_up_costs():
    costs = ServedCosts(StepCosts({16: {0: 0.10, 4: 0.40}}))
    assert costs.seconds(16) == {0: 0.10, 4: 0.40}
    # A plain step served in 0.13 s: 0.03 s of host work the warm-up missed, added to k = 4 too.
    costs.record(16, 0, 0, 0.13)
    assert costs.seconds(16) == pytest.approx({0: 0.13, 4: 0.43})
    # 8 of 16 drafted took 0.33 s: all 16 would take 0.13 + (0.33 - 0.13) * 2 = 0.53 s; the first
    # wall of a shape is taken as it is.
    costs.record(16, 8, 4, 0.33)
    assert costs.seconds(16) == pytest.approx({0: 0.13, 4: 0.53})
    # Later walls move the mean by SERVED_WEIGHT of the difference.
    costs.record(16, 0, 0, 0.23)
    assert costs.seconds(16)[0] == pytest.approx(0.13 + SERVED_WEIGHT * 0.10)
    # Fewer than half drafted: not recorded (its extrapolation would magnify the noise).
    before = costs.seconds(16)
    costs.record(16, 7, 4, 1.0)
    assert costs.seconds(16) == before


def test_the_walls_recorded_are_those_of_decode_only_steps():
    count = DraftCount(4, (4,))
    count.use_costs(StepCosts({2: {0: 0.10, 4: 0.40}}))
    count.step_done(1.0, ["a", "b"], True)  # nothing before it
    count.proposed(1.0, ["a", "b"], [[5, 6], [7]])  # both drafted: the k = 4 program verifies
    count.step_done(1.5, ["a", "b"], True)
    assert count.costs.walls == {(2, 4): 0.5}
    count.proposed(1.5, ["a", "b"], [[], []])
    count.step_done(1.6, ["a", "c"], True)  # another request: its prompt was in the step
    count.proposed(1.6, ["a", "c"], [[], []])
    count.step_done(1.7, ["a", "c"], False)  # one still prefilling
    assert count.costs.walls == {(2, 4): 0.5}


def test_a_bucket_drafts_only_once_its_plain_step_was_served():
    count = DraftCount(4, (4,))
    count.use_costs(CHEAP_DRAFTS)
    assert count.choose(4, 2, 2) == 0  # no plain step of 2 requests timed while serving yet
    count.costs.record(2, 0, 0, 0.010)
    assert count.choose(4, 2, 2) == 4
