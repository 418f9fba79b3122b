# SPDX-License-Identifier: Apache-2.0
"""Paged latent attention (pallas_kernels/mla.py): a hand-worked case, arithmetic in the comments;
the absorbed form against dense per-head attention over K/V built explicitly from the latents
(NumPy) on a ragged batch; the latent write; and the cache's bytes per token."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BACKENDS,
    allocate_latent_cache,
    latent_page_bytes,
    mla_paged_attention,
    write_latent,
)
from pallas_kernels.reference import decode_kv
from tests.pallas_kernels.conftest import numpy_causal_attention


def _step(q, latent, k_rope, slots, kv_lens, page_indices, cu_q_lens, num_seqs, *, num_pages, page_size,
          sm_scale, dtype=jnp.float32, backend="xla", first_page=0):  # fmt: skip
    interpret = backend in ("pallas_tpu", "pallas_gpu")  # the Pallas kernels run on CPU interpreted
    width = latent.shape[1] + k_rope.shape[1]
    kv_dtype = jnp.dtype(dtype).name
    cache = allocate_latent_cache(num_pages + first_page, page_size, width, dtype, backend=backend)
    cache = write_latent(
        cache, jnp.asarray(latent), jnp.asarray(k_rope), jnp.asarray(slots, jnp.int32),
        backend=backend, kv_dtype=kv_dtype, first_page=first_page, interpret=interpret,
    )  # fmt: skip
    out = mla_paged_attention(
        jnp.asarray(q), cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray([num_seqs], jnp.int32),
        sm_scale=sm_scale, latent_dim=latent.shape[1], backend=backend, kv_dtype=kv_dtype,
        first_page=first_page, interpret=interpret,
    )  # fmt: skip
    return np.asarray(out), cache


# The Pallas kernels' interpret-mode check in the fast tier is their small mixed batch
# (test_mla_tpu_kernel.py, test_mla_gpu_kernel.py); here they are the slow tier's.
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.slow) if b.startswith("pallas") else b for b in BACKENDS]
)
def test_hand_worked_prefill_of_two_tokens(backend):
    # Latent width L = 2, rope width R = 1, one head, sm_scale 1, page size 8, page 1.
    # Rows: token 0 = [c 1, 0 | k_rope 0], token 1 = [c 0, 1 | k_rope 1].
    # Query 0 = [ln 3, 0 | 0] at position 0 sees token 0 only: output c_0 = [1, 0].
    # Query 1 = [ln 3, 0 | 1] at position 1: scores ln 3 (token 0) and 1 (token 1), so
    # p = [3, e] / (3 + e), output [3, e] / (3 + e).
    latent = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    k_rope = np.array([[0.0], [1.0]], np.float32)
    q = np.array([[[math.log(3), 0.0, 0.0]], [[math.log(3), 0.0, 1.0]]], np.float32)
    out, _ = _step(q, latent, k_rope, [8, 9], [2], [[1]], [0, 2], 1, num_pages=2, page_size=8, sm_scale=1.0,
                   backend=backend)  # fmt: skip
    e = math.e
    np.testing.assert_allclose(out[:, 0], [[1.0, 0.0], [3 / (3 + e), e / (3 + e)]], rtol=1e-6)


def _ragged_case(rng, *, heads, nope, rope, latent_dim, v_dim, q_lens, kv_lens, page_size):
    """Random latents, rope keys, per-head W_UK / W_UV and queries for a ragged batch."""
    total_kv = sum(kv_lens)
    c = rng.standard_normal((total_kv, latent_dim)).astype(np.float32)
    kr = rng.standard_normal((total_kv, rope)).astype(np.float32)
    w_uk = (rng.standard_normal((heads, latent_dim, nope)) / math.sqrt(latent_dim)).astype(np.float32)
    w_uv = (rng.standard_normal((heads, latent_dim, v_dim)) / math.sqrt(latent_dim)).astype(np.float32)
    q_nope = rng.standard_normal((sum(q_lens), heads, nope)).astype(np.float32)
    q_rope = rng.standard_normal((sum(q_lens), heads, rope)).astype(np.float32)
    return c, kr, w_uk, w_uv, q_nope, q_rope


def _dense_attention(c, kr, w_uk, w_uv, q_nope, q_rope, q_lens, kv_lens, sm_scale):
    """Per-head K = [c W_UK | k_rope], V = c W_UV, built explicitly; dense causal softmax."""
    starts = np.concatenate([[0], np.cumsum(kv_lens)])
    k, v = [], []
    for i in range(len(kv_lens)):
        ci, ri = c[starts[i] : starts[i + 1]], kr[starts[i] : starts[i + 1]]
        k_nope = np.einsum("tl,hln->thn", ci, w_uk)  # [L_i, H, Dn]
        k.append(np.concatenate([k_nope, np.repeat(ri[:, None, :], w_uk.shape[0], axis=1)], axis=-1))
        v.append(np.einsum("tl,hlv->thv", ci, w_uv))
    q = np.concatenate([q_nope, q_rope], axis=-1) * sm_scale
    return numpy_causal_attention(q, k, v, q_lens, kv_lens)  # [T, H, Dv]


@pytest.mark.parametrize(
    "dtype, tolerance, first_page",
    [(jnp.float32, 1e-5, 0), (jnp.float32, 1e-5, 7), (jnp.bfloat16, 3e-2, 0), (jnp.float8_e4m3fn, 0.15, 0)],
)
def test_absorbed_form_matches_dense_attention_over_expanded_heads(dtype, tolerance, first_page):
    # A mixed step: a decode (1 query row over 37 tokens), a prefill chunk (9 rows over 20
    # tokens, so its first 11 are cached), a whole prompt of 5, and a padding slot.
    rng = np.random.default_rng(0)
    heads, nope, rope, latent_dim, v_dim, page_size = 4, 8, 4, 16, 8, 8
    q_lens, kv_lens = [1, 9, 5], [37, 20, 5]
    c, kr, w_uk, w_uv, q_nope, q_rope = _ragged_case(
        rng, heads=heads, nope=nope, rope=rope, latent_dim=latent_dim, v_dim=v_dim,
        q_lens=q_lens, kv_lens=kv_lens, page_size=page_size,
    )  # fmt: skip
    # Pages out of order, shared by nobody: sequence i's pages from a shuffled pool.
    pool = rng.permutation(np.arange(1, 20))
    widths = [-(-n // page_size) for n in kv_lens]
    tables = np.split(pool[: sum(widths)], np.cumsum(widths)[:-1])
    page_indices = np.zeros((4, max(widths)), np.int32)
    for i, t in enumerate(tables):
        page_indices[i, : len(t)] = t
    slots = np.concatenate([tables[i][np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for i, n in enumerate(kv_lens)])  # fmt: skip
    # Absorbed queries: q_latent = W_UK q_nope per head.
    q = np.concatenate([np.einsum("thn,hln->thl", q_nope, w_uk), q_rope], axis=-1)
    cu_q_lens = np.array([0, 1, 10, 15, 15])
    sm_scale = (nope + rope) ** -0.5
    out, _ = _step(
        q.astype(np.float32) if dtype == jnp.float32 else jnp.asarray(q, jnp.bfloat16), c, kr, slots,
        [*kv_lens, 0], page_indices, cu_q_lens, 3, num_pages=20, page_size=page_size, sm_scale=sm_scale,
        dtype=dtype, first_page=first_page,
    )  # fmt: skip
    got = np.einsum("thl,hlv->thv", out.astype(np.float32), w_uv)
    want = _dense_attention(c, kr, w_uk, w_uv, q_nope, q_rope, q_lens, kv_lens, sm_scale)
    assert np.max(np.abs(got - want)) <= tolerance * np.max(np.abs(want))


def test_padding_rows_are_zero_and_padding_slots_write_nothing():
    latent = np.ones((3, 2), np.float32)
    k_rope = np.full((3, 1), 2.0, np.float32)
    q = np.ones((3, 1, 3), np.float32)
    # Two real rows (one sequence of 2 tokens), one padding row with slot -1.
    out, cache = _step(q, latent, k_rope, [4, 5, -1], [2, 0], [[1], [0]], [0, 2, 2], 1,
                       num_pages=2, page_size=4, sm_scale=1.0)  # fmt: skip
    np.testing.assert_array_equal(out[2], 0.0)
    rows = np.asarray(cache).reshape(2, 4, 3)
    np.testing.assert_array_equal(rows[1, :2], [[1, 1, 2], [1, 1, 2]])
    np.testing.assert_array_equal(rows[0], 0.0)
    np.testing.assert_array_equal(rows[1, 2:], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e5m2])
def test_latent_cache_bytes_per_token_are_latent_plus_rope(dtype):
    # DeepSeek-V3's shape: latent 512, rope 64, pages of 16: (512 + 64) x dtype bytes a token.
    cache = jax.eval_shape(lambda: allocate_latent_cache(3, 16, 512 + 64, dtype, backend="xla"))
    per_token = cache.size * cache.dtype.itemsize // (3 * 16)
    assert per_token == (512 + 64) * jnp.dtype(dtype).itemsize
    assert latent_page_bytes(16, 576, dtype) == 16 * per_token


def test_written_rows_read_back_as_latent_then_rope():
    latent = jnp.asarray([[0.5, -1.5]], jnp.bfloat16)
    k_rope = jnp.asarray([[3.0]], jnp.bfloat16)
    cache = allocate_latent_cache(2, 4, 3, jnp.bfloat16, backend="xla")
    cache = write_latent(cache, latent, k_rope, jnp.asarray([6], jnp.int32), kv_dtype="bfloat16")
    rows = np.asarray(decode_kv(cache, "bfloat16")).reshape(2, 4, 3)
    np.testing.assert_array_equal(rows[1, 2], [0.5, -1.5, 3.0])
    assert np.count_nonzero(rows) == 3
