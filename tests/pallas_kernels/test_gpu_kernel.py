# SPDX-License-Identifier: Apache-2.0
"""The Pallas GPU (Triton) kernel against the xla reference, on CPU with `interpret=True`.

The generic interpreter runs the kernel's gathers, loops and masks exactly as written, over the
grid of ragged batches (conftest.GRID), including flash-decoding KV splits (the decode buckets'
default, and 5 splits in the odd-tuning case). It checks no GPU semantics (no memory model, no
register limits); the Triton lowering is checked in test_lowering.py. Tolerances:
conftest.TOLERANCE (2e-5 f32, 2e-2 bf16, relative to max |ref|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu


@pytest.mark.slow  # the interpreter over the whole grid of batches
def test_matches_reference(case, compare_with_reference):
    compare_with_reference(case, "pallas_gpu", interpret=True, **dict(case.gpu_tuning))


def test_layout_splits_k_and_v_and_pads_head_dim_to_power_of_two():
    cache = gpu.allocate_kv_cache(4, 16, 2, 80, jnp.float32)
    assert cache.shape == (2, 2, 4, 16, 128)  # [2, K, num_pages, S, Dp]
    k = jnp.arange(2 * 80, dtype=jnp.float32).reshape(1, 2, 80) + 1
    cache = np.asarray(gpu.write_kv(cache, k, -k, jnp.array([3 * 16 + 7], jnp.int32)))  # page 3, offset 7
    for h in range(2):
        np.testing.assert_array_equal(cache[0, h, 3, 7, :80], k[0, h])
        np.testing.assert_array_equal(cache[1, h, 3, 7, :80], -k[0, h])
    assert np.abs(cache[..., 80:]).max() == 0.0  # padding lanes stay zero
    assert np.abs(cache).sum() == 2 * np.abs(k).sum()  # nothing else written


def test_write_kv_drops_negative_slots_in_place():
    cache = gpu.allocate_kv_cache(8, 16, 2, 128, jnp.float32)
    k = jnp.ones((3, 2, 128), jnp.float32)
    slots = jnp.array([-1, 17, -5], jnp.int32)
    pointer = cache.unsafe_buffer_pointer()
    out = jax.jit(gpu.write_kv, donate_argnums=0)(cache, k, 2 * k, slots)
    assert out.unsafe_buffer_pointer() == pointer  # donated: updated in place
    assert float(out.sum()) == (1 + 2) * 2 * 128  # only slot 17 (page 1, offset 1) written
    assert float(out[:, :, 1, 1].sum()) == (1 + 2) * 2 * 128


def _args(num_tokens=8, heads=4, head_dim=64, cache_shape=(2, 2, 8, 16, 64), slots=4, pages=2):
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
        (_args(cache_shape=(2, 2, 8, 16, 128)), {}, r"last dim must be 64"),
        (_args(heads=3), {}, r"3 heads must be a multiple"),
        (_args(cache_shape=(2, 2, 8, 24, 64)), {}, r"page size 24 must be a power of two"),
        ((*_args()[:2], jnp.zeros((5,), jnp.int32), *_args()[3:]), {}, r"kv_lens \[R\].*\(5,\)"),
        (_args(), {"num_kv_pages_per_block": 3}, r"num_kv_pages_per_block=3 must be a power of two"),
        (_args(), {"soft_cap": -1.0}, r"soft_cap must be positive"),
    ],
)
def test_bad_shapes_raise(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpu.ragged_paged_attention(*args, sm_scale=1.0, interpret=True, **kwargs)


def test_allocate_rejects_page_size_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="page_size 24 must be a power of two"):
        gpu.allocate_kv_cache(4, 24, 2, 64, jnp.float32)


def test_pages_over_a_tile_are_read_in_slices(compare_with_reference):
    # A hybrid model's pages (raised until one holds a Gated DeltaNet state) pass the kernel's
    # 16 KiB tile: 128 tokens of head dim 256 in bfloat16 are read 32 rows at a time.
    from pallas_kernels.gpu.tuned_block_sizes import blocks_per_page
    from tests.pallas_kernels.conftest import Case

    assert blocks_per_page(page_size=128, kv_row_bytes=256 * 2) == 4
    assert blocks_per_page(page_size=16, kv_row_bytes=128 * 2) == 1
    case = Case("mixed_p128_d256_bf16_sliced", (1, 40, 1), (300, 40, 129), 4, 128, 256, 1, 2, jnp.bfloat16)
    compare_with_reference(case, "pallas_gpu", interpret=True)
