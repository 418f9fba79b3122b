# SPDX-License-Identifier: Apache-2.0
"""The Pallas GPU (Triton) latent attention (MLA) kernel and its write against the xla reference,
on CPU in interpret mode (mla_cases.GRID; tolerances there: 2e-5 f32, 2e-2 bf16, relative to
max |ref|), and its Triton lowering's shape rules through `jax.export` for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gpu import mla_kernel
from tests.pallas_kernels.mla_cases import GRID, SMALL, assert_matches_reference


def test_small_mixed_batch_matches_reference():
    assert_matches_reference(SMALL, "pallas_gpu", interpret=True, **dict(SMALL.gpu_tuning))


@pytest.mark.slow  # a second interpret-mode run (fast: the small mixed batch above)
def test_default_tuning_matches_reference():
    # Production defaults: one token a work item and KV splits in a decode step.
    assert_matches_reference(GRID[0], "pallas_gpu", interpret=True)


@pytest.mark.slow  # the interpreter over the whole grid
@pytest.mark.parametrize("mla_case", GRID, ids=[c.name for c in GRID])
def test_matches_reference(mla_case):
    assert_matches_reference(mla_case, "pallas_gpu", interpret=True, **dict(mla_case.gpu_tuning))


@pytest.mark.slow  # a second interpret-mode run (fast: the small mixed batch above)
def test_hopper_decode_tuning_matches_reference():
    # Hopper's decode default (64-key blocks, KV splits) at DeepSeek's widths, which only real
    # GPUs pick: the interpreter checks the same tiling here.
    case = next(c for c in GRID if c.name == "mixed_p16_deepseek_widths_bf16")
    assert_matches_reference(case, "pallas_gpu", interpret=True, num_kv_pages_per_block=4, num_kv_splits=4)


def test_large_tiles_only_for_decode_buckets():
    sizes = dict(page_size=16, pages_per_seq=128, max_num_seqs=64, num_head_blocks=8)
    assert mla_kernel.default_block_sizes(num_tokens=64, large_tiles=True, **sizes) == (4, 1, 4)
    assert mla_kernel.default_block_sizes(num_tokens=64, **sizes) == (2, 1, 4)
    # A prefill's 2-token work items would pass Hopper's shared memory with 64 keys.
    assert mla_kernel.default_block_sizes(num_tokens=512, large_tiles=True, **sizes) == (2, 2, 1)
    assert not mla_kernel.hopper_or_newer()  # tests run on the CPU


def test_deepseek_rows_are_stored_unpadded():
    # Latent 512 and rope 64 are powers of two: a token's row is 576 values, as in the reference.
    cache = mla_kernel.allocate_latent_cache(3, 16, 576, jnp.bfloat16)
    assert cache.shape == (3, 16, 576) and cache.dtype == jnp.bfloat16
    assert mla_kernel.row_lanes(20) == 16 + 16  # latent 16 (padded rope 4)


def test_lowers_for_cuda_at_deepseek_shapes():
    # 64 decodes of 128 heads over 2k tokens: Triton's power-of-two tile rule, checked by export.
    q = jax.ShapeDtypeStruct((64, 128, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((64 * 128 + 1, 16, 576), jnp.bfloat16)
    i32 = jnp.int32
    meta = (
        jax.ShapeDtypeStruct((64,), i32),
        jax.ShapeDtypeStruct((64, 128), i32),
        jax.ShapeDtypeStruct((65,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )

    def attend(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs):
        return mla_kernel.mla_paged_attention(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=0.1, latent_dim=512
        )

    exported = jax.export.export(
        jax.jit(attend),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, cache, *meta)
    assert exported.out_avals[0].shape == (64, 128, 512)


def _args(width=48, cache_shape=(8, 16, 48), slots=2, pages=2):
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
        (_args(cache_shape=(8, 16, 64)), {}, r"last dim must be 48 for rows of 32 \+ 16"),
        (_args(cache_shape=(8, 12, 48)), {}, r"page size 12 must be a power of two"),
        (_args(), {"latent_dim": 40}, r"latents of a power of two below the row width 48"),
        (_args(), {"num_kv_pages_per_block": 3}, r"num_kv_pages_per_block=3 must be a power of two"),
    ],
)
def test_bad_shapes_raise(args, kwargs, message):
    kwargs = {"latent_dim": 32, **kwargs}
    with pytest.raises(ValueError, match=message):
        mla_kernel.mla_paged_attention(*args, sm_scale=1.0, interpret=True, **kwargs)
