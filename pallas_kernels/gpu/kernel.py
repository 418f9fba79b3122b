# SPDX-License-Identifier: Apache-2.0
"""Ragged paged attention as a Pallas GPU kernel, Triton lowering (mixed prefill and decode).

Shapes (T tokens, R sequence slots, P pages per sequence, S page size, K kv heads, G query heads
per kv head, H = K * G, D head dim, Dp = D padded to a power of two, Tq query rows per work
item, M = Tq * G rows padded to a power of two >= 16, Pb pages per KV block, Tk = Pb * S, W work
items, N KV splits):
  q `[T, H, D]`, kv_cache `[2, K, num_pages, S, Dp]` (layout.py), kv_lens `[R]`, page_indices
  `[R, P]`, cu_q_lens `[R + 1]`, num_seqs `[]` or `[1]`  ->  `[T, H, D]`.

Why Triton rather than Mosaic GPU: Triton lowering targets every CUDA GPU JAX supports (and ROCm),
while Mosaic GPU targets Hopper and newer only; on this CPU-only machine a Triton-style kernel
runs under `interpret=True` with any grid, whereas the Mosaic GPU interpreter is private and
takes a single block only; and `jax.export(platforms=["cuda"])` of a Triton kernel checks its
shapes (the power-of-two rule) without a GPU. The price: every tile has power-of-two dims, so
D, S, Pb and M are padded or constrained to powers of two.

Design (flash-decoding over a ragged batch):
* The wrapper cuts each sequence's query rows into work items of at most Tq rows, so a work
  item belongs to one sequence (a decode row is one item; a 100-row prefill chunk is
  cdiv(100, Tq) items). W = min(T, cdiv(T, Tq) + R) is a static bound; unused items are empty.
  A work item's rows are gathered into `[K, M, Dp]` (row r = token r // G, head r % G).
* grid = (W, K, N): a program attends one item's rows of one kv head over the N-th share of
  the KV blocks those rows can see (causal, sliding-window and attention-chunk bounds),
  gathering each block's Pb pages by block-table lookup, with an online softmax in registers. It writes its
  unnormalised output and its running max and sum; the wrapper merges the N splits (the
  flash-decoding reduction) and scatters rows back to token order. Splits give a decode batch
  R * K * N programs instead of R * K.
* Attention sinks (a logit per query head in the softmax denominator) join that merge as one
  more split of no keys: running max the sink, sum exp(0) = 1, output 0. The kernel is the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.checks import check_lanes, check_metadata, check_positive_option, compute_dtype
from pallas_kernels.gpu import tuned_block_sizes
from pallas_kernels.gpu.layout import padded_head_dim

MASK_VALUE = -1e30  # finite: exp(MASK_VALUE - MASK_VALUE) must not be NaN
META_WIDTH = 8  # int32 fields per work item (power of two): seq, first row, rows, first position
MIN_ROWS = 16  # tl.dot needs M >= 16


def _rpa_kernel(
    meta_ref,  # [META_WIDTH] this work item: seq, first token, number of rows, first position
    page_table_ref,  # [R, P_pad] block table, padded to whole KV blocks
    q_ref,  # [M, Dp] this item's rows for this kv head, pre-scaled by sm_scale
    kv_ref,  # [2, K, num_pages, S, Dp] the whole cache
    o_ref,  # [M, Dp] f32 unnormalised output of this split
    m_ref,  # [M] f32 running max
    l_ref,  # [M] f32 running sum
    *,
    group: int,
    block_q: int,
    pages_per_block: int,
    num_kv_splits: int,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
    attention_chunk_size: int | None = None,
    blocks_per_page: int = 1,
):
    num_rows_padded, lanes = q_ref.shape
    _, _, num_pages, page_size, _ = kv_ref.shape
    block_kv = pages_per_block * page_size // blocks_per_page
    head = pl.program_id(1)
    split = pl.program_id(2)
    seq, num_rows, first_pos = meta_ref[0], meta_ref[2], meta_ref[3]

    kv_hi = jnp.where(num_rows > 0, jnp.clip(first_pos + num_rows, 0, pages_per_seq * page_size), 0)
    kv_lo = jnp.int32(0)
    if sliding_window is not None:
        kv_lo = jnp.clip(first_pos - sliding_window + 1, 0, kv_hi)
    if attention_chunk_size is not None:  # the first row's chunk starts the visible keys
        kv_lo = jnp.clip(jnp.maximum(kv_lo, _chunk_start(first_pos, attention_chunk_size)), 0, kv_hi)
    blk_lo = kv_lo // block_kv
    blk_hi = pl.cdiv(kv_hi, block_kv)
    blocks_per_split = pl.cdiv(blk_hi - blk_lo, num_kv_splits)
    start = blk_lo + split * blocks_per_split
    stop = jnp.minimum(start + blocks_per_split, blk_hi)

    row = lax.broadcasted_iota(jnp.int32, (num_rows_padded,), 0)
    token = row // group
    row_ok = (row < block_q * group) & (token < num_rows)
    query_pos = first_pos + token  # [M]
    q = q_ref[...]

    def body(blk, carry):
        if blocks_per_page > 1:  # a slice of one page (pages larger than a tile)
            page = jnp.clip(page_table_ref[seq, blk // blocks_per_page], 0, num_pages - 1)
            rows = pl.ds(pl.multiple_of((blk % blocks_per_page) * block_kv, block_kv), block_kv)
            k = kv_ref[0, head, page, rows].astype(q.dtype)  # [Tk, Dp]
            v = kv_ref[1, head, page, rows].astype(q.dtype)
        else:
            pages = page_table_ref[seq, pl.ds(blk * pages_per_block, pages_per_block)]
            pages = jnp.clip(pages, 0, num_pages - 1)  # entries past the sequence may be garbage
            k = kv_ref[0, head, pages].reshape(block_kv, lanes).astype(q.dtype)  # [Tk, Dp]
            v = kv_ref[1, head, pages].reshape(block_kv, lanes).astype(q.dtype)
        key_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)  # [Tk]
        v = jnp.where(((key_pos >= kv_lo) & (key_pos < kv_hi))[:, None], v, jnp.zeros_like(v))
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = row_ok[:, None] & (key_pos[None, :] <= query_pos[:, None])  # [M, Tk]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        if attention_chunk_size is not None:
            visible &= key_pos[None, :] >= _chunk_start(query_pos, attention_chunk_size)[:, None]
        return online_softmax_step(scores, visible, v, carry)

    init = (
        jnp.full((num_rows_padded,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows_padded,), jnp.float32),
        jnp.zeros((num_rows_padded, lanes), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(start, stop, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def online_softmax_step(
    scores: jax.Array, visible: jax.Array, values: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax: `scores [M, Tk]` (float32) where `visible`, against
    `values [Tk, L]`, folded into the running max, sum and accumulator `carry` (`[M]`, `[M]`,
    `[M, L]`, float32)."""
    m_prev, l_prev, acc = carry
    scores = jnp.where(visible, scores, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    pv = lax.dot_general(
        p.astype(values.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_next, l_next, alpha[:, None] * acc + pv


def _chunk_start(position: jax.Array, chunk: int) -> jax.Array:
    """The first position of the attention chunk holding each `position` (clamped to 0 first)."""
    position = jnp.maximum(position, 0)
    return position // chunk * chunk


def _validate(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap):
    if q.ndim != 3 or kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"want q [T, H, D] and kv_cache [2, K, num_pages, S, Dp]; got {q.shape}, {kv_cache.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    _, num_kv_heads, _, page_size, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q's {num_heads} heads must be a multiple of kv_cache {kv_cache.shape}'s {num_kv_heads}"
        )
    check_lanes(kv_cache, head_dim, padded_head_dim(head_dim))
    if page_size & (page_size - 1):
        raise ValueError(f"kv_cache {kv_cache.shape}: page size {page_size} must be a power of two")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap)


def _row_sinks(sinks: jax.Array, num_kv_heads: int, group: int, num_rows_padded: int) -> jax.Array:
    """`[K, M]` the sink of each kernel row (row r holds query head r % G of its kv head)."""
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    return jnp.take(per_head, jnp.arange(num_rows_padded) % group, axis=1)


def plan_work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, block_q, num_work):
    """Work items `[W, META_WIDTH]`, and each token's flat output row (`[T]`) and validity."""
    num_slots = kv_lens.shape[0]
    live = jnp.arange(num_slots) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q  # work items per sequence
    first_block = jnp.cumsum(blocks) - blocks
    work = jnp.arange(num_work, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(first_block + blocks, work, side="right"), num_slots - 1)
    row_start = cu_q_lens[seq] + (work - first_block[seq]) * block_q
    q_end = cu_q_lens[seq + 1]
    num_rows = jnp.where(work < jnp.sum(blocks), jnp.clip(q_end - row_start, 0, block_q), 0)
    first_pos = kv_lens[seq] - (q_end - row_start)
    zeros = jnp.zeros_like(work)
    meta = jnp.stack([seq, row_start, num_rows, first_pos] + [zeros] * (META_WIDTH - 4), axis=1)

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    token_seq = jnp.minimum(jnp.searchsorted(ends, token, side="right"), num_slots - 1)
    local = token - cu_q_lens[token_seq]
    out_row = (first_block[token_seq] + local // block_q) * block_q + local % block_q
    valid = token < cu_q_lens[num_seqs]
    return meta.astype(jnp.int32), row_start, jnp.where(valid, out_row, 0), valid


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "attention_chunk_size",
        "interpret",
        "num_kv_pages_per_block",
        "num_queries_per_block",
        "num_kv_splits",
        "num_warps",
        "num_stages",
    ),
)
def ragged_paged_attention(
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
    interpret: bool = False,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = tuned_block_sizes.NUM_WARPS,
    num_stages: int = tuned_block_sizes.NUM_STAGES,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
) -> jax.Array:
    """Causal attention of ragged query rows over their sequences' paged KV (Pallas Triton).

    Args:
      q: `[T, H, D]`; sequence i owns rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      kv_cache: `[2, K, num_pages, S, Dp]` (layout.py), already holding these tokens' K/V.
      kv_lens: `[R]` int32 cached tokens per sequence, this step's included.
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths (non-decreasing).
      num_seqs: int32 `[]` or `[1]`; rows past `cu_q_lens[num_seqs]` are padding (zeros).
      sm_scale: softmax scale on q.k.
      sliding_window: a query at position p sees keys at positions > p - sliding_window.
      soft_cap: scores become `soft_cap * tanh(scores / soft_cap)`.
      interpret: False on a GPU; True to run the kernel on CPU (tests).
      num_kv_pages_per_block: pages per KV block, a power of two (default: tuned_block_sizes).
      num_queries_per_block: most query rows of one sequence per work item (Tq).
      num_kv_splits: programs sharing one work item's KV range (flash-decoding splits).
      num_warps, num_stages: Triton launch parameters.
      sinks: `[H]` float32 attention sinks, a logit per query head in every row's softmax
        denominator (optional).
      attention_chunk_size: chunked local attention, a query at position p sees keys at
        positions >= (p // attention_chunk_size) * attention_chunk_size (optional).

    Returns:
      `[T, H, D]` in q's dtype.
    """
    _validate(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap)
    check_positive_option("attention_chunk_size", attention_chunk_size)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, lanes = kv_cache.shape
    group = num_heads // num_kv_heads
    num_slots, pages_per_seq = page_indices.shape
    defaults = tuned_block_sizes.get_block_sizes(
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_tokens=num_tokens,
        max_num_seqs=num_slots,
        kv_row_bytes=lanes * jnp.dtype(kv_cache.dtype).itemsize,
    )
    pages_per_block = num_kv_pages_per_block or defaults[0]
    block_q = num_queries_per_block or defaults[1]
    splits = num_kv_splits or defaults[2]
    if pages_per_block <= 0 or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"num_kv_pages_per_block={pages_per_block} must be a power of two")
    if block_q <= 0 or splits <= 0:
        raise ValueError(f"num_queries_per_block={block_q} and num_kv_splits={splits} must be positive")
    blocks_per_page = 1
    if pages_per_block == 1:  # a page over one tile is read a slice at a time (hybrids' large pages)
        row_bytes = lanes * jnp.dtype(kv_cache.dtype).itemsize
        blocks_per_page = tuned_block_sizes.blocks_per_page(page_size=page_size, kv_row_bytes=row_bytes)
    num_rows_padded = max(MIN_ROWS, 1 << (block_q * group - 1).bit_length())
    num_work = min(num_tokens, pl.cdiv(num_tokens, block_q) + num_slots)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)

    meta, row_start, out_row, valid = plan_work_items(
        cu_q_lens, kv_lens, num_seqs, num_tokens, block_q, num_work
    )
    rows = jnp.clip(row_start[:, None] + jnp.arange(block_q), 0, num_tokens - 1)  # [W, Tq]
    qw = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype(kv_cache.dtype))[rows]  # [W, Tq, H, D]
    qw = qw.reshape(num_work, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qw = qw.reshape(num_work, num_kv_heads, block_q * group, head_dim)
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, num_rows_padded - block_q * group), (0, lanes - head_dim)))
    blocks_per_seq = pl.cdiv(pages_per_seq, pages_per_block)
    page_table = jnp.pad(page_indices, ((0, 0), (0, blocks_per_seq * pages_per_block - pages_per_seq)))

    part = (splits, num_work, num_kv_heads, num_rows_padded)
    o, m, l_sum = pl.pallas_call(
        functools.partial(
            _rpa_kernel,
            group=group,
            block_q=block_q,
            pages_per_block=pages_per_block,
            num_kv_splits=splits,
            pages_per_seq=pages_per_seq,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            attention_chunk_size=attention_chunk_size,
            blocks_per_page=blocks_per_page,
        ),
        grid=(num_work, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, META_WIDTH), lambda w, h, s: (w, 0)),
            pl.BlockSpec(page_table.shape, lambda w, h, s: (0, 0)),
            pl.BlockSpec((None, None, num_rows_padded, lanes), lambda w, h, s: (w, h, 0, 0)),
            pl.BlockSpec(kv_cache.shape, lambda w, h, s: (0, 0, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, num_rows_padded, lanes), lambda w, h, s: (s, w, h, 0, 0)),
            pl.BlockSpec((None, None, None, num_rows_padded), lambda w, h, s: (s, w, h, 0)),
            pl.BlockSpec((None, None, None, num_rows_padded), lambda w, h, s: (s, w, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, lanes), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(meta, page_table, qw, kv_cache)

    # Merge the KV splits: out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, where a sink is
    # one more split with m_s = sink, l_s = 1, acc_s = 0.
    m_max = jnp.max(m, axis=0)  # [W, K, M]
    if sinks is not None:
        row_sinks = _row_sinks(sinks, num_kv_heads, group, num_rows_padded)  # [K, M]
        m_max = jnp.maximum(m_max, row_sinks)
    weight = jnp.exp(m - m_max)  # [N, W, K, M]
    total = jnp.sum(weight * l_sum, axis=0)
    if sinks is not None:
        total = total + jnp.exp(row_sinks - m_max)
    out = jnp.sum(weight[..., None] * o, axis=0) / jnp.where(total == 0.0, 1.0, total)[..., None]
    out = out[:, :, : block_q * group, :head_dim].reshape(num_work, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_work * block_q, num_heads, head_dim)
    return jnp.where(valid[:, None, None], out[out_row], 0.0).astype(q.dtype)
