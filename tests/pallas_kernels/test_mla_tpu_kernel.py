# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU latent attention (MLA) kernel and its write against the xla reference, on CPU in
interpret mode (mla_cases.GRID; tolerances there: 2e-5 f32, 2e-2 bf16, relative to max |ref|).

The TPU interpreter (`pltpu.InterpretParams`) simulates HBM/VMEM, DMAs and semaphores: with DMAs
landing only at `.wait()` and uninitialised VMEM set to NaN it catches missing waits and reads of
pages never fetched; with `detect_races=True`, buffer races.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # race results are private
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import mla_kernel
from tests.pallas_kernels.mla_cases import GRID, SMALL, assert_matches_reference


def test_small_mixed_batch_matches_reference():
    assert_matches_reference(SMALL, "pallas_tpu", interpret=True, **dict(SMALL.tpu_tuning))


@pytest.mark.slow  # a second interpret-mode run (fast: the small mixed batch above)
def test_default_tuning_matches_reference():
    # Production defaults: one token a block in a decode step, 256-key DMA rounds.
    case = GRID[0]
    assert_matches_reference(case, "pallas_tpu", interpret=True)


@pytest.mark.slow  # the interpreter over the whole grid
@pytest.mark.parametrize("mla_case", GRID, ids=[c.name for c in GRID])
def test_matches_reference(mla_case):
    assert_matches_reference(mla_case, "pallas_tpu", interpret=True, **dict(mla_case.tpu_tuning))


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["dma_on_wait", "eager_detect_races"])
def test_tpu_interpret_mode(mode):
    if mode == "dma_on_wait":
        params = pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")
    else:
        params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    assert_matches_reference(SMALL, "pallas_tpu", interpret=params, **dict(SMALL.tpu_tuning))
    races = interpret_pallas_call.races
    assert not (races is not None and races.races_found), "race detected (see the RACE DETECTED report)"


def test_cache_rows_are_padded_to_lanes():
    # DeepSeek's rows of 512 + 64 values take 640 lanes, in the cache's own dtype.
    cache = mla_kernel.allocate_latent_cache(3, 16, 576, jnp.bfloat16)
    assert cache.shape == (3, 16, 640) and cache.dtype == jnp.bfloat16


def _args(width=48, cache_shape=(8, 16, 128), slots=2, pages=2):
    return (
        jnp.zeros((4, 2, width), jnp.float32),
        jnp.zeros(cache_shape, jnp.float32),
        jnp.zeros((slots,), jnp.int32),
        jnp.zeros((slots, pages), jnp.int32),
        jnp.zeros((slots + 1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (_args(cache_shape=(8, 16, 48)), {}, r"last dim must be 128 for rows of 48"),
        (_args(cache_shape=(8, 12, 128)), {}, r"page size 12 must be a multiple of 8"),
        (_args(), {"latent_dim": 48}, r"latent_dim 48 must leave a rope part"),
        ((*_args()[:4], jnp.zeros((4,), jnp.int32), _args()[5]), {}, r"cu_q_lens \[R \+ 1\].*\(4,\)"),
        (_args(), {"num_kv_pages_per_block": 3}, r"num_kv_pages_per_block=3 must be in \[1, P=2\]"),
    ],
)
def test_bad_shapes_raise(args, kwargs, message):
    kwargs = {"latent_dim": 32, **kwargs}
    with pytest.raises(ValueError, match=message):
        mla_kernel.mla_paged_attention(*args, sm_scale=1.0, interpret=True, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_write_puts_rows_in_their_slots_and_keeps_the_rest(dtype):
    # Rows of 20 + 8 values (padded to 128 lanes) into pages of 32: two tokens share a tile,
    # one crosses into another page, one is padding; every other row keeps its old value.
    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((4, 32, 128)), dtype)
    latent = jnp.asarray(rng.standard_normal((4, 20)), jnp.float32)
    k_rope = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    slots = np.array([33, 34, -1, 100], np.int32)
    got = mla_kernel.write_latent(cache, latent, k_rope, jnp.asarray(slots), interpret=True)
    want = np.array(cache.astype(jnp.float32)).reshape(-1, 128)
    rows = np.zeros((4, 128), np.float32)
    rows[:, :28] = np.asarray(jnp.concatenate([latent, k_rope], axis=1).astype(dtype).astype(jnp.float32))
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[slot] = rows[i]
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).reshape(-1, 128), want)
