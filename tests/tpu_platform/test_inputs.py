# SPDX-License-Identifier: Apache-2.0
"""Request table and step input preparation against hand-worked cases."""

import numpy as np
import pytest

from tpu_platform.buckets import StepBuckets, request_buckets, round_up, token_buckets
from tpu_platform.inputs import exercise_inputs, pack_inputs, padding_inputs, prepare_step, unpack_inputs
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import CachedRequest, NewRequest

PAGE = 4


def _new(req_id, prompt, blocks, computed=0):
    return NewRequest(req_id, prompt, [blocks], computed, SamplingOptions())


def _buckets():
    return StepBuckets.for_limits(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32, page_size=PAGE)


def test_buckets():
    assert round_up(17, (16, 32)) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        round_up(33, (16, 32))
    assert token_buckets(1024, 64) == (1, 4, 16, 32, 64, 128, 256, 512, 1024)
    assert token_buckets(512, 16) == (1, 4, 16, 32, 64, 128, 256, 512)
    assert token_buckets(2048, 256) == (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100, 8) == (1, 4, 8, 16, 32, 64, 100)
    assert token_buckets(3, 8) == (1, 3)
    # Fewer sequences than 16: x4 steps still run to 16 (short prompts cost about what a decode
    # row does), beside the full decode batch.
    assert token_buckets(32, 1) == (1, 4, 16, 32)
    assert token_buckets(64, 2) == (1, 2, 4, 16, 32, 64)
    assert token_buckets(64, 3) == (1, 3, 4, 16, 32, 64)
    buckets = _buckets()
    assert buckets.tokens == (1, 4, 8, 16, 32, 64) and buckets.max_pages == 8
    assert buckets.shape_for(5, 3) == (8, 8, 8) and buckets.shape_for(1, 1) == (1, 1, 8)
    assert buckets.shape_for(2, 2) == (4, 4, 8)
    assert buckets.shape_for(33, 2) == (64, 8, 8)
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        buckets.shape_for(16, 9)


@pytest.mark.parametrize(
    "max_tokens, max_seqs, k", [(1024, 16, 4), (64, 8, 3), (64, 3, 4), (32, 6, 3), (256, 32, 2)]
)
def test_speculation_adds_verify_shapes_and_steps_take_the_smallest_that_holds_them(max_tokens, max_seqs, k):
    """Against a brute-force reference: every step takes, of all the compiled shapes, the one of
    fewest tokens (then fewest sequence rows) that holds its tokens and sequences."""
    plain = StepBuckets.for_limits(
        max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, max_model_len=64, page_size=PAGE
    )
    spec = StepBuckets.for_limits(
        max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, max_model_len=64, page_size=PAGE,
        spec_tokens=k,
    )  # fmt: skip
    assert plain.verify == () and spec.tokens == plain.tokens
    plain_rows = {r for _, r, _ in plain.shapes()}
    assert {r for _, r in spec.verify} <= plain_rows  # no new sampler shapes
    # One request's 1 + k rows, and a full batch's, have a shape of their own.
    assert spec.shape_for(1 + k, 1) == (1 + k, 1, spec.max_pages)
    full = max_seqs * (1 + k)
    if full <= max_tokens and max_seqs & (max_seqs - 1) == 0:
        assert spec.shape_for(full, max_seqs)[:2] == (full, max_seqs)
    shapes = spec.shapes()
    for seqs in range(1, max_seqs + 1):
        for tokens in range(seqs, min(max_tokens, 2 * full) + 1):
            fitting = [s for s in shapes if s[0] >= tokens and s[1] >= seqs]
            assert spec.shape_for(tokens, seqs) == min(fitting)
            assert plain.shape_for(tokens, seqs) == min(
                s for s in plain.shapes() if s[0] >= tokens and s[1] >= seqs
            )
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        spec.shape_for(max_seqs + 1, max_seqs + 1)


@pytest.mark.parametrize("max_seqs", [1, 3, 16, 24])
def test_verification_request_buckets_pad_to_the_next_power_of_two(max_seqs):
    buckets = request_buckets(max_seqs)
    for n in range(1, max_seqs + 1):
        assert round_up(n, buckets) == min(1 << (n - 1).bit_length(), max_seqs)


def test_prefill_and_decode_mix():
    table = RequestTable(capacity=2, max_model_len=32, max_pages=8)
    a = table.add(_new("a", [10, 11, 12, 13, 14], [7, 3]))  # 5 prompt tokens, pages 7 then 3
    b = table.add(_new("b", [20, 21], [5]))
    table.append_token(b, 22)  # b already decoded one token; b has 2 computed
    table.update(CachedRequest("b", None, False, 2, 1))
    plan = prepare_step(table, np.array([a, b]), np.array([5, 1]), _buckets(), PAGE)
    inputs = plan.inputs()
    # a: positions 0..4, slots page7*4+0..3 = 28..31, then page 3 slot 12; b: position 2 -> page5*4+2 = 22
    assert inputs.token_ids.shape == (8,) and inputs.page_indices.shape == (1, 8, 8)
    assert inputs.token_ids[:6].tolist() == [10, 11, 12, 13, 14, 22]
    assert inputs.positions[:6].tolist() == [0, 1, 2, 3, 4, 2]
    assert inputs.slot_mapping[0, :6].tolist() == [28, 29, 30, 31, 12, 22]
    assert (inputs.slot_mapping[0, 6:] == -1).all()
    assert inputs.kv_lens.tolist() == [5, 3, 0, 0, 0, 0, 0, 0]
    assert inputs.cu_q_lens.tolist() == [0, 5, 6, 6, 6, 6, 6, 6, 6]
    assert inputs.logits_indices[:2].tolist() == [4, 5]
    assert inputs.page_indices[0, :2, :3].tolist() == [[7, 3, 0], [5, 0, 0]]
    assert plan.emits_token.tolist() == [True, True] and plan.shape == (8, 8, 8)


def test_partial_prefill_emits_nothing_and_prefix_hit_starts_late():
    table = RequestTable(capacity=4, max_model_len=32, max_pages=8)
    a = table.add(_new("a", list(range(100, 110)), [1, 2, 3]))
    plan = prepare_step(table, np.array([a]), np.array([4]), _buckets(), PAGE)
    inputs = plan.inputs()
    assert not plan.emits_token[0] and inputs.positions[:4].tolist() == [0, 1, 2, 3]
    c = table.add(_new("c", list(range(100, 110)), [1, 2, 4], computed=8))  # prefix-cache hit: 8 cached
    plan = prepare_step(table, np.array([c]), np.array([2]), _buckets(), PAGE)
    inputs = plan.inputs()
    assert inputs.positions[:2].tolist() == [8, 9] and inputs.slot_mapping[0, :2].tolist() == [16, 17]
    assert plan.emits_token[0]


def test_resume_replaces_blocks_and_truncates_outputs():
    table = RequestTable(capacity=1, max_model_len=32, max_pages=8)
    row = table.add(_new("a", [1, 2, 3], [4]))
    for t in (7, 8, 9):
        table.append_token(row, t)
    table.update(CachedRequest("a", [[6, 2]], True, 0, 2))  # preempted, resumed with 2 outputs kept
    assert table.block_table[0, row, :2].tolist() == [6, 2] and table.num_pages[0, row] == 2
    assert table.output_token_ids(row).tolist() == [7, 8]


def test_table_grows_beyond_capacity_and_reuses_rows():
    table = RequestTable(capacity=1, max_model_len=8, max_pages=2)
    rows = [table.add(_new(str(i), [i], [i])) for i in range(3)]
    assert sorted(rows) == [0, 1, 2] and table.token_ids.shape[0] == 4 and table.block_table.shape[1] == 4
    table.remove("1")
    assert table.add(_new("x", [5], [1])) == rows[1]


def test_padding_inputs_compute_nothing():
    inputs = padding_inputs(16, 2, 1)
    assert inputs.num_seqs.tolist() == [0] and (inputs.slot_mapping == -1).all()


def test_two_kv_groups_get_their_own_slots_and_tables():
    table = RequestTable(capacity=2, max_model_len=32, max_pages=8, num_groups=2)
    row = table.add(NewRequest("a", [1, 2, 3, 4, 5], [[1, 2], [6, 7]], 0, SamplingOptions()))
    inputs = prepare_step(table, np.array([row]), np.array([5]), _buckets(), PAGE).inputs()
    assert inputs.slot_mapping[:, :5].tolist() == [[4, 5, 6, 7, 8], [24, 25, 26, 27, 28]]
    assert inputs.page_indices[:, 0, :2].tolist() == [[1, 2], [6, 7]]
    inputs = padding_inputs(4, 2, 3, num_groups=2)
    assert inputs.slot_mapping.shape == (2, 4) and inputs.page_indices.shape == (2, 2, 3)


def test_pack_round_trips():
    table = RequestTable(capacity=2, max_model_len=32, max_pages=8, num_groups=2)
    row = table.add(NewRequest("a", [1, 2, 3, 4, 5], [[1, 2], [6, 7]], 0, SamplingOptions()))
    inputs = prepare_step(table, np.array([row]), np.array([5]), _buckets(), PAGE).inputs()
    packed, dims = pack_inputs(inputs)
    assert packed.dtype == np.int32 and packed.ndim == 1 and dims == (8, 8, 8, 2)
    restored = unpack_inputs(packed, dims)
    for name in (
        "token_ids",
        "positions",
        "slot_mapping",
        "kv_lens",
        "page_indices",
        "cu_q_lens",
        "num_seqs",
    ):
        assert np.array_equal(getattr(restored, name), getattr(inputs, name)), name


@pytest.mark.parametrize(
    ("t_pad", "r_pad", "num_seqs"), [(1, 1, 1), (64, 64, 1), (64, 64, 64), (1024, 64, 64), (16, 16, 5)]
)
def test_exercise_inputs_are_consistent_ragged_steps(t_pad, r_pad, num_seqs):
    """Warm-up inputs: real sequences (so every loop runs) that only write the first pages."""
    inputs = exercise_inputs(t_pad, r_pad, 8, 2, 40, page_size=16, num_seqs=num_seqs)
    n = int(inputs.num_seqs[0])
    q_lens = np.diff(inputs.cu_q_lens)
    assert 1 <= n <= min(num_seqs, r_pad) and (q_lens[:n] > 0).all() and (q_lens[n:] == 0).all()
    tokens = int(inputs.cu_q_lens[n])
    assert tokens == max(1, t_pad - 1)
    np.testing.assert_array_equal(inputs.kv_lens[:n], q_lens[:n])  # each sequence sees its own tokens
    for i in range(n):
        start, end = inputs.cu_q_lens[i], inputs.cu_q_lens[i + 1]
        np.testing.assert_array_equal(inputs.positions[start:end], np.arange(end - start))
        assert inputs.logits_indices[i] == end - 1
    slots = inputs.slot_mapping[:, :tokens]
    assert (slots >= 0).all() and (slots < 40 * 16).all() and (inputs.slot_mapping[:, tokens:] == -1).all()
    assert (inputs.page_indices < 40).all()
