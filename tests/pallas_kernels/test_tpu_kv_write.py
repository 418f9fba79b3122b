# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU KV write: its reference (the XLA scatter) on hand-worked cases, then the DMA
kernels in interpret mode against the reference over a grid of caches and slot mappings.

The caches start full of random values, so a kernel that rewrites a whole tile must keep every
row it was not asked to write. Compiling the kernels for real TPUs: tests/aot/test_kv_write_compile.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # race results are private
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import api, tpu
from pallas_kernels.tpu import kv_write
from pallas_kernels.tpu.kv_write import NO_TILE, tile_plan


def test_reference_interleaves_k_and_v_and_pads_lanes():
    cache = tpu.allocate_kv_cache(4, 16, 2, 64, jnp.float32)
    k = jnp.arange(2 * 64, dtype=jnp.float32).reshape(1, 2, 64) + 1
    out = np.asarray(tpu.write_kv_reference(cache, k, -k, jnp.array([2 * 16 + 5], jnp.int32)))
    for h in range(2):  # page 2, offset 5: K of head h in row 2h, V in row 2h + 1
        np.testing.assert_array_equal(out[2, 2 * h, 5, :64], k[0, h])
        np.testing.assert_array_equal(out[2, 2 * h + 1, 5, :64], -k[0, h])
    assert np.abs(out[..., 64:]).max() == 0.0
    assert np.abs(out).sum() == 2 * np.abs(k).sum()


def test_reference_drops_negative_slots():
    cache = tpu.allocate_kv_cache(8, 16, 1, 128, jnp.float32)
    k = jnp.ones((3, 1, 128), jnp.float32)
    out = np.asarray(tpu.write_kv_reference(cache, k, 2 * k, jnp.array([-1, 17, -16], jnp.int32)))
    assert out.sum() == (1 + 2) * 128
    assert out[1, 0, 1].sum() == 128 and out[1, 1, 1].sum() == 2 * 128  # slot 17: page 1, offset 1


def test_reference_saturates_float8():
    cache = tpu.allocate_kv_cache(1, 32, 1, 128, jnp.float8_e4m3fn)
    k = jnp.full((1, 1, 128), 1e6, jnp.float32)
    out = tpu.write_kv_reference(cache, k, -k, jnp.array([0], jnp.int32)).astype(jnp.float32)
    assert float(out[0, 0, 0, 0]) == 448.0 and float(out[0, 1, 0, 0]) == -448.0  # e4m3fn's max


def test_tile_plan_groups_tokens_by_tile():
    # 8-row tiles: slots 17 and 18 share tile 2, slot 3 is in tile 0, slot 40 in tile 5.
    buffer_of_token, tile_of_buffer = tile_plan(jnp.array([-1, 17, 3, 18, 40], jnp.int32), 8)
    np.testing.assert_array_equal(buffer_of_token, [5, 1, 0, 1, 2])  # padding: out of range
    np.testing.assert_array_equal(tile_of_buffer, [0, 2, 5, NO_TILE, NO_TILE])


@dataclasses.dataclass(frozen=True)
class WriteCase:
    name: str
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    slots: tuple[int, ...]  # -1: padding
    first_page: int = 0  # a stacked cache: this layer's pages start here


# fmt: off
CASES = [
    WriteCase("decode_f32_k1_d64", 6, 16, 1, 64, "float32", (5, 40, -1, 77, 16)),
    WriteCase("decode_bf16_k2_d128", 6, 16, 2, 128, "bfloat16", (1, 95, -1, 33, -1, 50)),
    WriteCase("prefill_bf16_k8_d128_across_pages", 5, 16, 8, 128, "bfloat16", (*range(9, 47), -1, -1)),
    WriteCase("shuffled_one_page_f32_k3_d256", 3, 32, 3, 256, "float32", (40, 33, 63, 32, 47, -1, 34)),
    WriteCase("fp8_e4m3_k4_d128_p32", 4, 32, 4, 128, "float8_e4m3fn", (0, 31, 32, 127, -1, 64, 65)),
    WriteCase("fp8_e5m2_k1_d64_p128", 2, 128, 1, 64, "float8_e5m2", (*range(100, 140), 3)),
    WriteCase("bf16_p128_k5_d64_stacked", 6, 128, 5, 64, "bfloat16", (0, 127, 128, 300, -1), first_page=3),
    WriteCase("f32_k8_d128_stacked", 8, 16, 8, 128, "float32", (17, 2, 63, -1), first_page=4),
    WriteCase("all_padding_bf16", 2, 16, 2, 128, "bfloat16", (-1, -1, -1)),
    WriteCase("bf16_k6_d256_interleaved_tiles", 4, 32, 6, 256, "bfloat16", (0, 20, 1, 21, 2, 100, 3, 80)),
]
# fmt: on


def _inputs(case: WriteCase):
    rng = np.random.default_rng(len(case.name))
    total_pages = case.num_pages + case.first_page
    cache = api.allocate_kv_cache(
        total_pages, case.page_size, case.num_kv_heads, case.head_dim, case.dtype, backend="pallas_tpu"
    )
    cache = jnp.asarray(rng.standard_normal(cache.shape, np.float32) * 4, case.dtype)  # old contents
    shape = (len(case.slots), case.num_kv_heads, case.head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32) * 4)
    v = jnp.asarray(rng.standard_normal(shape, np.float32) * 4)
    return cache, k, v, jnp.asarray(case.slots, jnp.int32)


def _write(case: WriteCase, interpret, cache, k, v, slots):
    if interpret is None:  # the reference
        slots = jnp.where(slots >= 0, slots + case.first_page * case.page_size, slots)
        return tpu.write_kv_reference(cache, k, v, slots)
    return api.write_kv(
        cache, k, v, slots, backend="pallas_tpu", first_page=case.first_page, interpret=interpret
    )


def _check(case: WriteCase, interpret) -> None:
    cache, k, v, slots = _inputs(case)
    expected = np.asarray(_write(case, None, cache, k, v, slots).astype(jnp.float32))
    actual = np.asarray(_write(case, interpret, cache, k, v, slots).astype(jnp.float32))
    np.testing.assert_array_equal(actual, expected)  # bit for bit: both only move values


# One interpret-mode program a case: the fast tier keeps each dtype's packing (float32 with lanes
# padded, bfloat16 across pages, float8 in 32-row pages), a layer's pages after others' and the
# all-padding write; the other head dims, tile orders and page sizes are the slow tier's.
SLOW_WRITES = {
    "decode_bf16_k2_d128", "shuffled_one_page_f32_k3_d256", "fp8_e5m2_k1_d64_p128", "f32_k8_d128_stacked",
    "bf16_k6_d256_interleaved_tiles",
}  # fmt: skip


@pytest.mark.parametrize(
    "write_case",
    [pytest.param(c, id=c.name, marks=pytest.mark.slow if c.name in SLOW_WRITES else ()) for c in CASES],
)
def test_kernel_matches_reference(write_case):
    _check(write_case, True)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["dma_on_wait", "eager_detect_races"])
@pytest.mark.parametrize("write_case", CASES[1:3], ids=[c.name for c in CASES[1:3]])
def test_kernel_in_tpu_interpret_mode(write_case, mode):
    if mode == "dma_on_wait":
        params = pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")
    else:
        params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    _check(write_case, params)
    races = interpret_pallas_call.races
    assert not (races is not None and races.races_found), "race detected (see the RACE DETECTED report)"


def test_kernel_updates_a_donated_cache_in_place():
    cache = tpu.allocate_kv_cache(8, 16, 2, 128, jnp.float32)
    k = jnp.ones((3, 2, 128), jnp.float32)
    pointer = cache.unsafe_buffer_pointer()
    write = jax.jit(lambda c, k, v, s: tpu.write_kv(c, k, v, s, interpret=True), donate_argnums=0)
    out = write(cache, k, 2 * k, jnp.array([-1, 17, -5], jnp.int32))
    assert out.unsafe_buffer_pointer() == pointer
    assert float(out.sum()) == (1 + 2) * 2 * 128 and float(out[1, :, 1].sum()) == (1 + 2) * 2 * 128


def test_kernel_rejects_a_page_size_off_the_dtype_tile():
    cache = tpu.allocate_kv_cache(2, 16, 1, 128, jnp.float8_e4m3fn)  # 8-bit rows tile by 32
    k = jnp.ones((1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="page size 16 must be a multiple of 32"):
        tpu.write_kv(cache, k, k, jnp.array([0], jnp.int32), interpret=True)


def test_chunks_share_tiles(monkeypatch):
    # Chunks of 3 tokens (tile buffers of 3 tiles): tokens of one tile fall in several chunks,
    # interleaved with another tile's, and each chunk must see the rows the previous one wrote.
    case = WriteCase("chunked_bf16_k2", 4, 32, 2, 128, "bfloat16", (0, 40, 1, 41, 2, -1, 3, 42, 16, 17))
    monkeypatch.setattr(kv_write, "CHUNK_BYTES", 3 * 4 * 16 * 128 * 2)
    cache, k, v, slots = _inputs(case)
    expected = tpu.write_kv_reference(cache, k, v, slots)
    actual = kv_write.write_kv.__wrapped__(cache, k, v, slots, interpret=True)  # traced anew
    np.testing.assert_array_equal(np.asarray(actual, np.float32), np.asarray(expected, np.float32))
