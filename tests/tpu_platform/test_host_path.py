# SPDX-License-Identifier: Apache-2.0
"""The vectorised per-step host path against simple per-request references."""

import dataclasses

import jax
import numpy as np
import pytest

from tpu_platform.buckets import StepBuckets
from tpu_platform.dispatch import FlatCall, HostViews
from tpu_platform.inputs import StepBuffers, _aligned_empty, pack_inputs, prepare_step
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplingBatch, SamplingOptions
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest

PAGE = 4


def _update_reference(table: RequestTable, request: CachedRequest) -> None:
    """The per-request update, one request at a time."""
    row = table.row_of[request.req_id]
    if request.resumed:
        table.num_pages[:, row] = 0
    if request.new_block_ids is not None:
        table._append_pages(row, request.new_block_ids)
    table.num_computed[row] = request.num_computed_tokens
    known = table.num_prompt_tokens[row] + request.num_output_tokens
    table.num_tokens[row] = min(table.num_tokens[row], known)


def _tables(seed: int, num_groups: int) -> tuple[RequestTable, RequestTable, list[str]]:
    rng = np.random.default_rng(seed)
    tables = [RequestTable(4, 32, 8, num_groups) for _ in range(2)]
    req_ids = [f"r{i}" for i in range(6)]
    for i, req_id in enumerate(req_ids):
        prompt = rng.integers(0, 100, int(rng.integers(1, 12))).tolist()
        blocks = [[int(b) for b in rng.integers(0, 50, 2)] for _ in range(num_groups)]
        outputs = rng.integers(0, 100, int(rng.integers(0, 6))).tolist()
        for table in tables:
            row = table.add(NewRequest(req_id, prompt, blocks, i, SamplingOptions()))
            for token in outputs:
                table.append_token(row, token)
    return *tables, req_ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_groups", [1, 2])
def test_update_many_matches_one_at_a_time(seed, num_groups):
    fast, reference, req_ids = _tables(seed, num_groups)
    rng = np.random.default_rng(100 + seed)
    requests = []
    for req_id in rng.permutation(req_ids)[: int(rng.integers(1, 7))]:
        new_blocks = None
        if rng.random() < 0.5:
            sizes = rng.integers(0, 3, num_groups)
            new_blocks = [[int(b) for b in rng.integers(0, 50, size)] for size in sizes]
        requests.append(
            CachedRequest(
                str(req_id),
                new_blocks,
                resumed=bool(rng.random() < 0.3),
                num_computed_tokens=int(rng.integers(0, 20)),
                num_output_tokens=int(rng.integers(0, 6)),
            )
        )
    rows = fast.update_many(CachedRequests.of(requests))
    for request in requests:
        _update_reference(reference, request)
    assert rows.tolist() == [fast.row_of[r.req_id] for r in requests]
    for name in ("token_ids", "num_tokens", "num_computed", "block_table", "num_pages"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(reference, name), err_msg=name)


@pytest.mark.parametrize("count", [1, 2, 4])  # scalar and fancy indexing
def test_append_tokens_matches_append_token_and_stops_at_max_len(count):
    fast, reference, req_ids = _tables(0, 1)
    rows = np.array([fast.row_of[r] for r in req_ids[:count]])
    fast.num_tokens[rows[0]] = reference.num_tokens[rows[0]] = 32  # full: the token is dropped
    for step in range(3):
        tokens = np.arange(count, dtype=np.int32) + 10 * step
        fast.append_tokens(rows, tokens)
        for row, token in zip(rows, tokens, strict=True):
            reference.append_token(int(row), int(token))
    np.testing.assert_array_equal(fast.token_ids, reference.token_ids)
    np.testing.assert_array_equal(fast.num_tokens, reference.num_tokens)


@pytest.mark.parametrize("num_scheduled", [[1, 1, 1], [3, 1, 2], [1]])
def test_prepared_buffer_is_the_packed_inputs(num_scheduled):
    table = RequestTable(4, 32, 8, 2)
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32, page_size=PAGE
    )
    rows = []
    for i in range(len(num_scheduled)):
        prompt = list(range(10 + i))
        rows.append(table.add(NewRequest(f"r{i}", prompt, [[1, 2, 3], [4, 5, 6]], 5 + i, SamplingOptions())))
    table.block_table[:] = 99  # stale columns past each row's pages are passed on as they are
    table.block_table[:, :, :3] = [[1, 2, 3]]
    plan = prepare_step(table, np.array(rows), np.array(num_scheduled, np.int32), buckets, PAGE)
    inputs = plan.inputs()
    packed, dims = pack_inputs(inputs)
    assert plan.dims == dims
    np.testing.assert_array_equal(plan.packed, packed)
    n, total = len(num_scheduled), sum(num_scheduled)
    positions = np.concatenate([np.arange(5 + i, 5 + i + q) for i, q in enumerate(num_scheduled)])
    assert inputs.positions[:total].tolist() == positions.tolist() and (inputs.positions[total:] == 0).all()
    assert inputs.cu_q_lens[: n + 1].tolist() == np.concatenate([[0], np.cumsum(num_scheduled)]).tolist()
    assert (inputs.page_indices[:, n:] == 0).all() and (inputs.slot_mapping[:, total:] == -1).all()


def _history(rows=8, max_len=64):
    table = RequestTable(rows, max_len, 4)
    return table


def test_sampling_prepare_reuses_row_parameters_until_they_change():
    history = _history()
    batch = SamplingBatch(8, 64, 64)
    for row, options in enumerate([SamplingOptions(), SamplingOptions(temperature=0.0)]):
        history.add(NewRequest(f"r{row}", [1, 2, 3], [[0]], 0, SamplingOptions()))
        batch.add_request(row, options)
    rows = np.array([0, 1])
    first, flags = batch.prepare(rows, 4, history, step_seed=1)
    again, flags_again = batch.prepare(rows, 4, history, step_seed=2)
    assert flags_again == flags and again.temperature is first.temperature  # reused
    assert not np.array_equal(first.random.key_data, again.random.key_data)  # per step
    batch.add_request(0, SamplingOptions(temperature=0.0, logprobs=2))
    changed, flags = batch.prepare(rows, 4, history, step_seed=2)
    assert flags.all_greedy and flags.num_logprobs is not None and changed.random is None
    _, flags = batch.prepare(np.array([1]), 4, history, step_seed=2)
    assert flags.num_logprobs is None


def test_sampling_prepare_decides_min_tokens_every_step():
    history = _history()
    batch = SamplingBatch(8, 64, 64)
    history.add(NewRequest("r0", [1, 2, 3], [[0]], 0, SamplingOptions()))
    batch.add_request(0, SamplingOptions(min_tokens=1, stop_token_ids=(7,)))
    tensors, flags = batch.prepare(np.array([0]), 4, history, step_seed=0)
    assert flags.sparse and tensors.sparse.token_ids[0, 0] == 7
    history.append_token(0, 5)
    tensors, flags = batch.prepare(np.array([0]), 4, history, step_seed=0)
    assert not flags.sparse and tensors.sparse is None


def test_with_grammar_adds_bitmask_rows():
    history = _history()
    batch = SamplingBatch(8, 64, 64)
    for row in range(2):
        history.add(NewRequest(f"r{row}", [1], [[0]], 0, SamplingOptions()))
        batch.add_request(row, SamplingOptions())
    tensors, flags = batch.prepare(np.array([0, 1]), 4, history, step_seed=0)
    mask = np.array([5, 0], np.int32)
    with_mask, with_flags = batch.with_grammar(tensors, flags, [None, mask], 2)
    expected, expected_flags = batch.prepare(np.array([0, 1]), 4, history, 0, grammar_bitmasks=[None, mask])
    assert with_flags == expected_flags and with_flags.grammar
    np.testing.assert_array_equal(with_mask.grammar_bitmask, expected.grammar_bitmask)
    np.testing.assert_array_equal(with_mask.grammar_rows, [False, True, False, False])
    assert batch.with_grammar(tensors, flags, [None, None], 2) == (tensors, flags)


def test_flat_call_matches_the_compiled_call():
    def step(weights, caches, packed):
        total = sum(w.sum() for w in weights) + packed.sum()
        return total, [c + total for c in caches]

    weights = [jax.numpy.full((2, 3), i, jax.numpy.float32) for i in range(3)]
    caches = [jax.numpy.zeros(4, jax.numpy.float32) for _ in range(2)]
    packed = np.arange(5, dtype=np.float32)
    compiled = jax.jit(step, donate_argnums=(1,)).trace(weights, caches, packed).lower().compile()
    expected_total, expected_caches = compiled(weights, [c.copy() for c in caches], packed)
    flat = FlatCall.of(compiled, len(weights) + len(caches) + 1)
    assert flat is not None
    outputs = flat([*weights, *caches, flat.put(len(weights) + len(caches), packed)])
    assert float(outputs[0]) == float(expected_total)
    for got, want in zip(outputs[1:], expected_caches, strict=True):
        np.testing.assert_array_equal(got, want)
    assert caches[0].is_deleted()  # donated, as with the compiled call

    unused = jax.jit(lambda a, b: a * 2).trace(weights[0], weights[1]).lower().compile()
    flat = FlatCall.of(unused, 2)
    np.testing.assert_array_equal(flat([weights[1], weights[0]])[0], weights[1] * 2)


def test_host_views_pass_a_reused_buffer_again_and_see_its_new_contents():
    weights = jax.numpy.arange(6, dtype=jax.numpy.int32)
    compiled = jax.jit(lambda w, packed: w[: packed.size] * packed).trace(weights, np.zeros(5, np.int32))
    flat = FlatCall.of(compiled.lower().compile(), 2)
    views, aligned = HostViews(), _aligned_empty(5)
    unaligned = np.zeros(6, np.int32)[1:]  # 4 bytes off a 16-byte boundary: copied
    arrays = {}
    for step in range(3):
        for name, buffer in (("aligned", aligned), ("unaligned", unaligned)):
            buffer[:] = np.arange(5) + 10 * step  # rewritten once the step reading it finished
            array = views.put(flat, 1, buffer)
            np.testing.assert_array_equal(flat([weights, array])[0], np.arange(5) * buffer)
            arrays.setdefault(name, []).append(array)
    assert all(a is arrays["aligned"][0] for a in arrays["aligned"])  # one transfer, then reused
    assert len({id(a) for a in arrays["unaligned"]}) == 3 and len(views) == 1


def test_cached_requests_columns():
    requests = [CachedRequest("a", None, False, 3, 1), CachedRequest("b", [[1]], True, 0, 0)]
    columns = CachedRequests.of(requests)
    assert len(columns) == 2 and columns.resumed_req_ids == {"b"}
    assert dataclasses.asdict(columns)["new_block_ids"] == [None, [[1]]]


@pytest.mark.parametrize("num_groups", [1, 2])
def test_decode_templates_give_the_same_inputs(num_groups):
    table = RequestTable(4, 32, 8, num_groups)
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32, page_size=PAGE
    )
    rng = np.random.default_rng(0)
    for i in range(4):
        blocks = [[int(b) for b in rng.integers(0, 40, 2)] for _ in range(num_groups)]
        table.add(NewRequest(f"r{i}", list(range(3 + i)), blocks, 2 + i, SamplingOptions()))
    buffers, given_back, reused = StepBuffers(), set(), 0
    for step in range(12):
        rows = rng.permutation(4)[: int(rng.integers(1, 5))].astype(np.int32)
        ones = np.ones(rows.size, np.int32)
        fast_plan = prepare_step(table, rows, ones, buckets, PAGE, buffers)
        plan = prepare_step(table, rows, ones, buckets, PAGE)
        np.testing.assert_array_equal(fast_plan.packed, plan.packed, err_msg=f"step {step}")
        np.testing.assert_array_equal(fast_plan.emits_token, plan.emits_token)
        assert fast_plan.all_emit == plan.all_emit and fast_plan.dims == plan.dims
        assert fast_plan.fed == plan.fed
        for name in ("rows", "columns", "counts", "occupants"):
            np.testing.assert_array_equal(getattr(fast_plan.appends, name), getattr(plan.appends, name))
        reused += fast_plan.packed.ctypes.data in given_back
        given_back.add(fast_plan.packed.ctypes.data)
        buffers.give_back(fast_plan.packed)  # its step finished: the next one of its size reuses it
        for row in rows:  # the step ran: one more token computed, sometimes a new page
            table.num_computed[row] += 1
            table.append_token(int(row), step)
            if table.num_computed[row] % PAGE == 0:
                table._append_pages(int(row), [[int(rng.integers(0, 40))]] * num_groups)
    assert reused


def test_planned_appends_skip_rows_that_do_not_emit_or_are_full():
    fast, reference, req_ids = _tables(1, 1)
    rows = np.array([fast.row_of[r] for r in req_ids[:4]])
    fast.num_tokens[rows[1]] = reference.num_tokens[rows[1]] = 32
    emits = np.array([True, True, False, True])
    tokens = np.array([5, 6, 7, 8], np.int32)
    fast.append(fast.plan_appends(rows, emits), tokens)
    for row, token, emit in zip(rows, tokens, emits, strict=True):
        if emit:
            reference.append_token(int(row), int(token))
    np.testing.assert_array_equal(fast.token_ids, reference.token_ids)
    np.testing.assert_array_equal(fast.num_tokens, reference.num_tokens)


def test_packed_buffers_are_64_byte_aligned():
    table = RequestTable(4, 32, 8)
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32, page_size=PAGE
    )
    row = table.add(NewRequest("a", [1, 2, 3], [[1]], 2, SamplingOptions()))
    buffers = StepBuffers()
    for _ in range(3):  # built, then from the template, then in a buffer handed back
        plan = prepare_step(table, np.array([row]), np.ones(1, np.int32), buckets, PAGE, buffers)
        assert plan.packed.ctypes.data % 64 == 0
        buffers.give_back(plan.packed)


@pytest.mark.parametrize("seed", range(4))
def test_inputs_prepared_before_the_previous_tokens_arrive_take_them_on_the_device(seed):
    # Async scheduling: step k is prepared and its tokens reserved before step k-1's tokens are
    # filled in. The token ids the forward then sees (`feed` picks from step k-1's tokens) and
    # every history must equal those of the same steps run one after the other.
    rng = np.random.default_rng(seed)
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32, page_size=PAGE
    )
    overlapped, serial = RequestTable(4, 32, 8), RequestTable(4, 32, 8)
    for table in (overlapped, serial):
        for i in range(4):
            blocks = [list(range(8 * i, 8 * i + 8))]
            table.add(NewRequest(f"r{i}", list(range(1, 4 + 3 * i)), blocks, 0, SamplingOptions()))
    buffers, previous, fed_steps = StepBuffers(), None, 0
    for step in range(16):
        rows = np.sort(rng.permutation(4)[: int(rng.integers(1, 5))]).astype(np.int32)
        room = serial.num_tokens[rows] - serial.num_computed[rows]  # tokens known or being sampled
        num_scheduled = np.minimum(room, rng.integers(1, 4, rows.size)).astype(np.int32)
        plan = prepare_step(overlapped, rows, num_scheduled, buckets, PAGE, buffers)
        serial_plan = prepare_step(serial, rows, num_scheduled, buckets, PAGE)
        inputs, expected = plan.inputs(), serial_plan.inputs()
        assert plan.fed == (inputs.feed >= 0).any()
        tokens = rng.integers(100, 200, buckets.max_seqs).astype(np.int32)  # padded like the device's
        fed = inputs.feed >= 0
        fed_steps += bool(fed.any())
        seen = np.where(fed, previous[0][np.maximum(inputs.feed, 0)] if fed.any() else 0, inputs.token_ids)
        np.testing.assert_array_equal(seen, expected.token_ids, err_msg=f"step {step}")
        np.testing.assert_array_equal(inputs.positions, expected.positions)
        np.testing.assert_array_equal(plan.emits_token, serial_plan.emits_token)
        overlapped.reserve(plan.appends)
        if previous is not None:
            overlapped.fill(previous[1].appends, previous[0][: previous[1].rows.size])  # step k-1's arrive
            buffers.give_back(previous[1].packed)  # as the runner does once step k-1 finished
        serial.reserve(serial_plan.appends)
        serial.fill(serial_plan.appends, tokens[: rows.size])
        for table in (overlapped, serial):
            table.num_computed[rows] += num_scheduled
        previous = (tokens, plan)
    overlapped.fill(previous[1].appends, previous[0][: previous[1].rows.size])
    assert fed_steps > 4
    for row in range(4):
        np.testing.assert_array_equal(overlapped.output_token_ids(row), serial.output_token_ids(row))
    assert (overlapped.pending_column == -1).all()
    assert not overlapped.tokens_in_flight and not serial.tokens_in_flight  # every token filled


@pytest.mark.parametrize("marked", ["before the abort", "after the newcomer"])
def test_a_token_arriving_after_its_request_left_does_not_touch_the_rows_next_request(marked):
    table = RequestTable(4, 32, 8)
    rows = np.array(
        [table.add(NewRequest(f"r{i}", [1, 2, 3 + i], [[i]], 3, SamplingOptions())) for i in range(3)]
    )
    in_flight = table.plan_appends(rows, np.ones(3, bool))
    table.reserve(in_flight)
    assert (table.pending_column == -1).all()  # marked only when a step is prepared in flight
    if marked == "before the abort":
        assert table.mark_in_flight()
    table.remove("r1")  # aborted while its token is on the device; a new request takes the row
    newcomer = table.add(NewRequest("n", [7, 8, 9, 10, 11], [[5]], 5, SamplingOptions()))
    assert newcomer == rows[1] and table.pending_column[newcomer] == -1
    # The next step's feed: the staying rows take their token on the device, the newcomer its own.
    feed = table.feed_index(rows, np.array([3, 3, 3]))
    assert feed.tolist() == [0, -1, 2]
    table.fill(in_flight, np.array([40, 41, 42], np.int32))
    assert table.output_token_ids(rows[0]).tolist() == [40] and table.output_token_ids(rows[2]).tolist() == [
        42
    ]
    assert table.token_ids[newcomer, :5].tolist() == [7, 8, 9, 10, 11] and table.num_tokens[newcomer] == 5
    assert (table.pending_column == -1).all()
