# SPDX-License-Identifier: Apache-2.0
"""Pure-jnp paged KV cache and ragged paged attention: the `xla` backend.

This is the reference every kernel is tested against, and the CPU path when the native kernel
(`cpu/`) cannot be built.

KV cache layout (a layer's; several layers stack along the page axis: api.py):
`[2 * Hkv, num_pages, page_size * D]`.
Rows `0..Hkv-1` hold K heads and rows `Hkv..2*Hkv-1` hold V heads; a page of one head is one
contiguous row of `page_size * D` values. Why (measured on XLA:CPU):
row gathers along axis 1 run at memory speed, and the KV write is one windowed scatter that XLA
keeps in place. A bfloat16 cache is stored as `uint16` bit patterns and a float8 one
(`float8_e4m3fn`, `float8_e5m2`: vLLM's `kv_cache_dtype="fp8"`) as `uint8`, because XLA:CPU has
no scatter of either type and converts the whole cache to f32 and back on every write otherwise
(seconds a layer for a large cache). A `uint8` array does not say which float8 it
holds, so its readers and writers take `kv_dtype`. Float8 values are stored unscaled (vLLM's
default `k_scale = v_scale = 1`) and saturate at the type's largest finite value.

Axis letters: T tokens, R sequences, P pages per sequence, S page size, L = P * S,
K kv heads, G query heads per kv head, H query heads (= K * G), D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

MASK_VALUE = -1e30


FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_BIT_STORAGE = {
    jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
    **{dtype: jnp.dtype(jnp.uint8) for dtype in FLOAT8_DTYPES},
}


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the cache array is stored in for values of `dtype` (bit patterns for bfloat16
    and float8)."""
    return _BIT_STORAGE.get(jnp.dtype(dtype), jnp.dtype(dtype))


def value_dtype(stored: jnp.dtype, kv_dtype: jnp.dtype | str | None = None) -> jnp.dtype:
    """The dtype of the values a cache of `stored` elements holds: `kv_dtype` when given (checked
    against `stored`), else bfloat16 for uint16 bits and the array's own dtype otherwise."""
    stored = jnp.dtype(stored)
    if kv_dtype is None:
        if stored == jnp.uint8:
            raise ValueError(
                "a uint8 KV cache holds float8 bit patterns: pass kv_dtype='float8_e4m3fn' or "
                "'float8_e5m2' (the dtype it was allocated for)"
            )
        return jnp.dtype(jnp.bfloat16) if stored == jnp.uint16 else stored
    kv_dtype = jnp.dtype(kv_dtype)
    if storage_dtype(kv_dtype) != stored:
        raise ValueError(
            f"kv_dtype {kv_dtype.name} is stored as {storage_dtype(kv_dtype).name}, but this KV cache "
            f"is {stored.name}: pass the dtype the cache was allocated for"
        )
    return kv_dtype


def allocate_kv_cache_reference(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> jax.Array:
    """A zeroed `[2 * Hkv, num_pages, page_size * D]`: one layer's pages, or several layers' (api.py)."""
    return jnp.zeros((2 * num_kv_heads, num_pages, page_size * head_dim), storage_dtype(dtype))


def saturating_cast(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x.astype(dtype)`, with float8 saturating at its largest finite value as vLLM's conversion
    does (a plain cast makes NaN or inf of what does not fit)."""
    dtype = jnp.dtype(dtype)
    if dtype in FLOAT8_DTYPES:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def encode_kv(x: jax.Array, kv_dtype: jnp.dtype) -> jax.Array:
    """Values as stored for `kv_dtype` (`storage_dtype`)."""
    x = saturating_cast(x, kv_dtype)
    stored = storage_dtype(kv_dtype)
    return x if stored == x.dtype else lax.bitcast_convert_type(x, stored)


def decode_kv(rows: jax.Array, kv_dtype: jnp.dtype | str | None = None) -> jax.Array:
    """Cache values as float32 (see `value_dtype` for `kv_dtype`)."""
    kv_dtype = value_dtype(rows.dtype, kv_dtype)
    if rows.dtype == jnp.uint16:
        return lax.bitcast_convert_type(rows.astype(jnp.uint32) << 16, jnp.float32)
    if rows.dtype != kv_dtype:
        rows = lax.bitcast_convert_type(rows, kv_dtype)
    return rows.astype(jnp.float32)


def write_kv_reference(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_dtype: jnp.dtype | str | None = None,
) -> jax.Array:
    """Writes k, v `[T, K, D]` at `slot_mapping[T]` (page * S + offset); negative slots write
    nothing. `kv_dtype`: the values' dtype, needed for a uint8 (float8) cache."""
    return scatter_kv(kv_cache, k, v, slot_mapping, page_axis=1, kv_dtype=kv_dtype)


def scatter_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    page_axis: int,
    kv_dtype: jnp.dtype | str | None = None,
) -> jax.Array:
    """`write_kv_reference` for a cache whose pages lie along `page_axis` (1: `[2K, pages, S*D]`,
    0: `[pages, 2K, S*D]`, the `cpu_native` layout): one windowed scatter XLA keeps in place."""
    row_axis = 1 - page_axis
    num_pages, row_len = kv_cache.shape[page_axis], kv_cache.shape[2]
    _, num_kv_heads, head_dim = k.shape
    assert kv_cache.shape[row_axis] == 2 * num_kv_heads, (kv_cache.shape, k.shape)
    page_size = row_len // head_dim
    kv_dtype = value_dtype(kv_cache.dtype, kv_dtype)
    updates = encode_kv(jnp.concatenate([k, v], axis=1), kv_dtype)  # [T, 2K, D]
    if slot_mapping.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice that copies the whole cache;
        # a second (dropped) row keeps it an in-place scatter.
        updates = jnp.concatenate([updates, updates])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full_like(slot_mapping, -1)])
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # out of range: dropped
    offset = (slot_mapping % page_size) * head_dim
    indices = jnp.stack([page, offset], axis=-1).astype(jnp.int32)  # [T, 2]
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2),
        inserted_window_dims=(page_axis,),
        scatter_dims_to_operand_dims=(page_axis, 2),
    )
    return lax.scatter(
        kv_cache, indices, updates, dims, unique_indices=True, mode=lax.GatherScatterMode.FILL_OR_DROP
    )


def query_blocks(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, block: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cuts every sequence's query rows into blocks of `block` rows (one sequence per block).

    Returns `seq[N]` (each block's sequence), `tok[N, B]` (row indices; `num_tokens` where
    invalid), `valid[N, B]`, `position[N, B]` (the row's position in its sequence) and the
    number of blocks in use, for a static `N`: `T` when `block == 1`, else
    `ceil(T / B) + R`, enough whatever the lengths. Blocks in use come first.
    """
    num_slots = kv_lens.shape[0]
    q_len = jnp.where(jnp.arange(num_slots) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [R]
    ends = jnp.cumsum((q_len + block - 1) // block)  # [R] exclusive end block of each sequence
    num_blocks = num_tokens if block == 1 else -(-num_tokens // block) + num_slots
    j = jnp.arange(num_blocks)
    seq_raw = jnp.sum(j[:, None] >= ends[None, :], axis=1)  # [N]
    seq = jnp.minimum(seq_raw, num_slots - 1)
    first = cu_q_lens[seq] + (j - (ends[seq] - (q_len[seq] + block - 1) // block)) * block  # [N]
    tok = first[:, None] + jnp.arange(block)[None, :]  # [N, B]
    valid = (seq_raw < num_seqs)[:, None] & (tok < cu_q_lens[seq + 1][:, None])
    position = kv_lens[seq][:, None] - (cu_q_lens[seq + 1][:, None] - tok)
    return seq, jnp.where(valid, tok, num_tokens), valid, position, ends[-1]


def _gather_rows(
    flat_cache: jax.Array, heads: jax.Array, pages: jax.Array, num_pages: int, kv_dtype: jnp.dtype
) -> jax.Array:
    """Rows `heads[h] * num_pages + pages[i]` of the flat cache, float32 `[len(heads), len(pages), S * D]`.

    One gather straight from the flat cache (no copy of a K or V half), decoded as it is read.
    """
    rows = jnp.take(flat_cache, heads[:, None] * num_pages + pages[None, :], axis=0, mode="clip")
    return decode_kv(rows, kv_dtype)


# Jitted so that a model's layers, which call it with identical shapes, trace it once.
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "attention_chunk_size",
        "kv_chunk_pages",
        "query_block",
        "rows_per_group",
        "kv_dtype",
    ),
)
def ragged_paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk_size: int | None = None,
    kv_chunk_pages: int = 4,
    query_block: int | None = None,
    rows_per_group: int | None = None,
    kv_dtype: str | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged query rows over their sequences' paged KV.

    Query rows are taken in blocks of `query_block` rows of one sequence, and each block gathers
    its sequence's pages once: 1 (per row) suits decode steps, larger blocks prefill chunks,
    whose rows share their pages. By default 1 when the step has no more tokens than sequence
    slots, else 16. Blocks are sorted by how far they reach and processed in groups of about
    `rows_per_group` rows, for only as many groups as hold rows; each group walks the KV in chunks
    of `kv_chunk_pages` pages with an online softmax, for only as many chunks as its furthest
    query position needs. So the work follows the real rows and the real (causal) context: the
    block-table width P is free (no compile per context length), and padding rows, padding
    sequences and pages past every row's position cost nothing.

    Args:
      q: `[T, H, D]` queries; sequence i owns rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      kv_cache: `[2K, num_pages, S * D]`, already holding these tokens' K/V.
      kv_lens: `[R]` int32, tokens cached per sequence (including this step's).
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths.
      num_seqs: int32 scalar (or `[1]`); sequences past it and rows past `cu_q_lens[num_seqs]`
        are padding and produce zeros.
      sm_scale: softmax scale applied to q.k.
      sliding_window: if set, a query at position p sees keys at positions > p - sliding_window.
      soft_cap: if set, scores become `soft_cap * tanh(scores / soft_cap)`.
      attention_chunk_size: if set, chunked local attention (Llama 4): positions fall in chunks
        of this many tokens, and a query at position p sees keys of its own chunk only, at
        positions >= (p // attention_chunk_size) * attention_chunk_size (with a sliding window
        too, the later of the two bounds).
      kv_chunk_pages: pages per chunk of the online softmax.
      query_block: query rows per block (static).
      rows_per_group: query rows (blocks x block rows) processed together (static); by default
        32 for one-row blocks, 256 for larger ones (padding rows past the last group cost nothing).
      kv_dtype: the cached values' dtype (a name, static): needed for a uint8 (float8) cache.
      sinks: if set, `[H]` float32 attention sinks (GPT-OSS): a learned logit per query head
        that joins the softmax denominator and attends to nothing, so a row's weights over its
        keys sum to less than one: `softmax([scores, sink])[:-1] @ v`.

    Returns:
      `[T, H, D]` in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_rows, num_pages, row_len = kv_cache.shape
    num_kv_heads = num_rows // 2
    page_size = row_len // head_dim
    num_seqs = jnp.reshape(num_seqs, ())
    block = query_block or (1 if num_tokens <= page_indices.shape[0] else 16)
    seq, tok, valid, position, used = query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens, block)
    rows_per_group = rows_per_group or (32 if block == 1 else 256)
    group_blocks = max(1, min(seq.shape[0], rows_per_group // block))
    if group_blocks < seq.shape[0]:
        # Furthest-reaching blocks first, so each group walks only about as far as its own rows.
        reach = jnp.max(jnp.where(valid, position, -1), axis=1)
        order = jnp.argsort(-reach, stable=True)
        seq, tok, valid, position = seq[order], tok[order], valid[order], position[order]
    num_groups = -(-seq.shape[0] // group_blocks)
    extra = num_groups * group_blocks - seq.shape[0]
    seq, tok, valid, position = (
        jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=c)
        for x, c in ((seq, 0), (tok, num_tokens), (valid, False), (position, 0))
    )
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attend = functools.partial(
        _attend_blocks,
        kv_cache.reshape(num_rows * num_pages, row_len),
        page_indices,
        num_pages=num_pages,
        page_size=page_size,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        attention_chunk_size=attention_chunk_size,
        chunk_pages=max(1, min(kv_chunk_pages, page_indices.shape[1])),
        kv_dtype=value_dtype(kv_cache.dtype, kv_dtype),
        sinks=None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, -1),
    )

    def one_group(g, rows_out):
        take = functools.partial(
            lax.dynamic_slice_in_dim, start_index=g * group_blocks, slice_size=group_blocks
        )
        blocks_tok = take(tok)
        qb = jnp.take(qg, blocks_tok, axis=0, mode="fill", fill_value=0)  # [N', B, K, G, D]
        out = attend(qb, take(seq), take(valid), take(position))  # [N', B, H, D]
        return rows_out.at[blocks_tok.reshape(-1)].set(out.reshape(-1, num_heads, head_dim))

    rows_out = jnp.zeros((num_tokens + 1, num_heads, head_dim), jnp.float32)
    rows_out = lax.fori_loop(0, (used + group_blocks - 1) // group_blocks, one_group, rows_out)
    return rows_out[:num_tokens].astype(q.dtype)


def _attend_blocks(
    flat_cache: jax.Array,
    page_indices: jax.Array,
    qb: jax.Array,
    seq: jax.Array,
    valid: jax.Array,
    position: jax.Array,
    *,
    num_pages: int,
    page_size: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    attention_chunk_size: int | None,
    chunk_pages: int,
    kv_dtype: jnp.dtype,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Online-softmax attention of query blocks `qb [N, B, K, G, D]` over their sequences' pages;
    `sinks [K, G]` (optional) start each row's softmax as one more column of that logit."""
    num_blocks, block, num_kv_heads, group, head_dim = qb.shape
    chunk_len = chunk_pages * page_size
    pages_per_seq = page_indices.shape[1]
    table = jnp.pad(
        page_indices, ((0, 0), (0, -(-pages_per_seq // chunk_pages) * chunk_pages - pages_per_seq))
    )
    qb = qb.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_blocks, block * group, head_dim)
    k_heads = jnp.arange(num_kv_heads)
    batch = ((0, 1), (0, 1))
    last = jnp.max(jnp.where(valid, position, -1))  # the furthest position any row looks at

    def chunk(c, carry):
        m, denom, acc = carry  # [K, N, B*G], [K, N, B*G], [K, N, B*G, D]
        pages = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)[seq].reshape(-1)
        pages = jnp.clip(pages, 0, num_pages - 1)
        k = _gather_rows(flat_cache, k_heads, pages, num_pages, kv_dtype).reshape(
            num_kv_heads, num_blocks, chunk_len, -1
        )
        v = _gather_rows(flat_cache, k_heads + num_kv_heads, pages, num_pages, kv_dtype)
        v = v.reshape(num_kv_heads, num_blocks, chunk_len, head_dim)
        scores = lax.dot_general(qb, k, (((3,), (3,)), batch)) * sm_scale  # [K, N, B*G, Lc]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        key_pos = c * chunk_len + jnp.arange(chunk_len)[None, None, :]  # [1, 1, Lc]
        visible = (key_pos <= position[:, :, None]) & valid[:, :, None]  # [N, B, Lc]
        if sliding_window is not None:
            visible &= key_pos > position[:, :, None] - sliding_window
        if attention_chunk_size is not None:
            visible &= key_pos >= (position[:, :, None] // attention_chunk_size) * attention_chunk_size
        visible = jnp.repeat(visible, group, axis=1)[None]  # [1, N, B*G, Lc]
        m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, MASK_VALUE), axis=3))
        p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)  # [K, N, B*G, Lc]
        alpha = jnp.exp(m - m_new)
        pv = lax.dot_general(p, v, (((3,), (2,)), batch))  # [K, N, B*G, D]
        return m_new, denom * alpha + jnp.sum(p, axis=3), acc * alpha[..., None] + pv

    shape = (num_kv_heads, num_blocks, block * group)
    if sinks is None:
        init = (jnp.full(shape, MASK_VALUE), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    else:  # the sink column already seen: running max the sink, its exp(0) = 1 in the sum
        m0 = jnp.broadcast_to(jnp.tile(sinks, (1, block))[:, None, :], shape)  # [K, N, B*G]
        init = (m0, jnp.ones(shape), jnp.zeros((*shape, head_dim)))
    _, denom, acc = lax.fori_loop(0, (last + chunk_len) // chunk_len, chunk, init)
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)  # [K, N, B*G, D]
    out = out.reshape(num_kv_heads, num_blocks, block, group, head_dim).transpose(1, 2, 0, 3, 4)
    return out.reshape(num_blocks, block, num_kv_heads * group, head_dim)
