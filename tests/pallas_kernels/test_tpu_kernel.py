# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU kernel against the xla reference, on CPU in interpret mode.

`interpret=True` checks the numerics over the grid of ragged batches (conftest.GRID). The TPU
interpreter (`pltpu.InterpretParams`) simulates HBM/VMEM, DMAs and semaphores: with DMAs landing
only at `.wait()` and uninitialised VMEM set to NaN it catches missing waits and reads of pages
that were never fetched; with `detect_races=True` it catches buffer races. Out-of-range DMA page
indices raise there. Tolerances: conftest.TOLERANCE (2e-5 f32, 2e-2 bf16, relative to max |ref|).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # race results are private
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu


@pytest.mark.slow  # the interpreter over the whole grid of batches
def test_matches_reference(case, compare_with_reference):
    compare_with_reference(case, "pallas_tpu", interpret=True, **dict(case.tpu_tuning))


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["dma_on_wait", "eager_detect_races"])
def test_tpu_interpret_mode(small_case, mode, compare_with_reference):
    if mode == "dma_on_wait":
        params = pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")
    else:
        params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    compare_with_reference(small_case, "pallas_tpu", interpret=params, **dict(small_case.tpu_tuning))
    races = interpret_pallas_call.races
    assert not (races is not None and races.races_found), "race detected (see the RACE DETECTED report)"


def _args(num_tokens=8, heads=4, head_dim=64, cache_shape=(8, 4, 16, 128), slots=4, pages=2):
    return (
        jnp.zeros((num_tokens, heads, head_dim), jnp.float32),
        jnp.zeros(cache_shape, jnp.float32),
        jnp.zeros((slots,), jnp.int32),
        jnp.zeros((slots, pages), jnp.int32),
        jnp.zeros((slots + 1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (_args(cache_shape=(8, 4, 16, 64)), {}, r"last dim must be 128"),
        (_args(heads=3), {}, r"divide into q's 3 heads"),
        (_args(cache_shape=(8, 4, 12, 128)), {}, r"page size 12 must be a multiple of 8"),
        ((*_args()[:4], jnp.zeros((3,), jnp.int32), _args()[5]), {}, r"cu_q_lens \[R \+ 1\].*\(3,\)"),
        (_args(), {"num_queries_per_block": 12}, r"num_queries_per_block=12"),
        (_args(), {"num_kv_pages_per_block": 3}, r"num_kv_pages_per_block=3 must be in \[1, P=2\]"),
        (_args(), {"sliding_window": 0}, r"sliding_window must be positive"),
    ],
)
def test_bad_shapes_raise(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tpu.ragged_paged_attention(*args, sm_scale=1.0, interpret=True, **kwargs)
