# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding's pieces on their own: the n-gram proposer against vLLM's, and the jitted
draft verification on hand-worked cases and, statistically, against the target distribution."""

import numpy as np
import pytest

from tests.speculation_statistics import check_follows_target
from tests.speculation_statistics import random_tensors as _tensors
from tpu_platform.planner.draft import DraftMemory, pages_with_draft
from tpu_platform.sampling import SamplerFlags, SamplingTensors
from tpu_platform.sampling.tensors import RandomTensors
from tpu_platform.speculation import SpeculationConfig, propose_ngram
from tpu_platform.speculation.draft_model import kv_share
from tpu_platform.speculation.rejection import verify_drafts

GREEDY = SamplerFlags(all_greedy=True)


def _vllm_ngram(tokens, k, min_n, max_n, max_model_len):
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    return _find_longest_matched_ngram_and_propose_tokens(
        np.asarray(tokens, np.int32), min_n, max_n, max_model_len, k
    ).tolist()


def _brute_force_ngram(tokens, k, min_n, max_n, max_model_len):
    """vLLM's rule spelled out: the longest n in [min_n, max_n] whose suffix occurs ending before
    the last token, its earliest occurrence, and what follows it (room permitting)."""
    tokens, total = list(tokens), len(tokens)
    for n in range(min(max_n, total), min_n - 1, -1):
        for end in range(n - 1, total - 1):
            if tokens[end - n + 1 : end + 1] == tokens[total - n :]:
                room = min(k, max_model_len - total)
                return tokens[end + 1 : end + 1 + room] if room > 0 else []
    return []


CASES = [(3, 1, 3, 4), (5, 2, 4, 3), (2, 3, 3, 2), (4, 1, 1, 6)]


def _random_histories(k, vocab):
    # Small vocabularies repeat a lot: long matches, ties between occurrences, overlapping ones.
    rng = np.random.default_rng(k * 100 + vocab)
    return rng.integers(0, vocab, (64, 48)).astype(np.int32), rng.integers(1, 40, 64)


@pytest.mark.parametrize(("k", "min_n", "max_n", "vocab"), CASES)
def test_ngram_proposals_follow_vllms_rule(k, min_n, max_n, vocab):
    tokens, lengths = _random_histories(k, vocab)
    max_model_len = 44  # some histories leave less room than k
    got = propose_ngram(tokens, lengths, k=k, min_n=min_n, max_n=max_n, max_model_len=max_model_len)
    expected = [
        _brute_force_ngram(tokens[b, : lengths[b]], k, min_n, max_n, max_model_len) for b in range(64)
    ]
    assert got == expected
    assert sum(map(len, got)) > 0


@pytest.mark.slow  # imports vLLM and compiles its numba proposer
@pytest.mark.parametrize(("k", "min_n", "max_n", "vocab"), CASES)
def test_ngram_proposals_match_vllms_proposer(k, min_n, max_n, vocab):
    tokens, lengths = _random_histories(k, vocab)
    got = propose_ngram(tokens, lengths, k=k, min_n=min_n, max_n=max_n, max_model_len=44)
    assert got == [_vllm_ngram(tokens[b, : lengths[b]], k, min_n, max_n, 44) for b in range(64)]


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    tokens = np.array([[5, 6, 7, 1, 5, 6, 8, 2, 6, 7, 9, 5, 6], [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    # Row 0 ends in "5 6": it occurs at 0 and 4 (the earliest wins), so "7 1 5" follows; row 1
    # has no repeated suffix.
    got = propose_ngram(tokens, np.array([13, 4]), k=3, min_n=1, max_n=3, max_model_len=100)
    assert got == [[7, 1, 5], []]


def test_greedy_verification_keeps_drafts_while_they_equal_the_argmax():
    # Argmax per position (vocab 8), 3 drafts each:
    #   row 0: argmax 1 2 3 4, drafts 1 2 3 -> all kept, bonus 4: [1 2 3 4], count 4
    #   row 1: argmax 1 2 3 4, drafts 1 5 3 -> first kept, second rejected: [1 2], count 2
    #   row 2: argmax 6 2 3 4, drafts 1 2 3 -> none kept: [6], count 1
    #   row 3: argmax 1 2 3 4, drafts 1 2 3 but only 1 real -> [1 2], count 2
    #   row 4: argmax 1 2 3 4, placeholders -1 -> [1], count 1
    argmax = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [6, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    logits = np.eye(8, dtype=np.float32)[argmax] * 5.0
    drafts = np.array([[1, 2, 3], [1, 5, 3], [1, 2, 3], [1, 2, 3], [-1, -1, -1]], np.int32)
    num_drafts = np.array([3, 3, 3, 1, 3], np.int32)
    tokens, counts = verify_drafts(logits, drafts, num_drafts, _tensors(5, 0.0), flags=GREEDY)
    counts = np.asarray(counts)
    assert counts.tolist() == [4, 2, 1, 2, 1]
    outputs = [np.asarray(tokens)[r, : counts[r]].tolist() for r in range(5)]
    assert outputs == [[1, 2, 3, 4], [1, 2], [6], [1, 2], [1]]


def test_random_verification_accepts_certain_drafts_and_resamples_impossible_ones():
    # top_k=1 makes p one-hot on the argmax: a draft equal to it has p = 1 (always kept), any other
    # p = 0 (always rejected, and the replacement comes from p with the draft zeroed: the argmax).
    argmax = np.array([[1, 2, 3], [1, 2, 3], [4, 2, 3]])
    logits = np.eye(8, dtype=np.float32)[argmax] * 3.0
    drafts = np.array([[1, 2], [1, 0], [1, 2]], np.int32)
    for seed in range(5):
        tensors = _tensors(3, 1.0, seed=seed, top_k=1)
        tokens, counts = verify_drafts(
            logits, drafts, np.full(3, 2, np.int32), tensors, flags=SamplerFlags(filters=True)
        )
        counts = np.asarray(counts)
        assert counts.tolist() == [3, 2, 1]
        assert [np.asarray(tokens)[r, : counts[r]].tolist() for r in range(3)] == [[1, 2, 3], [1, 2], [4]]


def test_sampled_tokens_follow_the_target_distribution():
    # Each of N rows is an independent request drafting "0 then 1" on a 4-token vocabulary whose
    # target p is the same at every position. Without speculation its first token would follow p,
    # and its second (given the first was 0) too: the rejection rule must preserve both.
    p = np.array([0.45, 0.3, 0.15, 0.1])
    logits = np.broadcast_to(np.log(p), (3, 4))
    check_follows_target(logits, np.array([0, 1]), rows=20000, seed=7)


def test_a_seeded_rows_draws_depend_on_its_seed_and_progress_only():
    logits = np.random.default_rng(0).normal(size=(4, 3, 16)).astype(np.float32)
    drafts = np.random.default_rng(1).integers(0, 16, (4, 2)).astype(np.int32)
    tensors = _tensors(4, 0.9, seed=3)
    out = verify_drafts(logits, drafts, np.full(4, 2, np.int32), tensors, flags=SamplerFlags())
    # Row 2 alone (first in a batch of its own) draws the same.
    alone = SamplingTensors(
        temperature=tensors.temperature[2:3],
        random=RandomTensors(
            tensors.random.key_data[2:3], tensors.random.salt[2:3], tensors.random.num_generated[2:3]
        ),
    )
    single = verify_drafts(logits[2:3], drafts[2:3], np.full(1, 2, np.int32), alone, flags=SamplerFlags())
    assert np.asarray(single[1])[0] == np.asarray(out[1])[2]
    count = int(np.asarray(out[1])[2])
    assert np.asarray(single[0])[0, :count].tolist() == np.asarray(out[0])[2, :count].tolist()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(num_tokens=0), "num_speculative_tokens"),
        (dict(num_tokens=9), "num_speculative_tokens"),
        (dict(num_tokens=2, method="eagle3"), "eagle3"),
        (dict(num_tokens=2, min_n=3, max_n=2), "prompt_lookup_min"),
        (dict(num_tokens=2, method="draft_model"), "checkpoint directory"),
        (dict(num_tokens=2, draft_model="/some/draft"), "checkpoint directory"),
        (dict(num_tokens=2, schedule_tokens=(2,)), "schedule_tokens"),
        (dict(num_tokens=2, schedule_tokens=(0,)), "schedule_tokens"),
    ],
)
def test_speculation_config_refuses_what_is_not_served(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SpeculationConfig(**kwargs)


def test_the_draft_models_pages_take_their_share_of_the_kv_budget():
    # One draft page per target page: target and draft pages of 3000 and 1000 bytes share 4000.
    target_share = kv_share(3000, 1000, 40_000)
    assert target_share == 30_000
    pages = target_share // 3000
    assert pages * (3000 + 1000) <= 40_000


@pytest.mark.parametrize(
    ("kv_bytes", "target_page", "draft_weights", "draft_page"),
    [(32 << 30, 2 << 20, 3 << 30, 512 << 10), (10_000_000, 4096, 1_000_000, 4096), (100, 10, 200, 10)],
)
def test_the_planner_fits_a_draft_beside_its_target(kv_bytes, target_page, draft_weights, draft_page):
    pages = pages_with_draft(kv_bytes, target_page, DraftMemory(draft_weights, draft_page))

    def used(n):
        return draft_weights + n * (target_page + draft_page)

    assert used(pages) <= kv_bytes or pages == 0
    assert used(pages + 1) > kv_bytes  # the most that fit


def _speculation(k, draft=None):
    speculation = _speculation_with(SpeculationConfig(num_tokens=k, min_n=1, max_n=3))
    speculation.draft = draft
    return speculation


def _speculation_with(config):
    from tpu_platform.speculation.verifier import SpeculativeDecoding

    return SpeculativeDecoding(
        config,
        None,
        None,
        hidden_size=8,
        vocab_size=16,
        max_model_len=64,
        feed_width=4,
        sharding=None,
        context="",
    )


def _step(req_ids, num_spec_tokens):
    from tpu_platform.sampling import SamplingOptions
    from tpu_platform.step_update import CachedRequests, NewRequest, StepUpdate

    new = [NewRequest(r, [1], [[0]], 0, SamplingOptions(temperature=0.0)) for r in req_ids]
    cached = CachedRequests([], [], set(), [], [])
    return StepUpdate(new, cached, set(), dict.fromkeys(req_ids, 1), num_spec_tokens=num_spec_tokens)


def _looping_table():
    """Two requests whose histories repeat a span: the n-gram proposer finds k drafts for each."""
    import types

    tokens = np.zeros((2, 64), np.int32)
    tokens[0, :24] = np.tile([5, 6, 7, 8, 9, 10], 4)
    tokens[1, :21] = np.tile([11, 12, 13], 7)
    return types.SimpleNamespace(token_ids=tokens, num_tokens=np.array([24, 21]), row_of={"a": 0, "b": 1})


@pytest.mark.parametrize("per_step", [None, 4, 2, 1, 0])
def test_ngram_proposes_at_most_the_steps_scheduled_drafts(per_step):
    table, k = _looping_table(), 4
    full = propose_ngram(table.token_ids, table.num_tokens, k=k, min_n=1, max_n=3, max_model_len=64)
    assert [len(d) for d in full] == [k, k]
    speculation = _speculation(k)
    speculation.apply(_step(["a", "b"], per_step))
    got = speculation.propose(table, ["a", "b"], [[1], [1]])
    limit = k if per_step is None else per_step
    assert got == [d[:limit] for d in full]


def test_a_model_proposers_drafts_are_cut_to_the_steps_count():
    class FixedDraft:  # a proposer whose k drafts are known
        def propose(self, programs, table, rows, max_model_len):
            return np.array([[3, 4, 5, 6]] * rows.size, np.int32) + rows[:, None]

    speculation = _speculation(4, FixedDraft())
    speculation.apply(_step(["a", "b"], 2))
    assert speculation.propose(_looping_table(), ["a", "b"], [[1], [1]]) == [[3, 4], [4, 5]]
    speculation.apply(_step(["a", "b"], 0))
    assert speculation.propose(_looping_table(), ["a", "b"], [[1], [1]]) == [[], []]


def test_the_schedules_smaller_k_values_get_verification_programs():
    import types

    from plugin_shim.speculative import runner_speculation

    def config(schedule):
        spec = types.SimpleNamespace(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
            num_speculative_tokens_per_batch_size=schedule,
        )  # fmt: skip
        return types.SimpleNamespace(speculative_config=spec, model_config=None)

    # vLLM caps a range's k at num_speculative_tokens; 0 (no drafts) needs no program.
    schedule = [(1, 2, 6), (3, 8, 2), (9, 16, 1), (17, 32, 2), (33, 64, 0)]
    assert runner_speculation(config(schedule)).schedule_tokens == (1, 2)
    assert runner_speculation(config(None)).schedule_tokens == ()
    speculation = _speculation_with(runner_speculation(config(schedule)))
    assert speculation.verify_tokens == (1, 2, 4)
