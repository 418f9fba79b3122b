# SPDX-License-Identifier: Apache-2.0
"""Several layers' caches in one array (`first_page`), on every backend.

A layer written and read at `first_page` must give exactly what the same layer gives in a cache
of its own, touch only its own pages, and leave its neighbours' results unchanged. The Pallas
kernels run in interpret mode; the native CPU kernel when it builds here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import api
from tests.pallas_kernels.conftest import GRID, build_batch, jit_for_backend, run_backend

CASES = [c for c in GRID if c.name in ("mixed_p16_d64_g1_bf16_window_cap", "decode_p32_d128_g4_fp8")]
# The float8 decode with its longest sequence cut from 1000 tokens to 100: still four sequences
# over one to four packed 32-token pages each, where the TPU kernel's interpret mode walks a tenth
# of the pages (a third of the time; the GPU kernel's takes as long either way).
SHORT_FP8 = dataclasses.replace(CASES[1], name="decode_p32_d128_g4_fp8_short", kv_lens=(5, 40, 70, 100))
# Interpret mode runs the kernels' grids in Python: long, so in the slow tier, and the TPU
# kernel's whole float8 case in `make test-full` (`make test` runs the short one on its paths).
INTERPRET = [
    pytest.param(backend, {"interpret": True}, case, marks=marks, id=f"{backend}-{case.name}")
    for backend, case, marks in (
        ("pallas_tpu", CASES[0], pytest.mark.slow), ("pallas_tpu", SHORT_FP8, pytest.mark.slow),
        ("pallas_tpu", CASES[1], pytest.mark.full),
        ("pallas_gpu", CASES[0], pytest.mark.slow), ("pallas_gpu", CASES[1], pytest.mark.slow),
    )
]  # fmt: skip
# XLA's stacked layers index the same way whatever the cache dtype: the fast tier runs it on the
# bfloat16 mixed case, the native kernel on both.
COMBINATIONS = [
    pytest.param(
        backend,
        {},
        case,
        id=f"{backend}-{case.name}",
        marks=pytest.mark.slow if (backend, i) == ("xla", 1) else (),
    )
    for backend in ("xla", "cpu_native")
    for i, case in enumerate(CASES)
] + INTERPRET
NUM_LAYERS = 3


def _stacked_step(case, batch, backend, kwargs):
    """Layer 2 of a three-layer cache gets the batch, layer 0 the same slots with K and V swapped;
    returns both layers' attention and the cache."""
    kv_dtype = jnp.dtype(case.kv_dtype or case.dtype)
    attend = dict(
        sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap,
        backend=backend, kv_dtype=kv_dtype.name,
    )  # fmt: skip

    def step(q, k, v, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        cache = api.allocate_kv_cache(
            NUM_LAYERS * batch.num_pages, case.page_size, case.num_kv_heads, case.head_dim, kv_dtype,
            backend=backend,
        )  # fmt: skip
        outs = []
        for layer, (keys, values) in ((2, (k, v)), (0, (v, k))):
            first = layer * batch.num_pages
            cache = api.write_kv(
                cache, keys, values, slot_mapping, backend=backend, kv_dtype=kv_dtype.name, first_page=first,
                interpret=kwargs.get("interpret", False),
            )  # fmt: skip
            outs.append(
                api.ragged_paged_attention(
                    q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, first_page=first, **attend, **kwargs
                )
            )
        return outs, cache

    return jit_for_backend(step, backend, kwargs)(
        batch.q, batch.k, batch.v, batch.slot_mapping, batch.kv_lens, batch.page_indices,
        batch.cu_q_lens, batch.num_seqs,
    )  # fmt: skip


@pytest.mark.parametrize(("backend", "kwargs", "layer_case"), COMBINATIONS)
def test_each_layer_reads_and_writes_only_its_own_pages(request, layer_case, backend, kwargs):
    case = layer_case
    if backend == "cpu_native":
        request.getfixturevalue("native_kernels")  # built (or the test skipped) only when needed
    batch = build_batch(case)
    (layer2, layer0), cache = _stacked_step(case, batch, backend, kwargs)
    alone = run_backend(case, batch, backend, **kwargs)
    np.testing.assert_array_equal(np.asarray(layer2, np.float32), np.asarray(alone, np.float32))
    swapped = dataclasses.replace(batch, k=batch.v, v=batch.k)
    np.testing.assert_array_equal(
        np.asarray(layer0, np.float32), np.asarray(run_backend(case, swapped, backend, **kwargs), np.float32)
    )
    page_axis = api._PAGES[backend][0]
    middle = jax.lax.slice_in_dim(cache, batch.num_pages, 2 * batch.num_pages, axis=page_axis)
    assert not np.asarray(middle).any(), "layer 1's pages were written"


def test_slots_past_int32_and_negative_first_pages_are_refused():
    # 2**27 pages of 16 tokens: 2**31 slots, as an abstract array (nothing is allocated).
    cache = jax.ShapeDtypeStruct((2, 2**27, 16 * 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 1, 8), jnp.float32)
    slots = jax.ShapeDtypeStruct((1,), jnp.int32)

    def write_at(first_page):
        return lambda c, k, s: api.write_kv(c, k, k, s, backend="xla", first_page=first_page)

    with pytest.raises(ValueError, match="more slots than int32"):
        jax.eval_shape(write_at(2**26), cache, k, slots)
    with pytest.raises(ValueError, match="first_page must be >= 0"):
        jax.eval_shape(write_at(-1), cache, k, slots)
