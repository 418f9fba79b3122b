# SPDX-License-Identifier: Apache-2.0
"""Ragged paged attention as a Mosaic TPU Pallas kernel (mixed prefill and decode in one call).

Shapes (T tokens, R sequence slots, P pages per sequence, S page size, K kv heads, G query heads
per kv head, H = K * G query heads, D head dim, Dp = D padded to 128, Tq query rows per block,
Pb pages per KV block, Tk = Pb * S keys per KV block):
  q `[T, H, D]`, kv_cache `[num_pages, 2K, S, Dp]` (layout.py), kv_lens `[R]`, page_indices
  `[R, P]`, cu_q_lens `[R + 1]`, num_seqs `[]` or `[1]`  ->  `[T, H, D]`.

Design:
* grid = (cdiv(T, Tq),): one step per block of Tq consecutive query rows, all heads. A step
  carries no state to the next, so the axis is "parallel" (megacore may split it).
* Scalar prefetch (SMEM): kv_lens, the block table flattened to 1D `[R * P]` (a 2D SMEM array
  pads every row to a tile), cu_q_lens, and the first/last sequence owning rows of each query
  block (computed in the wrapper with jnp).
* In a step, for each sequence s with rows in the block and each KV block j those rows can see
  (causal, sliding-window and attention-chunk bounds), the pages of j are DMA'd from HBM (`memory_space=ANY`)
  into one of two VMEM buffers. The next block (possibly the next sequence's first) is started
  before the current one is waited on: double buffering across the whole step. Pages past the
  rows' last visible key are not fetched; their stale buffer rows are masked (V zeroed, since
  0 * NaN is NaN).
* Online softmax per kv head over the Tq * G rows (q pre-scaled by sm_scale, laid out
  `[K, G, Tq, Dp]` by the wrapper so a head's rows are one `[G * Tq, Dp]` matrix): running max m
  and sum l lane-replicated to 128 in VMEM, unnormalised accumulator `[G * Tq, Dp]` in f32.
  Rows of other sequences, future keys and keys outside the window get probability 0, so each
  row only ever accumulates its own sequence's visible keys; rows no sequence owns end with
  l = 0 and are written as zeros.
* Attention sinks (a logit per query head in the softmax denominator; scalar prefetch) start
  each row's softmax as a column already seen: m = sink, l = exp(0) = 1. Rows no sequence owns
  then end with l = 1 and acc = 0: still zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.checks import check_lanes, check_metadata, check_positive_option, compute_dtype
from pallas_kernels.tpu import tuned_block_sizes
from pallas_kernels.tpu.layout import LANES, padded_head_dim, sublane_tile

MASK_VALUE = -1e30  # finite: exp(MASK_VALUE - MASK_VALUE) must not be NaN


def cdiv(a: jax.Array, b: int) -> jax.Array:
    """Ceil division of a non-negative int32 scalar (lax.div: `//` lowers through `sign`)."""
    return lax.div(a + (b - 1), jnp.int32(b))


def _lanes_to(x: jax.Array, width: int) -> jax.Array:
    """A lane-replicated `[N, 128]` value widened to `[N, width]` (width a multiple of 128)."""
    return x if width == LANES else jnp.concatenate([x] * (width // LANES), axis=1)


def _start_from_sinks(sinks_ref, m_ref, l_ref, *, group: int, block_q: int) -> None:
    """Every row's softmax state as if its head's sink column were already seen: m = sink, l = 1."""

    def head(h, carry):
        for g in range(group):  # rows g * Tq .. (g + 1) * Tq - 1 hold query head h * G + g
            rows = pl.ds(g * block_q, block_q)
            m_ref[h, rows, :] = jnp.full((block_q, LANES), sinks_ref[h * group + g], jnp.float32)
            l_ref[h, rows, :] = jnp.ones((block_q, LANES), jnp.float32)
        return carry

    lax.fori_loop(0, m_ref.shape[0], head, 0)


def _rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [R]
    page_table_ref,  # [R * P], the block table flattened
    cu_q_lens_ref,  # [R + 1]
    seq_range_ref,  # [2 * num_q_blocks]: first and last sequence of each query block
    sinks_ref,  # [H] f32 attention sinks (zeros, unread, without them)
    # inputs
    q_ref,  # [K, G, Tq, Dp] VMEM block, pre-scaled by sm_scale
    kv_hbm_ref,  # [num_pages, 2K, S, Dp] in HBM
    # output
    o_ref,  # [K, G, Tq, Dp]
    # scratch
    kv_buf,  # [2, Pb, 2K, S, Dp] VMEM, double buffer
    sems,  # DMA semaphores [2], one per buffer slot
    m_ref,  # [K, G * Tq, 128] f32 running max (lane-replicated)
    l_ref,  # [K, G * Tq, 128] f32 running sum (lane-replicated)
    acc_ref,  # [K, G * Tq, Dp] f32 unnormalised output
    *,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    attention_chunk_size: int | None = None,
):
    num_kv_heads, group, block_q, lanes = q_ref.shape
    _, pages_per_block, _, page_size, _ = kv_buf.shape
    block_kv = pages_per_block * page_size
    num_rows = group * block_q
    q_block = pl.program_id(0)
    block_start = q_block * block_q  # token index of the block's first row
    block_end = block_start + block_q
    first_seq = seq_range_ref[2 * q_block]
    last_seq = seq_range_ref[2 * q_block + 1]

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    if has_sinks:
        _start_from_sinks(sinks_ref, m_ref, l_ref, group=group, block_q=block_q)

    def seq_bounds(s):
        """Rows [row_lo, row_hi) of s in this block; keys [kv_lo, kv_hi) they see; KV blocks."""
        q_end = cu_q_lens_ref[s + 1]
        row_lo = jnp.maximum(cu_q_lens_ref[s], block_start)
        row_hi = jnp.minimum(q_end, block_end)
        has_rows = row_hi > row_lo
        offset = kv_lens_ref[s] - q_end  # key position of a row = token index + offset
        kv_hi = jnp.where(has_rows, jnp.clip(row_hi + offset, 0, pages_per_seq * page_size), 0)
        kv_lo = jnp.int32(0)
        first_key = _first_visible_key(row_lo + offset, sliding_window, attention_chunk_size)
        if first_key is not None:  # the first row's bound holds for the later rows too
            kv_lo = jnp.where(has_rows, jnp.clip(first_key, 0, kv_hi), 0)
        blk_lo = lax.div(kv_lo, jnp.int32(block_kv))
        num_blocks = jnp.maximum(cdiv(kv_hi, block_kv) - blk_lo, 1)  # >= 1 keeps the loop simple
        return row_lo, row_hi, offset, kv_lo, kv_hi, blk_lo, num_blocks

    def for_each_page_copy(s, blk, slot, kv_lo, kv_hi, action):
        """Applies `action` ("start"/"wait") to the DMAs of block `blk` of sequence s into `slot`."""
        page_lo = lax.div(kv_lo, jnp.int32(page_size))
        page_hi = cdiv(kv_hi, page_size)

        def page_body(i, carry):
            page_in_seq = blk * pages_per_block + i

            @pl.when((page_in_seq >= page_lo) & (page_in_seq < page_hi))
            def _():
                page = page_table_ref[s * pages_per_seq + page_in_seq]
                copy = pltpu.make_async_copy(kv_hbm_ref.at[page], kv_buf.at[slot, i], sems.at[slot])
                getattr(copy, action)()

            return carry

        lax.fori_loop(0, pages_per_block, page_body, 0)

    def attend(slot, blk, row_lo, row_hi, offset, kv_lo, kv_hi):
        """Online-softmax update of every head's rows with one KV block held in `slot`."""
        key_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (num_rows, block_kv), 1)
        token = block_start + lax.rem(lax.broadcasted_iota(jnp.int32, (num_rows, block_kv), 0), block_q)
        query_pos = token + offset
        visible = (token >= row_lo) & (token < row_hi) & (key_pos <= query_pos)
        first_key = _first_visible_key(query_pos, sliding_window, attention_chunk_size)
        if first_key is not None:
            visible &= key_pos >= first_key
        value_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, lanes), 0)
        fetched = (value_pos >= kv_lo) & (value_pos < kv_hi)  # other rows may be stale or NaN

        def head_body(h, carry):
            q = q_ref[h].reshape(num_rows, lanes)  # [G * Tq, Dp]
            k = kv_buf[slot, :, 2 * h].reshape(block_kv, lanes).astype(q.dtype)  # [Tk, Dp]
            v = kv_buf[slot, :, 2 * h + 1].reshape(block_kv, lanes).astype(q.dtype)
            v = jnp.where(fetched, v, jnp.zeros_like(v))
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            scores = jnp.where(visible, scores, MASK_VALUE)  # [G * Tq, Tk]
            m_cur = jnp.max(scores, axis=1, keepdims=True)  # [G * Tq, 1]
            p = jnp.where(visible, jnp.exp(scores - m_cur), 0.0)
            l_cur = jnp.sum(p, axis=1, keepdims=True)
            m_prev = m_ref[h]  # [G * Tq, 128]
            m_next = jnp.maximum(m_prev, m_cur)
            alpha = jnp.exp(m_prev - m_next)  # rescales the old state
            beta = jnp.exp(m_cur - m_next)  # rescales this block
            m_ref[h] = m_next
            l_ref[h] = alpha * l_ref[h] + beta * l_cur
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [G * Tq, Dp]
            acc_ref[h] = _lanes_to(alpha, lanes) * acc_ref[h] + _lanes_to(beta, lanes) * pv
            return carry

        lax.fori_loop(0, num_kv_heads, head_body, 0)

    def seq_body(s, slot):
        row_lo, row_hi, offset, kv_lo, kv_hi, blk_lo, num_blocks = seq_bounds(s)

        def block_body(b, slot):
            blk = blk_lo + b
            next_slot = 1 - slot

            @pl.when(b + 1 < num_blocks)
            def _prefetch_same_seq():
                for_each_page_copy(s, blk + 1, next_slot, kv_lo, kv_hi, "start")

            @pl.when((b + 1 == num_blocks) & (s < last_seq))
            def _prefetch_next_seq():
                _, _, _, n_kv_lo, n_kv_hi, n_blk_lo, _ = seq_bounds(s + 1)
                for_each_page_copy(s + 1, n_blk_lo, next_slot, n_kv_lo, n_kv_hi, "start")

            for_each_page_copy(s, blk, slot, kv_lo, kv_hi, "wait")
            attend(slot, blk, row_lo, row_hi, offset, kv_lo, kv_hi)
            return next_slot

        return lax.fori_loop(0, num_blocks, block_body, slot)

    @pl.when(first_seq <= last_seq)
    def _():
        _, _, _, kv_lo, kv_hi, blk_lo, _ = seq_bounds(first_seq)
        for_each_page_copy(first_seq, blk_lo, 0, kv_lo, kv_hi, "start")
        lax.fori_loop(first_seq, last_seq + 1, seq_body, jnp.int32(0))

    def finish_head(h, carry):
        l_sum = _lanes_to(l_ref[h], lanes)
        out = acc_ref[h] / jnp.where(l_sum == 0.0, 1.0, l_sum)  # rows nobody owns: 0 / 1
        o_ref[h] = out.reshape(group, block_q, lanes).astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, num_kv_heads, finish_head, 0)


def _first_visible_key(
    position: jax.Array, sliding_window: int | None, attention_chunk_size: int | None
) -> jax.Array | None:
    """The first key position a query at `position` sees: past its sliding window, and in its
    own attention chunk (`position - position % chunk`, of a position clamped to 0); None when
    every earlier key is visible."""
    first = None
    if sliding_window is not None:
        first = position - (sliding_window - 1)
    if attention_chunk_size is not None:
        clamped = jnp.maximum(position, 0)
        chunk_start = clamped - lax.rem(clamped, jnp.int32(attention_chunk_size))
        first = chunk_start if first is None else jnp.maximum(first, chunk_start)
    return first


def _validate(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap):
    if q.ndim != 3 or kv_cache.ndim != 4:
        raise ValueError(
            f"want q [T, H, D] and kv_cache [num_pages, 2K, S, Dp]; got {q.shape}, {kv_cache.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    _, num_rows, page_size, _ = kv_cache.shape
    if num_rows % 2 or num_heads % (num_rows // 2):
        raise ValueError(f"kv_cache {kv_cache.shape}: 2K must be even and divide into q's {num_heads} heads")
    check_lanes(kv_cache, head_dim, padded_head_dim(head_dim))
    tile = sublane_tile(kv_cache.dtype)
    if page_size % tile:
        raise ValueError(f"page size {page_size} must be a multiple of {tile} for {kv_cache.dtype}")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap)


def query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q):
    """`[2 * num_q_blocks]`: first and last sequence owning rows of each query block (-1 if none)."""
    num_slots = cu_q_lens.shape[0] - 1
    ends = jnp.where(jnp.arange(num_slots) < num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    total = cu_q_lens[num_seqs]
    first_row = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    last_row = jnp.minimum(first_row + block_q, total) - 1
    first = jnp.searchsorted(ends, first_row, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, last_row, side="right").astype(jnp.int32)
    empty = first_row >= total
    return jnp.stack([jnp.where(empty, 0, first), jnp.where(empty, -1, last)], axis=1).reshape(-1)


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
        "vmem_limit_bytes",
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
    interpret: bool | pltpu.InterpretParams = False,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
) -> jax.Array:
    """Causal attention of ragged query rows over their sequences' paged KV (Mosaic TPU).

    Args:
      q: `[T, H, D]`; sequence i owns rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      kv_cache: `[num_pages, 2K, S, Dp]` (layout.py), already holding these tokens' K/V.
      kv_lens: `[R]` int32 cached tokens per sequence, this step's included.
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths (non-decreasing).
      num_seqs: int32 `[]` or `[1]`; rows past `cu_q_lens[num_seqs]` are padding (zeros).
      sm_scale: softmax scale on q.k.
      sliding_window: a query at position p sees keys at positions > p - sliding_window.
      soft_cap: scores become `soft_cap * tanh(scores / soft_cap)`.
      interpret: False on TPU; True or `pltpu.InterpretParams(...)` to run on CPU (tests).
      num_kv_pages_per_block: pages per DMA'd KV block (default: tuned_block_sizes).
      num_queries_per_block: query rows per grid step, a multiple of the dtype's sublane tile.
      vmem_limit_bytes: Mosaic scoped-VMEM limit (default: raised only when the estimate needs).
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
    _, num_rows, page_size, lanes = kv_cache.shape
    num_kv_heads = num_rows // 2
    group = num_heads // num_kv_heads
    num_slots, pages_per_seq = page_indices.shape
    tile = max(sublane_tile(q.dtype), sublane_tile(kv_cache.dtype))
    default_pages, default_queries = tuned_block_sizes.get_block_sizes(
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_tokens=num_tokens,
        max_num_seqs=num_slots,
        sublane_tile=tile,
    )
    pages_per_block = num_kv_pages_per_block or default_pages
    block_q = num_queries_per_block or default_queries
    if not 0 < pages_per_block <= pages_per_seq:
        raise ValueError(f"num_kv_pages_per_block={pages_per_block} must be in [1, P={pages_per_seq}]")
    if block_q <= 0 or block_q % tile:
        raise ValueError(f"num_queries_per_block={block_q} must be a positive multiple of {tile}")
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)

    # q -> [K, G, T_pad, Dp], pre-scaled, in the MXU operand type (the cache's; bfloat16 for float8).
    qk = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype(kv_cache.dtype))
    qk = qk.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, num_q_blocks * block_q - num_tokens), (0, lanes - head_dim)))

    itemsize = jnp.dtype(kv_cache.dtype).itemsize
    block_bytes = num_heads * block_q * lanes * itemsize  # one q (or out) block
    kv_buf_bytes = 2 * pages_per_block * num_rows * page_size * lanes * itemsize
    state_bytes = num_heads * block_q * (2 * LANES + lanes) * 4
    vmem_estimate = 4 * block_bytes + kv_buf_bytes + state_bytes  # q, out double-buffered
    if vmem_limit_bytes is None and vmem_estimate > tuned_block_sizes.DEFAULT_SCOPED_VMEM_BYTES * 3 // 4:
        vmem_limit_bytes = vmem_estimate * 3 // 2

    q_spec = pl.BlockSpec((num_kv_heads, group, block_q, lanes), lambda i, *_: (0, 0, i, 0))
    out = pl.pallas_call(
        functools.partial(
            _rpa_kernel,
            pages_per_seq=pages_per_seq,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            has_sinks=sinks is not None,
            attention_chunk_size=attention_chunk_size,
        ),
        out_shape=jax.ShapeDtypeStruct(qk.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block, num_rows, page_size, lanes), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv_heads, group * block_q, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, group * block_q, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, group * block_q, lanes), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        kv_lens,
        page_indices.reshape(-1),
        cu_q_lens,
        query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q),
        jnp.zeros((num_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        qk,
        kv_cache,
    )
    out = out[:, :, :num_tokens, :head_dim].transpose(2, 0, 1, 3)  # [T, K, G, D]
    return out.reshape(num_tokens, num_heads, head_dim)
