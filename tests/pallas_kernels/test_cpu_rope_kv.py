# SPDX-License-Identifier: Apache-2.0
"""RoPE on a fused q/k/v projection and the KV write: the jnp reference (`pallas_kernels.rope`) on
hand-worked rotations, then the native call (`rope_kv.cc`) against reference plus `write_kv` over
a grid (activation, projection and cache dtypes, page sizes, head counts and dims, padding and
out-of-range slots, positions past the table, a layer's `first_page`), its float8 and bfloat16
rounding against the reference's casts on every bfloat16 value, and the write in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import api, cpu
from pallas_kernels.reference import decode_kv, encode_kv
from pallas_kernels.rope import split_and_rotate


def test_reference_rotates_each_half_pair_by_its_position_row():
    # D = 4: the table row of a position is (cos0, cos1, sin0, sin1); x = (a, b, c, d) rotates to
    # (a cos0 - c sin0, b cos1 - d sin1, c cos0 + a sin0, d cos1 + b sin1).
    table = jnp.asarray([[1, 1, 0, 0], [0, 0.5, 1, -0.5]], jnp.float32)
    qkv = jnp.asarray([[1, 2, 3, 4] * 3, [1, 2, 3, 4] * 3], jnp.float32)  # q, k, v heads of 2 tokens
    q, k, v = split_and_rotate(
        qkv, jnp.asarray([0, 1]), table, num_heads=1, num_kv_heads=1, dtype=jnp.float32
    )
    np.testing.assert_array_equal(q[0, 0], [1, 2, 3, 4])  # position 0: the identity
    np.testing.assert_array_equal(q[1, 0], [-3, 1 + 2, 1, 2 - 1])  # 0.5 * 2 - 4 * -0.5 = 3
    np.testing.assert_array_equal(k, q[:, :1])
    np.testing.assert_array_equal(v[:, 0], [[1, 2, 3, 4]] * 2)  # v is not rotated


def test_reference_rounds_after_the_projection_and_after_the_rotation():
    table = jnp.asarray([[0.5, 0.5]], jnp.float32)  # cos = sin = 0.5
    x = 1 + 2.0**-9  # rounds to 1 in bfloat16 (ties to even), so the rotation sees (1, 1)
    q, _, _ = split_and_rotate(
        jnp.asarray([[x, x] * 3]),
        jnp.zeros(1, jnp.int32),
        table,
        num_heads=1,
        num_kv_heads=1,
        dtype=jnp.bfloat16,
    )
    assert q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q, np.float32)[0, 0], [0.0, 1.0])


# (T, H, K, D, page size, pages a layer, activation dtype, qkv dtype, cache values, layer)
# fmt: off
GRID = (
    (37, 6, 2, 64, 16, 9, jnp.float32, jnp.float32, jnp.float32, 0),
    (64, 9, 3, 64, 128, 4, jnp.bfloat16, jnp.float32, jnp.bfloat16, 1),
    (20, 4, 4, 128, 32, 6, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 2),
    (33, 8, 1, 80, 16, 8, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, 0),   # run-time head dim
    (17, 2, 2, 256, 16, 5, jnp.bfloat16, jnp.bfloat16, jnp.float8_e5m2, 3),
    (5, 3, 1, 64, 16, 3, jnp.float32, jnp.float32, jnp.bfloat16, 0),
)
# fmt: on


def _inputs(rng, t, h, k, d, page_size, pages, qkv_dtype):
    qkv = jnp.asarray(rng.normal(size=(t, (h + 2 * k) * d)) * 3, jnp.float32).astype(qkv_dtype)
    positions = rng.integers(0, 60, t).astype(np.int32)
    positions[0] = 500  # past the 50-row table: its last row
    slots = rng.permutation(pages * page_size)[:t].astype(np.int32)
    slots[1] = -1  # padding: writes nothing
    table = jnp.asarray(rng.normal(size=(50, d)), jnp.float32)
    return qkv, jnp.asarray(positions), table, jnp.asarray(slots)


def _assert_close(got, want, dtype):
    """Equal to within a unit in the last place of `dtype` at the values' scale (a multiply-add
    contracted here and not there rounds differently), and for bfloat16 mostly exactly."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps, atol=eps * np.abs(want).max())
    if dtype != jnp.float32:
        assert np.mean(got != want) < 0.01


# The fast tier keeps each cache dtype, both activation and qkv dtypes and every compiled head dim
# with the run-time one (GRID[0], [2], [3], [4]); 128-row pages and float32 activations into a
# bfloat16 cache are the slow tier's.
@pytest.mark.parametrize(
    "rope_case",
    [pytest.param(c, marks=pytest.mark.slow) if c in (GRID[1], GRID[5]) else c for c in GRID],
    ids=lambda c: f"T{c[0]}-H{c[1]}K{c[2]}-D{c[3]}-S{c[4]}-{jnp.dtype(c[8]).name}",
)
def test_native_call_matches_the_reference_and_write_kv(native_kernels, rope_case):
    t, h, k, d, page_size, pages, dtype, qkv_dtype, values, layer = rope_case
    first_page = layer * pages  # the layer's pages follow those of the layers before it
    rng = np.random.default_rng(t)
    qkv, positions, table, slots = _inputs(rng, t, h, k, d, page_size, pages, qkv_dtype)
    kv_dtype = jnp.dtype(values).name
    cache = cpu.allocate_kv_cache((layer + 1) * pages, page_size, k, d, values)
    q, got = jax.jit(
        lambda *a: api.rope_write_kv(
            *a,
            num_heads=h,
            num_kv_heads=k,
            dtype=dtype,
            backend="cpu_native",
            kv_dtype=kv_dtype,
            first_page=first_page,
        )
    )(qkv, positions, table, cache, slots)
    q_ref, k_ref, v_ref = split_and_rotate(qkv, positions, table, num_heads=h, num_kv_heads=k, dtype=dtype)
    want = api.write_kv(
        cache, k_ref, v_ref, slots, backend="cpu_native", kv_dtype=kv_dtype, first_page=first_page
    )
    assert q.dtype == dtype and q.shape == (t, h, d)
    _assert_close(q, q_ref, dtype)
    got_values, want_values = decode_kv(got, kv_dtype), decode_kv(want, kv_dtype)
    assert np.count_nonzero(np.asarray(want_values)) > 0
    if jnp.dtype(values) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        _assert_close(got_values, want_values, jnp.promote_types(values, dtype))
    else:  # a one-ulp difference of the rotated bfloat16 value may round to the next float8
        np.testing.assert_allclose(got_values, want_values, rtol=float(ml_dtypes.finfo(values).eps))
        assert np.mean(np.asarray(got) != np.asarray(want)) < 0.01
    untouched = np.asarray(got)[:first_page]  # the pages of earlier layers
    assert not untouched.any()


@pytest.mark.parametrize("values", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16])
def test_values_are_stored_as_the_reference_casts_them(native_kernels, values):
    """v is stored without rotation, so every finite bfloat16 value (as v) and random float32
    ones with ties checks the native rounding and float8 saturation bit for bit."""
    bits = np.arange(2**16, dtype=np.uint32)
    all_bf16 = (bits << 16).view(np.float32)
    finite = all_bf16[np.isfinite(all_bf16)]
    rng = np.random.default_rng(0)
    ties = (rng.integers(0, 2**31, 4096, dtype=np.uint32) & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    samples = np.concatenate([finite, ties.view(np.float32)[np.isfinite(ties.view(np.float32))]])
    d, page_size = 64, 16
    samples = np.concatenate([samples, np.zeros(-len(samples) % d, np.float32)])
    v = samples.reshape(-1, 1, d)
    t = v.shape[0]
    qkv = jnp.asarray(np.concatenate([np.zeros((t, 2 * d), np.float32), v[:, 0]], axis=1))
    kv_dtype = jnp.dtype(values).name
    cache = cpu.allocate_kv_cache(-(-t // page_size), page_size, 1, d, values)
    slots = jnp.arange(t, dtype=jnp.int32)
    _, got = cpu.rope_write_kv(
        qkv, jnp.zeros(t, jnp.int32), jnp.ones((1, d), jnp.float32), cache, slots,
        num_heads=1, num_kv_heads=1, dtype=jnp.float32, kv_dtype=kv_dtype,
    )  # fmt: skip
    stored = np.asarray(got)[:, 1].reshape(-1, d)[:t]  # the v rows, slot by slot
    np.testing.assert_array_equal(stored, np.asarray(encode_kv(jnp.asarray(v[:, 0]), jnp.dtype(values))))


def test_cache_is_written_in_place_when_donated(native_kernels):
    cache = cpu.allocate_kv_cache(64, 16, 3, 64, jnp.bfloat16)
    pointer = cache.unsafe_buffer_pointer()
    step = jax.jit(
        lambda c, x, s: cpu.rope_write_kv(
            x,
            jnp.zeros(4, jnp.int32),
            jnp.ones((8, 64)),
            c,
            s,
            num_heads=9,
            num_kv_heads=3,
            dtype=jnp.bfloat16,
        ),
        donate_argnums=0,
    )
    x = jnp.ones((4, 15 * 64), jnp.float32)
    _, cache = step(cache, x, jnp.asarray([3, 70, -1, 1000], jnp.int32))
    assert cache.unsafe_buffer_pointer() == pointer
    assert np.asarray(cache)[4, :, 6 * 64 : 7 * 64].any()  # slot 70: page 4, offset 6


def test_refuses_dtypes_it_cannot_take(native_kernels):
    args = (jnp.zeros((2, 3 * 64), jnp.float16), jnp.zeros(2, jnp.int32), jnp.ones((4, 64)))
    cache = cpu.allocate_kv_cache(2, 16, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        cpu.rope_write_kv(
            *args, cache, jnp.zeros(2, jnp.int32), num_heads=1, num_kv_heads=1, dtype=jnp.bfloat16
        )
    with pytest.raises(ValueError, match=r"qkv \(2, 192\) is not \[T, \(num_heads"):
        cpu.rope_write_kv(
            jnp.zeros((2, 3 * 64)), *args[1:], cache, jnp.zeros(2, jnp.int32), num_heads=2, num_kv_heads=1,
            dtype=jnp.float32,
        )  # fmt: skip
    # float16 activations are not the native call's: the API composes the reference instead
    q, _ = api.rope_write_kv(
        *args,
        cache,
        jnp.zeros(2, jnp.int32),
        num_heads=1,
        num_kv_heads=1,
        dtype=jnp.float16,
        backend="cpu_native",
    )
    assert q.dtype == jnp.float16
