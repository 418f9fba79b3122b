# SPDX-License-Identifier: Apache-2.0
"""Pure-jnp paged multi-head latent attention (MLA, DeepSeek-V2/V3): the reference and, today,
the path of every backend.

The latent cache holds, per token, one row of `C = L + R` values: the compressed latent
`c_kv [L]` (`kv_lora_rank`, after its RMSNorm) followed by the decoupled RoPE key `k_rope [R]`
(`qk_rope_head_dim`, rotated), one row shared by every query head. That is the point of MLA: a
DeepSeek-V3 token costs 576 values a layer, not 128 heads x (192 + 128).

Layout (a layer's; several layers stack along the page axis, as in api.py): `[num_pages,
page_size * C]`, a page one contiguous row, tokens one after another inside it. The dtype
storage is the reference's (`reference.storage_dtype`: bfloat16 as uint16 bits, float8 as uint8),
for the same reason (XLA:CPU scatters neither type in place).

Attention is computed in the absorbed form: the caller folds each head's key up-projection
`W_UK [L, Dn]` into its query (`q_latent = W_UK @ q_nope`, `[L]`) and concatenates the rotated
`q_rope [R]`, so a query row is `[T, H, C]` and scores are `q . row`; the values are the
latents themselves (the first L values of each row), and the caller applies each head's value
up-projection `W_UV [L, Dv]` to the `[T, H, L]` result. This is exact: `q_nope . (c W_UK) =
(W_UK q_nope) . c` and `sum_j p_j (c_j W_UV) = (sum_j p_j c_j) W_UV`.

Axis letters: T tokens, R sequences (in signatures) or rope width (in comments), P pages per
sequence, S page size, H query heads, L latent width, C row width (L + rope width), N query
blocks, B rows per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference import (
    MASK_VALUE,
    decode_kv,
    encode_kv,
    query_blocks,
    storage_dtype,
    value_dtype,
)


def allocate_latent_cache_reference(
    num_pages: int, page_size: int, width: int, dtype: jnp.dtype
) -> jax.Array:
    """A zeroed `[num_pages, page_size * width]` latent cache for values of `dtype`."""
    return jnp.zeros((num_pages, page_size * width), storage_dtype(dtype))


def write_latent_reference(
    cache: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_dtype: jnp.dtype | str | None = None,
) -> jax.Array:
    """Writes the rows `[latent | k_rope]` (`[T, L]`, `[T, R]`) at `slot_mapping[T]` (page * S +
    offset); negative slots write nothing. One windowed scatter, which XLA keeps in place."""
    num_pages, row_len = cache.shape
    width = latent.shape[1] + k_rope.shape[1]
    page_size = row_len // width
    assert page_size * width == row_len, (cache.shape, latent.shape, k_rope.shape)
    rows = encode_kv(jnp.concatenate([latent, k_rope], axis=1), value_dtype(cache.dtype, kv_dtype))  # [T, C]
    if slot_mapping.shape[0] == 1:
        # A one-row scatter becomes a dynamic-update-slice that copies the cache: a second
        # (dropped) row keeps it a scatter.
        rows = jnp.concatenate([rows, rows])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full_like(slot_mapping, -1)])
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # out of range: dropped
    offset = (slot_mapping % page_size) * width
    indices = jnp.stack([page, offset], axis=-1).astype(jnp.int32)  # [T, 2]
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(
        cache, indices, rows, dims, unique_indices=True, mode=lax.GatherScatterMode.FILL_OR_DROP
    )


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "latent_dim", "kv_dtype", "kv_chunk_pages", "query_block")
)
def mla_paged_attention_reference(
    q: jax.Array,
    cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    latent_dim: int,
    kv_dtype: str | None = None,
    kv_chunk_pages: int = 4,
    query_block: int | None = None,
) -> jax.Array:
    """Causal latent attention of ragged query rows over their sequences' paged latent rows.

    Query rows are taken in blocks of `query_block` rows of one sequence (1 when the step has no
    more tokens than sequence slots, a decode step; else 16), and every block walks its
    sequence's pages in chunks of `kv_chunk_pages` pages with an online softmax, for only as many
    chunks as the furthest query position needs.

    Args:
      q: `[T, H, C]` absorbed queries `[q_latent | q_rope]`; sequence i owns rows
        `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      cache: `[num_pages, S * C]`, already holding these tokens' rows.
      kv_lens: `[R]` int32, tokens cached per sequence (including this step's).
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths.
      num_seqs: int32 scalar (or `[1]`); sequences past it and rows past `cu_q_lens[num_seqs]`
        are padding and produce zeros.
      sm_scale: softmax scale applied to `q . row`.
      latent_dim: L, the values' width (the first L values of each row).
      kv_dtype: the cached values' dtype by name (static), needed for a uint8 (float8) cache.
      kv_chunk_pages, query_block: static tiling (see above).

    Returns:
      `[T, H, L]` in q's dtype: each head's attention-weighted latent.
    """
    num_tokens, num_heads, width = q.shape
    num_pages, row_len = cache.shape
    page_size = row_len // width
    assert page_size * width == row_len, (q.shape, cache.shape)
    values_dtype = value_dtype(cache.dtype, kv_dtype)
    block = query_block or (1 if num_tokens <= page_indices.shape[0] else 16)
    seq, tok, valid, position, _ = query_blocks(
        cu_q_lens, kv_lens, jnp.reshape(num_seqs, ()), num_tokens, block
    )
    num_blocks = seq.shape[0]
    qb = jnp.take(q.astype(jnp.float32), tok, axis=0, mode="fill", fill_value=0)  # [N, B, H, C]
    chunk_pages = max(1, min(kv_chunk_pages, page_indices.shape[1]))
    chunk_len = chunk_pages * page_size
    pages_per_seq = page_indices.shape[1]
    table = jnp.pad(
        page_indices, ((0, 0), (0, -(-pages_per_seq // chunk_pages) * chunk_pages - pages_per_seq))
    )
    last = jnp.max(jnp.where(valid, position, -1))  # the furthest position any row looks at

    def chunk(c, carry):
        m, denom, acc = carry  # [N, B, H], [N, B, H], [N, B, H, L]
        pages = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)[seq]  # [N, cp]
        rows = jnp.take(cache, jnp.clip(pages, 0, num_pages - 1), axis=0)  # [N, cp, S * C]
        kv = decode_kv(rows, values_dtype).reshape(num_blocks, chunk_len, width)  # [N, Lc, C]
        scores = jnp.einsum("nbhc,nkc->nbhk", qb, kv) * sm_scale  # [N, B, H, Lc]
        key_pos = c * chunk_len + jnp.arange(chunk_len)  # [Lc]
        visible = (key_pos[None, None, :] <= position[:, :, None]) & valid[:, :, None]  # [N, B, Lc]
        visible = visible[:, :, None, :]  # [N, B, 1, Lc]
        m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, MASK_VALUE), axis=3))
        p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)  # [N, B, H, Lc]
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("nbhk,nkl->nbhl", p, kv[..., :latent_dim])  # [N, B, H, L]
        return m_new, denom * alpha + jnp.sum(p, axis=3), acc * alpha[..., None] + pv

    shape = (num_blocks, block, num_heads)
    init = (jnp.full(shape, MASK_VALUE), jnp.zeros(shape), jnp.zeros((*shape, latent_dim)))
    _, denom, acc = lax.fori_loop(0, (last + chunk_len) // chunk_len, chunk, init)
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)  # [N, B, H, L]
    rows_out = jnp.zeros((num_tokens + 1, num_heads, latent_dim), jnp.float32)
    rows_out = rows_out.at[tok.reshape(-1)].set(out.reshape(-1, num_heads, latent_dim))
    return rows_out[:num_tokens].astype(q.dtype)
