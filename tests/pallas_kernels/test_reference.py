# SPDX-License-Identifier: Apache-2.0
"""Tiny hand-worked cases, arithmetic in the comments.

They pin the semantics of the xla reference (pallas_kernels/reference.py), and every backend runs
them too (Pallas ones in interpret mode), each through its own KV layout and write_kv.
Head dim 2, sm_scale 1, page size 8; sequence i's tokens live in page 2 * i + 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import api, reference
from tests.pallas_kernels.conftest import jit_for_backend, numpy_causal_attention

BACKENDS = ["xla", "pallas_tpu", "pallas_gpu", "cpu_native"]
# Interpret mode runs a Pallas kernel's grid in Python, seconds a case: the fast tier runs each
# Pallas kernel on the first case (prefill with padding rows), the slow tier on every case (and
# test_tpu_kernel.py / test_gpu_kernel.py over the whole grid); xla and cpu_native run all of them.
PALLAS_IN_SLOW = [pytest.param(b, marks=pytest.mark.slow) if b.startswith("pallas") else b for b in BACKENDS]


@pytest.fixture(autouse=True)
def _native_kernels_for_cpu_native(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec and callspec.params.get("backend") == "cpu_native":
        request.getfixturevalue("native_kernels")


PAGE_SIZE = 8


def _attend(backend, q, k, v, q_lens, kv_lens, *, num_slots=None, num_seqs=None, **kwargs):
    """q `[T, H, 2]`; k, v `[sum(kv_lens), K, 2]`, sequence by sequence, positions in order."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    num_slots = num_slots or len(q_lens)
    slots = np.concatenate([(2 * i + 1) * PAGE_SIZE + np.arange(n) for i, n in enumerate(kv_lens)])
    cu_q_lens = np.full(num_slots + 1, sum(q_lens), np.int32)
    cu_q_lens[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens = np.pad(np.asarray(kv_lens, np.int32), (0, num_slots - len(kv_lens)))
    page_indices = (2 * np.arange(num_slots, dtype=np.int32) + 1)[:, None]  # [R, 1]
    if num_seqs is None:
        num_seqs = jnp.array([len(q_lens)], jnp.int32)
    if backend.startswith("pallas"):
        kwargs["interpret"] = True

    @functools.partial(jit_for_backend, backend=backend, kwargs=kwargs)
    def step(q, k, v, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        cache = api.allocate_kv_cache(2 * num_slots, PAGE_SIZE, k.shape[1], 2, jnp.float32, backend=backend)
        interpret = backend.startswith("pallas")
        cache = api.write_kv(cache, k, v, slot_mapping, backend=backend, interpret=interpret)
        return api.ragged_paged_attention(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0, backend=backend, **kwargs
        )

    return np.asarray(
        step(q, k, v, jnp.asarray(slots, jnp.int32), kv_lens, page_indices, cu_q_lens, num_seqs)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_two_tokens_and_padding_rows(backend):
    # One sequence, two new tokens (positions 0, 1), two padding rows, one padding slot.
    # k0 = [1, 0], k1 = [0, 1]; v0 = [4, 0], v1 = [0, 8].
    # Row 0 (position 0) sees only key 0           -> v0 = [4, 0].
    # Row 1: q1 = [ln 3, 0], scores [ln 3, 0] -> softmax [3/4, 1/4] -> 3/4 v0 + 1/4 v1 = [3, 2].
    # Rows 2, 3 are past cu_q_lens[num_seqs] = 2    -> exactly 0, whatever q holds there.
    q = [[[5.0, 5.0]], [[math.log(3.0), 0.0]], [[7.0, 7.0]], [[1.0, 1.0]]]
    k = [[[1.0, 0.0]], [[0.0, 1.0]]]
    v = [[[4.0, 0.0]], [[0.0, 8.0]]]
    out = _attend(backend, q, k, v, q_lens=[2], kv_lens=[2], num_slots=2, num_seqs=jnp.int32(1))
    np.testing.assert_allclose(out[:, 0], [[4, 0], [3, 2], [0, 0], [0, 0]], atol=1e-5)
    assert np.all(out[2:] == 0.0)


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_gqa_query_heads_share_consecutive_kv_head(backend):
    # 4 query heads over 2 kv heads: query heads 0, 1 use kv head 0; heads 2, 3 use kv head 1.
    # All keys are 0, so the weights are uniform over the 2 cached tokens: out = mean of v.
    # kv head 0: v = [2, 0], [4, 0] -> [3, 0];  kv head 1: v = [0, 10], [0, 20] -> [0, 15].
    q = np.ones((1, 4, 2))
    k = np.zeros((2, 2, 2))
    v = [[[2.0, 0.0], [0.0, 10.0]], [[4.0, 0.0], [0.0, 20.0]]]  # [token, kv head, D]
    out = _attend(backend, q, k, v, q_lens=[1], kv_lens=[2])
    np.testing.assert_allclose(out[0], [[3, 0], [3, 0], [0, 15], [0, 15]], atol=1e-5)


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_sliding_window(backend):
    # Window 2: a query at position p sees keys at positions p - 1 and p. Keys are 0 (uniform).
    # v at positions 0..3 = [0, 0], [10, 0], [20, 0], [40, 0]; a second sequence decodes at
    # position 3 of the same four values. Rows:
    #   p0 -> v0 = [0, 0]; p1 -> (0 + 10) / 2 = [5, 0]; p2 -> (10 + 20) / 2 = [15, 0];
    #   p3 -> (20 + 40) / 2 = [30, 0]; second sequence p3 -> [30, 0] (without window: 70 / 4).
    values = [[[0.0, 0.0]], [[10.0, 0.0]], [[20.0, 0.0]], [[40.0, 0.0]]]
    q = np.ones((5, 1, 2))
    k = np.zeros((8, 1, 2))
    out = _attend(backend, q, k, values + values, q_lens=[4, 1], kv_lens=[4, 4], sliding_window=2)
    np.testing.assert_allclose(out[:, 0], [[0, 0], [5, 0], [15, 0], [30, 0], [30, 0]], atol=1e-5)
    full = _attend(backend, q[4:], k, values + values, q_lens=[0, 1], kv_lens=[4, 4])
    np.testing.assert_allclose(full[0, 0], [17.5, 0], atol=1e-5)


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_chunked_attention(backend):
    # Chunks of 2 positions: a row at position p sees keys p // 2 * 2 .. p only.
    # Sequence 0, positions 0..3: k = [1,0], [0,1], [1,0], [0,1]; v = [4,0], [0,8], [8,0], [0,4].
    #   Row 0 (chunk 0..1) sees key 0                     -> [4, 0].
    #   Row 1: q = [ln 3, 0], scores [ln 3, 0]            -> 3/4 [4,0] + 1/4 [0,8] = [3, 2].
    #   Row 2 (chunk 2..3) sees key 2 only, not 0 and 1   -> [8, 0].
    #   Row 3: q = [0, ln 3], scores [0, ln 3] on keys 2, 3 -> 1/4 [8,0] + 3/4 [0,4] = [2, 3].
    # Sequence 1 decodes position 2 (keys 0..2 cached, all k = [1, 0]): its chunk holds key 2
    # only                                                -> v2 = [6, 6] (not a mix with v0, v1).
    ln3 = math.log(3.0)
    q = [[[5.0, 5.0]], [[ln3, 0.0]], [[5.0, 5.0]], [[0.0, ln3]], [[5.0, 5.0]]]
    k = [[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 0.0]], [[0.0, 1.0]]] + [[[1.0, 0.0]]] * 3
    v = [[[4.0, 0.0]], [[0.0, 8.0]], [[8.0, 0.0]], [[0.0, 4.0]], [[1.0, 1.0]], [[2.0, 2.0]], [[6.0, 6.0]]]
    out = _attend(backend, q, k, v, q_lens=[4, 1], kv_lens=[4, 3], attention_chunk_size=2)
    np.testing.assert_allclose(out[:, 0], [[4, 0], [3, 2], [8, 0], [2, 3], [6, 6]], atol=1e-5)


def test_chunked_attention_rejects_a_chunk_that_is_not_positive():
    q = jnp.zeros((1, 1, 2))
    cache = reference.allocate_kv_cache_reference(2, PAGE_SIZE, 1, 2, jnp.float32)
    with pytest.raises(ValueError, match="attention_chunk_size must be positive"):
        api.ragged_paged_attention(
            q, cache, jnp.array([1]), jnp.array([[1]]), jnp.array([0, 1]), jnp.array([1]),
            sm_scale=1.0, backend="xla", attention_chunk_size=0,
        )  # fmt: skip


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_soft_cap(backend):
    # q = [100, 0]; k0 = [1, 0], k1 = [0, 0] -> scores [100, 0].
    # cap 1: [tanh(100), tanh(0)] = [1, 0] -> softmax [e / (e + 1), 1 / (e + 1)] = [0.7311, 0.2689];
    # v0 = [1, 0], v1 = [0, 1] -> out = [0.7311, 0.2689]. Without a cap: softmax [1, e^-100] -> [1, 0].
    q = [[[100.0, 0.0]]]
    k = [[[1.0, 0.0]], [[0.0, 0.0]]]
    v = [[[1.0, 0.0]], [[0.0, 1.0]]]
    capped = _attend(backend, q, k, v, q_lens=[1], kv_lens=[2], soft_cap=1.0)
    e = math.e
    np.testing.assert_allclose(capped[0, 0], [e / (e + 1), 1 / (e + 1)], atol=1e-5)
    plain = _attend(backend, q, k, v, q_lens=[1], kv_lens=[2])
    np.testing.assert_allclose(plain[0, 0], [1.0, 0.0], atol=1e-5)


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_attention_sinks(backend):
    # Two query heads on one kv head, both q = [ln 3, 0]; k0 = [1, 0], k1 = [0, 1] -> scores
    # [ln 3, 0], exp [3, 1]. Head 0's sink ln 4 adds exp 4 to the denominator only:
    # softmax [3/8, 1/8 | 4/8]; v0 = [8, 0], v1 = [0, 8] -> [3, 1]. Head 1's sink -30 is ~nothing:
    # [3/4, 1/4] -> [6, 2]. Row 1 is padding (num_seqs = 1): still exactly 0.
    q = [[[math.log(3.0), 0.0], [math.log(3.0), 0.0]], [[5.0, 5.0], [5.0, 5.0]]]
    k = [[[1.0, 0.0]], [[0.0, 1.0]]]
    v = [[[8.0, 0.0]], [[0.0, 8.0]]]
    sinks = jnp.array([math.log(4.0), -30.0], jnp.float32)
    out = _attend(backend, q, k, v, q_lens=[1], kv_lens=[2], num_slots=2, sinks=sinks)
    np.testing.assert_allclose(out[0], [[3, 1], [6, 2]], atol=1e-5)
    assert np.all(out[1] == 0.0)


@pytest.mark.parametrize("backend", PALLAS_IN_SLOW)
def test_write_kv_negative_slot_writes_nothing(backend):
    # Writing tokens at slots [-1, 11, -8] must equal writing only the middle token at slot 11.
    k = jnp.arange(3 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 4) + 1
    empty = api.allocate_kv_cache(4, PAGE_SIZE, 2, 4, jnp.float32, backend=backend)
    write = functools.partial(api.write_kv, backend=backend, interpret=backend.startswith("pallas"))
    written = write(empty, k, -k, jnp.array([-1, 11, -8], jnp.int32))
    only_middle = write(empty, k[1:2], -k[1:2], jnp.array([11], jnp.int32))
    np.testing.assert_array_equal(np.asarray(written), np.asarray(only_middle))
    assert np.abs(np.asarray(written, np.float32)).sum() == 2 * float(jnp.abs(k[1]).sum())


def test_xla_backend_rejects_tuning_arguments():
    with pytest.raises(ValueError, match="takes no tuning arguments"):
        _attend(
            "xla",
            np.ones((1, 1, 2)),
            np.ones((1, 1, 2)),
            np.ones((1, 1, 2)),
            [1],
            [1],
            num_kv_pages_per_block=2,
        )


def test_reference_is_jittable_with_traced_num_seqs():
    # num_seqs is data, not a static argument: one compiled program serves any batch size.
    f = jax.jit(lambda n: _attend_traced(n))
    np.testing.assert_allclose(f(jnp.int32(1))[1], 0.0)
    np.testing.assert_allclose(f(jnp.int32(2))[1], [[2.0, 0.0]], atol=1e-5)


def _attend_traced(num_seqs):
    # Two one-token sequences; the second's single key has v = [2, 0].
    k = jnp.ones((2, 1, 2))
    v = jnp.array([[[1.0, 0.0]], [[2.0, 0.0]]])
    cache = api.allocate_kv_cache(4, PAGE_SIZE, 1, 2, jnp.float32, backend="xla")
    cache = api.write_kv(cache, k, v, jnp.array([PAGE_SIZE, 3 * PAGE_SIZE], jnp.int32), backend="xla")
    return api.ragged_paged_attention(
        jnp.ones((2, 1, 2)),
        cache,
        jnp.array([1, 1], jnp.int32),
        jnp.array([[1], [3]], jnp.int32),
        jnp.array([0, 1, 2], jnp.int32),
        num_seqs,
        sm_scale=1.0,
        backend="xla",
    )


def test_reference_ignores_cu_q_lens_entries_past_num_seqs():
    # One sequence of 2 query tokens; the unused cu_q_lens slots hold zeros instead of the total.
    import jax.numpy as jnp

    from pallas_kernels import reference

    cache = reference.allocate_kv_cache_reference(4, 2, 1, 2, jnp.float32)
    k = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = jnp.array([[[2.0, 0.0]], [[0.0, 4.0]]])
    cache = reference.write_kv_reference(cache, k, v, jnp.array([2, 3]))
    q = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    args = (q, cache, jnp.array([2, 0, 0]), jnp.array([[1], [0], [0]]))
    padded_with_total = reference.ragged_paged_attention_reference(
        *args, jnp.array([0, 2, 2, 2]), jnp.array([1]), sm_scale=1.0
    )
    padded_with_zeros = reference.ragged_paged_attention_reference(
        *args, jnp.array([0, 2, 0, 0]), jnp.array([1]), sm_scale=1.0
    )
    # Row 0 sees only key 0 -> v0 = [2, 0]; both paddings give the same, non-zero answer.
    assert padded_with_zeros[0, 0].tolist() == [2.0, 0.0]
    assert jnp.array_equal(padded_with_total, padded_with_zeros)


@pytest.mark.parametrize(("q_lens", "query_block", "rows_per_group", "variant"), [
    ([1] * 9, 1, 2, None),  # decode rows in five groups of two
    ([5, 1, 12, 1, 3], 2, 4, None),  # prefill chunks and decode rows, 2-row blocks, groups of 2 blocks
    ([5, 1, 12, 1, 3], 2, 4, "sinks"),  # the same with a sink column in every head's softmax
    ([5, 1, 12, 1, 3], 2, 4, "chunks"),  # the same with chunked local attention, chunks of 8
])  # fmt: skip
def test_reference_groups_and_sorting_match_dense_attention(q_lens, query_block, rows_per_group, variant):
    with_sinks, chunk = variant == "sinks", 8 if variant == "chunks" else None
    rng = np.random.default_rng(3)
    page_size, num_kv_heads, heads, dim = 4, 2, 4, 8
    kv_lens = [int(n + rng.integers(0, 30)) for n in q_lens]  # mixed reach, so sorting matters
    pages_per_seq = -(-max(kv_lens) // page_size)
    page_indices = rng.permutation(len(q_lens) * pages_per_seq).reshape(len(q_lens), pages_per_seq)
    k = [rng.standard_normal((n, num_kv_heads, dim)).astype(np.float32) for n in kv_lens]
    v = [rng.standard_normal((n, num_kv_heads, dim)).astype(np.float32) for n in kv_lens]
    q = rng.standard_normal((sum(q_lens), heads, dim)).astype(np.float32)
    sinks = (2 * rng.standard_normal(heads)).astype(np.float32) if with_sinks else None
    slots = np.concatenate(
        [
            page_indices[i][np.arange(n) // page_size] * page_size + np.arange(n) % page_size
            for i, n in enumerate(kv_lens)
        ]
    )
    cache = api.allocate_kv_cache(page_indices.size, page_size, num_kv_heads, dim, jnp.float32, backend="xla")
    cache = api.write_kv(
        cache, np.concatenate(k), np.concatenate(v), jnp.asarray(slots, jnp.int32), backend="xla"
    )
    got = reference.ragged_paged_attention_reference(
        jnp.asarray(q), cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.int32(len(q_lens)),
        sm_scale=1.0, query_block=query_block, rows_per_group=rows_per_group, kv_chunk_pages=1,
        sinks=None if sinks is None else jnp.asarray(sinks), attention_chunk_size=chunk,
    )  # fmt: skip
    expected = numpy_causal_attention(q, k, v, q_lens, kv_lens, sinks=sinks, attention_chunk_size=chunk)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5)
