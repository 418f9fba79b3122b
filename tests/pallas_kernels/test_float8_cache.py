# SPDX-License-Identifier: Apache-2.0
"""Float8 KV caches (vLLM's `kv_cache_dtype="fp8"` / `"fp8_e5m2"`) on the `xla` and `cpu_native`
backends, against hand-worked values and NumPy (ml_dtypes' float8 conversion).

The Pallas kernels run the float8 cases of conftest.GRID against the reference in their own
test modules, and lower with float8 caches in test_lowering.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import api, reference
from tests.pallas_kernels.conftest import numpy_causal_attention

FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.fixture(autouse=True)
def _native_kernels_for_cpu_native(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec and callspec.params.get("backend") == "cpu_native":
        request.getfixturevalue("native_kernels")


def _stored_values(kv_dtype: str, values: list[float]) -> list[float]:
    """Writes `values` as one key row of a one-page `xla` cache and reads them back as float32."""
    cache = api.allocate_kv_cache(1, 1, 1, len(values), kv_dtype, backend="xla")
    k = jnp.asarray([[values]], jnp.float32)
    cache = api.write_kv(cache, k, k, jnp.array([0], jnp.int32), backend="xla", kv_dtype=kv_dtype)
    assert cache.dtype == jnp.uint8
    return reference.decode_kv(cache[0, 0], kv_dtype).tolist()


def test_e4m3_rounds_to_three_mantissa_bits_and_saturates_at_448():
    # 0.3 = 1.2 * 2^-2 lies between 1.125 * 2^-2 = 0.28125 and 1.25 * 2^-2 = 0.3125: nearer the latter.
    # 2^-9 is the smallest subnormal; 1000 and 460 are past the largest finite value, 448 (a plain
    # cast would make NaN of them); the sign is kept.
    got = _stored_values("float8_e4m3fn", [0.3, 2.0**-9, 448.0, 460.0, 1000.0, -1000.0, -0.3, 0.0])
    assert got == [0.3125, 2.0**-9, 448.0, 448.0, 448.0, -448.0, -0.3125, 0.0]


def test_e5m2_rounds_to_two_mantissa_bits_and_saturates_at_57344():
    # 0.3 lies between 1.0 * 2^-2 and 1.25 * 2^-2 = 0.3125: nearer the latter; 0.28 nearer 0.25.
    # 2^-16 is the smallest subnormal; 1e6 saturates at 57344 (a plain cast would make inf).
    got = _stored_values("float8_e5m2", [0.3, 0.28, 2.0**-16, 57344.0, 1e6, -1e6])
    assert got == [0.3125, 0.25, 2.0**-16, 57344.0, 57344.0, -57344.0]


def test_a_uint8_cache_needs_the_dtype_it_was_allocated_for():
    cache = api.allocate_kv_cache(2, 4, 1, 8, jnp.float8_e4m3fn, backend="xla")
    k = jnp.ones((1, 1, 8))
    with pytest.raises(ValueError, match="pass kv_dtype='float8_e4m3fn' or 'float8_e5m2'"):
        api.write_kv(cache, k, k, jnp.array([0], jnp.int32), backend="xla")
    with pytest.raises(ValueError, match="kv_dtype bfloat16 is stored as uint16, but this KV cache is uint8"):
        api.write_kv(cache, k, k, jnp.array([0], jnp.int32), backend="xla", kv_dtype="bfloat16")
    tpu_cache = api.allocate_kv_cache(2, 32, 1, 8, jnp.float8_e5m2, backend="pallas_tpu")
    assert tpu_cache.dtype == jnp.float8_e5m2  # the Pallas caches hold the values' own dtype
    with pytest.raises(ValueError, match="does not match"):
        api.write_kv(
            tpu_cache, k, k, jnp.array([0], jnp.int32), backend="pallas_tpu", kv_dtype="float8_e4m3fn"
        )


def _single_key_outputs(backend: str, kv_dtype: str, patterns: np.ndarray, head_dim: int, rows: int):
    """Attention output of query row 0 over a one-key sequence whose value row is `patterns[i]`
    (bits), for every i: softmax over one key is 1, so the output is the decoded value row."""
    num_pages = len(patterns) + 1
    cache = np.zeros(
        api.allocate_kv_cache(num_pages, 16, 1, head_dim, kv_dtype, backend=backend).shape, np.uint8
    )
    for page, row in enumerate(patterns):
        if backend == "xla":  # [2K, pages, S * D]: value head 0 is row 1
            cache[1, page, :head_dim] = row
        else:  # [pages, 2K, S * D]
            cache[page, 1, :head_dim] = row
    cache = jnp.asarray(cache)
    q = jnp.ones((rows, 1, head_dim), jnp.float32)

    @jax.jit
    def attend(page):
        return api.ragged_paged_attention(
            q, cache, jnp.array([rows], jnp.int32), jnp.reshape(page, (1, 1)),
            jnp.array([0, rows], jnp.int32), jnp.array([1], jnp.int32),
            sm_scale=1.0, backend=backend, kv_dtype=kv_dtype,
        )  # fmt: skip

    return np.concatenate([np.asarray(attend(jnp.int32(p)))[0, 0] for p in range(len(patterns))])


# The head dims and row counts pick the native kernel's paths; XLA has one path, so the fast tier
# runs it on the first shape only (the others are the slow tier's).
@pytest.mark.parametrize("kv_dtype", FLOAT8)
@pytest.mark.parametrize(
    ("backend", "head_dim", "rows"),
    [
        pytest.param(
            backend, *shape, marks=pytest.mark.slow if backend == "xla" and shape != (256, 1) else ()
        )
        for backend in ("xla", "cpu_native")
        for shape in ((256, 1), (256, 2), (80, 1), (80, 2))
    ],
)
def test_every_float8_bit_pattern_reads_back_exactly(backend, kv_dtype, head_dim, rows):
    # D = 256: the native kernel's compiled-size path (vector loads where the CPU has AVX-512);
    # D = 80: its run-time-size path. One row: a decode row reads pages as stored; two rows: a
    # block converts each page once.
    bits = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(bits.view(jnp.dtype(kv_dtype)).astype(np.float32))
    bits = np.where(finite, bits, 0).astype(np.uint8)  # NaN and inf are never stored (saturation)
    padded = np.zeros(-(-256 // head_dim) * head_dim, np.uint8)
    padded[:256] = bits
    want = padded.view(jnp.dtype(kv_dtype)).astype(np.float32)
    got = _single_key_outputs(backend, kv_dtype, padded.reshape(-1, head_dim), head_dim, rows)
    np.testing.assert_array_equal(got, want)


# XLA converts either float8 type the same way: the fast tier runs it on e4m3 only.
@pytest.mark.parametrize(
    ("backend", "kv_dtype"),
    [
        pytest.param(backend, kv_dtype, marks=pytest.mark.slow if backend == "xla" and i else ())
        for backend in ("xla", "cpu_native")
        for i, kv_dtype in enumerate(FLOAT8)
    ],
)
def test_attention_over_a_float8_cache_is_attention_over_the_rounded_values(backend, kv_dtype):
    rng = np.random.default_rng(5)
    q_lens, kv_lens, heads, kv_heads, dim, page = [1, 6, 1], [40, 6, 77], 6, 2, 64, 32
    pages_per_seq = -(-max(kv_lens) // page)
    table = rng.permutation(len(q_lens) * pages_per_seq).reshape(len(q_lens), pages_per_seq).astype(np.int32)
    k = [rng.standard_normal((n, kv_heads, dim)).astype(np.float32) * 3 for n in kv_lens]
    v = [rng.standard_normal((n, kv_heads, dim)).astype(np.float32) * 3 for n in kv_lens]
    q = rng.standard_normal((sum(q_lens), heads, dim)).astype(np.float32)
    slots = np.concatenate(
        [table[i][np.arange(n) // page] * page + np.arange(n) % page for i, n in enumerate(kv_lens)]
    )
    cache = api.allocate_kv_cache(table.size, page, kv_heads, dim, kv_dtype, backend=backend)
    cache = api.write_kv(
        cache, np.concatenate(k), np.concatenate(v), jnp.asarray(slots, jnp.int32), backend=backend,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    got = api.ragged_paged_attention(
        jnp.asarray(q), cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.array([3], jnp.int32),
        sm_scale=dim**-0.5, backend=backend, kv_dtype=kv_dtype,
    )  # fmt: skip

    def rounded(x):
        return x.astype(jnp.dtype(kv_dtype)).astype(np.float32)  # all within range: no saturation

    k, v = [rounded(x) for x in k], [rounded(x) for x in v]
    want = numpy_causal_attention(q * dim**-0.5, k, v, q_lens, kv_lens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
