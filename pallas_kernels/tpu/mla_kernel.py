# SPDX-License-Identifier: Apache-2.0
"""Paged multi-head latent attention (MLA) as a Mosaic TPU Pallas kernel: its latent cache layout,
the latent write and the ragged attention over it (prefill chunks and decodes mixed).

Shapes (T tokens, R sequence slots, P pages per sequence, S page size, H query heads, Hp = H
rounded up to the sublane tile, L latent width, C = L + rope width, Cp = C rounded up to 128,
Lp = L rounded up to 128, Tq query tokens per block, Pb pages per KV block, Tk = Pb * S):
  q `[T, H, C]` (absorbed: `[W_UK q_nope | q_rope]`), cache `[num_pages, S, Cp]`, kv_lens `[R]`,
  page_indices `[R, P]`, cu_q_lens `[R + 1]`, num_seqs `[]` or `[1]`  ->  `[T, H, L]`.

Layout (a layer's; several layers stack along the page axis, as in api.py): `[num_pages, S, Cp]`
in the cache dtype, row `[c_kv | k_rope | 0]`. Why:
* One page is one contiguous `[S, Cp]` slab: one DMA per page brings every head's keys and
  values (they are the same rows), and the slab is a whole number of `(8|16|32, 128)` tiles.
* The minor dim is padded to 128 lanes because a TPU array's minor dim is stored in 128-lane
  tiles anyway (an `[.., S, 576]` array occupies 640 lanes a row in HBM too), and the kernel
  then takes scores with one `Cp`-wide contraction and values as the tile-aligned first `Lp`
  lanes. The price: DeepSeek's 576 values a token become 640 (+11%) on TPU.

Kernel design (the discipline of kernel.py, with one shared "kv head"):
* grid = (cdiv(T, Tq),): one step per block of Tq consecutive tokens, all heads; steps carry no
  state, so the axis is "parallel". A block's rows are `Tq * Hp` (token-major), one matrix: a
  decode step (Tq = 1) gives each token's heads an MXU tile of their own.
* Scalar prefetch (SMEM): kv_lens, the flattened block table, cu_q_lens, each block's first and
  last sequence. For each sequence with tokens in the block and each KV block those tokens can
  see (causal), the pages are DMA'd from HBM into one of two VMEM buffers, the next block
  (possibly the next sequence's first) started before the current one is waited on.
* Online softmax over the rows: scores `q . row` over all Cp lanes (zeros past C), values the
  first Lp lanes of the same rows (lanes L..Lp are rope values, cut by the wrapper); running
  max and sum lane-replicated to 128, a float32 `[Tq * Hp, Lp]` accumulator. Rows of other
  sequences and future keys get probability 0; rows no sequence owns end as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.checks import check_metadata, check_positive, compute_dtype
from pallas_kernels.reference import saturating_cast
from pallas_kernels.tpu.kernel import cdiv, query_block_seq_ranges
from pallas_kernels.tpu.kv_write import write_rows
from pallas_kernels.tpu.layout import LANES, padded_head_dim, sublane_tile

MASK_VALUE = -1e30  # finite: exp(MASK_VALUE - MASK_VALUE) must not be NaN
ROWS_PER_BLOCK = 512  # query rows (tokens x heads) per grid step outside decode steps
TOKENS_PER_KV_BLOCK = 256  # keys per DMA round, as the ragged kernel's (tuned_block_sizes.py)
DEFAULT_SCOPED_VMEM_BYTES = 16 * 1024 * 1024  # v5e's default; below 3/4 of it the limit stays


def allocate_latent_cache(num_pages: int, page_size: int, width: int, dtype: jnp.dtype) -> jax.Array:
    """A zeroed `[num_pages, S, Cp]` latent cache for rows of `width` (C) values of `dtype`."""
    check_positive(num_pages=num_pages, page_size=page_size, width=width)
    return jnp.zeros((num_pages, page_size, padded_head_dim(width)), dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_latent(
    cache: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    slot_mapping: jax.Array,
    *,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Writes the rows `[latent | k_rope | 0]` (`[T, L]`, `[T, R]`) at `slot_mapping[T]` (page * S
    + offset) of `[num_pages, S, Cp]`; negative slots write nothing, slots must be distinct.

    By DMA'd tiles, as the KV write (kv_write.py, whose engine this is): an XLA scatter gets a
    layout of its own for the cache (for 8-bit values it differs from the kernel's), and the
    compiled step would then convert the whole cache around every write. The cache is updated
    in place when the caller's jit donates it. `interpret` as in `mla_paged_attention`.
    """
    width = latent.shape[1] + k_rope.shape[1]
    if cache.ndim != 3 or cache.shape[2] != padded_head_dim(width):
        raise ValueError(
            f"latent cache {cache.shape} does not hold rows of {width} values: expected "
            f"[num_pages, S, {padded_head_dim(width)}]"
        )
    if slot_mapping.shape != (latent.shape[0],) or k_rope.shape[0] != latent.shape[0]:
        raise ValueError(
            f"want latent [T, L], k_rope [T, R], slot_mapping [T]; got {latent.shape}, "
            f"{k_rope.shape}, {slot_mapping.shape}"
        )
    num_pages, page_size, lanes = cache.shape
    rows = jnp.concatenate([latent, k_rope], axis=1)
    rows = saturating_cast(jnp.pad(rows, ((0, 0), (0, lanes - width))), cache.dtype)  # [T, Cp]
    slabs = cache.reshape(num_pages, 1, page_size, lanes)  # one slab a page (a bitcast)
    slabs = write_rows(slabs, rows[:, None, :], slot_mapping, interpret=interpret)
    return slabs.reshape(cache.shape)


def _mla_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [R]
    page_table_ref,  # [R * P], the block table flattened
    cu_q_lens_ref,  # [R + 1]
    seq_range_ref,  # [2 * num_q_blocks]: first and last sequence of each query block
    # inputs
    q_ref,  # [Tq, Hp, Cp] VMEM block, pre-scaled by sm_scale
    cache_hbm_ref,  # [num_pages, S, Cp] in HBM
    # output
    o_ref,  # [Tq, Hp, Lp]
    # scratch
    kv_buf,  # [2, Pb, S, Cp] VMEM, double buffer
    sems,  # DMA semaphores [2], one per buffer slot
    m_ref,  # [Tq * Hp, 128] f32 running max (lane-replicated)
    l_ref,  # [Tq * Hp, 128] f32 running sum (lane-replicated)
    acc_ref,  # [Tq * Hp, Lp] f32 unnormalised output
    *,
    pages_per_seq: int,
):
    block_q, num_heads, lanes = q_ref.shape
    value_lanes = o_ref.shape[2]
    _, pages_per_block, page_size, _ = kv_buf.shape
    block_kv = pages_per_block * page_size
    num_rows = block_q * num_heads
    q_block = pl.program_id(0)
    block_start = q_block * block_q  # token index of the block's first row
    first_seq = seq_range_ref[2 * q_block]
    last_seq = seq_range_ref[2 * q_block + 1]

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_bounds(s):
        """Tokens [row_lo, row_hi) of s in this block, the keys [0, kv_hi) they see, KV blocks."""
        q_end = cu_q_lens_ref[s + 1]
        row_lo = jnp.maximum(cu_q_lens_ref[s], block_start)
        row_hi = jnp.minimum(q_end, block_start + block_q)
        offset = kv_lens_ref[s] - q_end  # key position of a token = token index + offset
        kv_hi = jnp.where(row_hi > row_lo, jnp.clip(row_hi + offset, 0, pages_per_seq * page_size), 0)
        num_blocks = jnp.maximum(cdiv(kv_hi, block_kv), 1)  # >= 1 keeps the loop simple
        return row_lo, row_hi, offset, kv_hi, num_blocks

    def for_each_page_copy(s, blk, slot, kv_hi, action):
        """Applies `action` ("start"/"wait") to the DMAs of block `blk` of sequence s into `slot`."""
        page_hi = cdiv(kv_hi, page_size)

        def page_body(i, carry):
            page_in_seq = blk * pages_per_block + i

            @pl.when(page_in_seq < page_hi)
            def _():
                page = page_table_ref[s * pages_per_seq + page_in_seq]
                copy = pltpu.make_async_copy(cache_hbm_ref.at[page], kv_buf.at[slot, i], sems.at[slot])
                getattr(copy, action)()

            return carry

        lax.fori_loop(0, pages_per_block, page_body, 0)

    def attend(slot, blk, row_lo, row_hi, offset, kv_hi):
        """Online-softmax update of every row with one KV block held in `slot`."""
        key_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (num_rows, block_kv), 1)
        token = block_start + lax.div(lax.broadcasted_iota(jnp.int32, (num_rows, block_kv), 0), num_heads)
        visible = (token >= row_lo) & (token < row_hi) & (key_pos <= token + offset)
        value_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, value_lanes), 0)
        q = q_ref[...].reshape(num_rows, lanes)  # [Tq * Hp, Cp]
        kv = kv_buf[slot].reshape(block_kv, lanes).astype(q.dtype)  # [Tk, Cp]
        v = kv[:, :value_lanes]
        v = jnp.where(value_pos < kv_hi, v, jnp.zeros_like(v))  # unfetched rows may be stale or NaN
        scores = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scores = jnp.where(visible, scores, MASK_VALUE)  # [Tq * Hp, Tk]
        m_cur = jnp.max(scores, axis=1, keepdims=True)  # [Tq * Hp, 1]
        p = jnp.where(visible, jnp.exp(scores - m_cur), 0.0)
        l_cur = jnp.sum(p, axis=1, keepdims=True)
        m_prev = m_ref[...]  # [Tq * Hp, 128]
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)  # rescales the old state
        beta = jnp.exp(m_cur - m_next)  # rescales this block
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + beta * l_cur
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [Tq * Hp, Lp]
        acc_ref[...] = _lanes_to(alpha, value_lanes) * acc_ref[...] + _lanes_to(beta, value_lanes) * pv

    def seq_body(s, slot):
        row_lo, row_hi, offset, kv_hi, num_blocks = seq_bounds(s)

        def block_body(blk, slot):
            next_slot = 1 - slot

            @pl.when(blk + 1 < num_blocks)
            def _prefetch_same_seq():
                for_each_page_copy(s, blk + 1, next_slot, kv_hi, "start")

            @pl.when((blk + 1 == num_blocks) & (s < last_seq))
            def _prefetch_next_seq():
                _, _, _, next_kv_hi, _ = seq_bounds(s + 1)
                for_each_page_copy(s + 1, 0, next_slot, next_kv_hi, "start")

            for_each_page_copy(s, blk, slot, kv_hi, "wait")
            attend(slot, blk, row_lo, row_hi, offset, kv_hi)
            return next_slot

        return lax.fori_loop(0, num_blocks, block_body, slot)

    @pl.when(first_seq <= last_seq)
    def _():
        _, _, _, kv_hi, _ = seq_bounds(first_seq)
        for_each_page_copy(first_seq, 0, 0, kv_hi, "start")
        lax.fori_loop(first_seq, last_seq + 1, seq_body, jnp.int32(0))

    l_sum = _lanes_to(l_ref[...], value_lanes)
    out = acc_ref[...] / jnp.where(l_sum == 0.0, 1.0, l_sum)  # rows nobody owns: 0 / 1
    o_ref[...] = out.reshape(block_q, num_heads, value_lanes).astype(o_ref.dtype)


def _lanes_to(x: jax.Array, width: int) -> jax.Array:
    """A lane-replicated `[N, 128]` value widened to `[N, width]` (width a multiple of 128)."""
    return x if width == LANES else jnp.concatenate([x] * (width // LANES), axis=1)


def _validate(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, latent_dim):
    if q.ndim != 3 or cache.ndim != 3:
        raise ValueError(f"want q [T, H, C] and cache [num_pages, S, Cp]; got {q.shape}, {cache.shape}")
    width = q.shape[2]
    if not 0 < latent_dim < width:
        raise ValueError(f"latent_dim {latent_dim} must leave a rope part in q's rows of {width}")
    if cache.shape[2] != padded_head_dim(width):
        raise ValueError(f"cache {cache.shape} last dim must be {padded_head_dim(width)} for rows of {width}")
    tile = sublane_tile(cache.dtype)
    if cache.shape[1] % tile:
        raise ValueError(f"page size {cache.shape[1]} must be a multiple of {tile} for {cache.dtype}")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, None, None)


def default_block_sizes(
    *, page_size: int, pages_per_seq: int, num_tokens: int, max_num_seqs: int, num_heads: int
) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block): about 256 keys a DMA round; one token a
    block in a decode step (its heads fill the rows), else about 512 rows (tokens x heads): each
    grid step DMAs its sequences' visible pages once, so a prefill's KV traffic falls as a block
    takes more of its tokens.
    First guesses from the kernel's cost model, not measured on a TPU."""
    pages = max(1, min(TOKENS_PER_KV_BLOCK // page_size, pages_per_seq))
    if num_tokens <= max_num_seqs:
        return pages, 1
    return pages, max(1, min(ROWS_PER_BLOCK // num_heads, num_tokens))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "latent_dim",
        "interpret",
        "num_kv_pages_per_block",
        "num_queries_per_block",
        "vmem_limit_bytes",
    ),
)
def mla_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    latent_dim: int,
    interpret: bool | pltpu.InterpretParams = False,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Causal latent attention of ragged absorbed queries over their sequences' paged latent rows.

    Args:
      q: `[T, H, C]` `[W_UK q_nope | q_rope]` per head; sequence i owns rows
        `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      cache: `[num_pages, S, Cp]` (module docstring), already holding these tokens' rows.
      kv_lens: `[R]` int32 cached tokens per sequence, this step's included.
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths (non-decreasing).
      num_seqs: int32 `[]` or `[1]`; rows past `cu_q_lens[num_seqs]` are padding (zeros).
      sm_scale: softmax scale on `q . row`.
      latent_dim: L, the values' width (the first L values of each row).
      interpret: False on TPU; True or `pltpu.InterpretParams(...)` to run on CPU (tests).
      num_kv_pages_per_block: pages per DMA'd KV block (default: `default_block_sizes`).
      num_queries_per_block: query tokens per grid step (Tq; each brings its H heads' rows).
      vmem_limit_bytes: Mosaic scoped-VMEM limit (default: raised only when the estimate needs).

    Returns:
      `[T, H, L]` in q's dtype: each head's attention-weighted latent.
    """
    _validate(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, latent_dim)
    num_tokens, num_heads, width = q.shape
    _, page_size, lanes = cache.shape
    num_slots, pages_per_seq = page_indices.shape
    operand = compute_dtype(cache.dtype)
    tile = max(sublane_tile(operand), sublane_tile(q.dtype))
    heads = -(-num_heads // tile) * tile  # Hp: a block's rows reshape without crossing tiles
    default_pages, default_queries = default_block_sizes(
        page_size=page_size, pages_per_seq=pages_per_seq, num_tokens=num_tokens,
        max_num_seqs=num_slots, num_heads=heads,
    )  # fmt: skip
    pages_per_block = num_kv_pages_per_block or default_pages
    block_q = num_queries_per_block or default_queries
    if not 0 < pages_per_block <= pages_per_seq:
        raise ValueError(f"num_kv_pages_per_block={pages_per_block} must be in [1, P={pages_per_seq}]")
    if block_q <= 0:
        raise ValueError(f"num_queries_per_block={block_q} must be positive")
    value_lanes = padded_head_dim(latent_dim)
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)

    # q -> [T_pad, Hp, Cp], pre-scaled, in the MXU operand type (the cache's; bfloat16 for float8).
    qk = (q.astype(jnp.float32) * sm_scale).astype(operand)
    qk = jnp.pad(qk, ((0, num_q_blocks * block_q - num_tokens), (0, heads - num_heads), (0, lanes - width)))

    num_rows = block_q * heads
    block_kv = pages_per_block * page_size
    io_bytes = num_rows * (lanes * jnp.dtype(operand).itemsize + value_lanes * q.dtype.itemsize)
    kv_buf_bytes = 2 * block_kv * lanes * cache.dtype.itemsize
    state_bytes = num_rows * (2 * LANES + value_lanes) * 4
    work_bytes = 3 * num_rows * block_kv * 4 + block_kv * lanes * jnp.dtype(operand).itemsize
    vmem_estimate = 2 * io_bytes + kv_buf_bytes + state_bytes + work_bytes  # q, out double-buffered
    if vmem_limit_bytes is None and vmem_estimate > DEFAULT_SCOPED_VMEM_BYTES * 3 // 4:
        vmem_limit_bytes = vmem_estimate * 3 // 2

    out = pl.pallas_call(
        functools.partial(_mla_kernel, pages_per_seq=pages_per_seq),
        out_shape=jax.ShapeDtypeStruct((num_q_blocks * block_q, heads, value_lanes), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_q_blocks,),
            in_specs=[
                pl.BlockSpec((block_q, heads, lanes), lambda i, *_: (i, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((block_q, heads, value_lanes), lambda i, *_: (i, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block, page_size, lanes), cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_rows, LANES), jnp.float32),
                pltpu.VMEM((num_rows, LANES), jnp.float32),
                pltpu.VMEM((num_rows, value_lanes), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="mla_paged_attention_tpu",
    )(
        kv_lens,
        page_indices.reshape(-1),
        cu_q_lens,
        query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q),
        qk,
        cache,
    )
    return out[:num_tokens, :num_heads, :latent_dim]
