# SPDX-License-Identifier: Apache-2.0
"""Paged multi-head latent attention (MLA) as a Pallas GPU kernel (Triton lowering): its latent
cache layout, the latent write and the ragged attention over it (prefill chunks and decodes
mixed).

Shapes (T tokens, R sequence slots, P pages per sequence, S page size, H query heads, L latent
width, Lg / Rg the latent / rope widths rounded up to powers of two (at least 16), Hb heads per
program, Tq query tokens per work item, M = Tq * Hb rows padded to a power of two >= 16, Pb pages
per KV block, Tk = Pb * S, W work items, N KV splits):
  q `[T, H, L + R]` (absorbed: `[W_UK q_nope | q_rope]`), cache `[num_pages, S, Lg + Rg]`,
  kv_lens `[R]`, page_indices `[R, P]`, cu_q_lens `[R + 1]`, num_seqs `[]` or `[1]`  ->  `[T, H, L]`.

Layout (a layer's; several layers stack along the page axis, as in api.py): `[num_pages, S,
Lg + Rg]` in the cache dtype, row `[c_kv | 0 | k_rope | 0]`, the rope part at lane Lg. Why:
* Triton tiles have power-of-two shapes, but the array need not: the kernel loads the latent
  part `[Tk, Lg]` and the rope part `[Tk, Rg]` of a block's rows as two tiles, so DeepSeek's
  512 + 64 values a token are stored as they are (no padding to 1024).
* A page is one contiguous `S * (Lg + Rg)` run, read with coalesced loads; every head reads the
  same rows (they are its keys and, the latent part, its values).

Design (flash-decoding over a ragged batch, as kernel.py with one shared "kv head"):
* The wrapper cuts each sequence's query rows into work items of at most Tq tokens (one
  sequence each) and the heads into blocks of Hb; a program's M rows are its item's tokens x its
  block's heads (row r: token r // Hb, head r % Hb). Hb = 16 keeps the `[M, Lg]` float32
  accumulator in registers at Lg = 512.
* grid = (W, H / Hb, N): a program attends its rows over the N-th share of the KV blocks they
  can see (causal), gathering each block's Pb pages by block-table lookup, scores `q_latent .
  c + q_rope . k_rope`, values the latent tile, an online softmax in registers. It writes its
  unnormalised output, running max and sum; the wrapper merges the N splits and scatters rows
  back to token order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.checks import check_metadata, check_positive, compute_dtype
from pallas_kernels.gpu.kernel import MASK_VALUE, META_WIDTH, MIN_ROWS, online_softmax_step, plan_work_items
from pallas_kernels.reference import saturating_cast

HEADS_PER_PROGRAM = 16  # Hb: a [16 * Tq, 512] float32 accumulator fits the registers of 4 warps
TOKENS_PER_KV_BLOCK = 32  # keys per block: a [32, 576] bfloat16 row tile is 36 KiB
# Hopper's 227 KiB of shared memory a block holds two stages of 64-key tiles, the fastest
# blocks of a sweep on an H200 (`benchmarks/device_check.py`); older GPUs keep 32 keys.
TOKENS_PER_KV_BLOCK_HOPPER = 64
QUERIES_PER_ITEM_PREFILL = 2
KV_SPLITS_DECODE = 8
# KV splits are added while fewer programs than this run: on an H200 a decode batch that filled
# the SMs with work items alone still ran faster with 4 splits than with none.
MIN_PROGRAMS = 2048
NUM_WARPS = 4
NUM_STAGES = 2


def _pow2(x: int) -> int:
    return max(MIN_ROWS, 1 << (x - 1).bit_length())


def part_widths(latent_dim: int, rope_dim: int) -> tuple[int, int]:
    """(Lg, Rg): the lanes the layout gives the latent and the rope part of a row."""
    return _pow2(latent_dim), _pow2(rope_dim)


def allocate_latent_cache(num_pages: int, page_size: int, width: int, dtype: jnp.dtype) -> jax.Array:
    """A zeroed `[num_pages, S, Lg + Rg]` cache for rows of `width` values (`row_lanes`)."""
    check_positive(num_pages=num_pages, page_size=page_size, width=width)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two for Triton tiles")
    return jnp.zeros((num_pages, page_size, row_lanes(width)), dtype)


def row_lanes(width: int) -> int:
    """Lanes of a cache row of `width` values: `Lg + Rg`, the latent L being the largest power of
    two below `width` (the allocation sees only the width; DeepSeek's 512 of 576 is that, and
    the kernel refuses another split by name)."""
    latent = 1 << (width - 1).bit_length() - 1
    return sum(part_widths(latent, width - latent))


def _check_latent(width: int, latent_dim: int) -> None:
    if latent_dim != 1 << (width - 1).bit_length() - 1:
        raise ValueError(
            f"the GPU latent cache holds latents of a power of two below the row width {width} "
            f"(DeepSeek's 512 of 576), not {latent_dim}; use the xla backend"
        )


def write_latent(
    cache: jax.Array, latent: jax.Array, k_rope: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Writes the rows `[latent | 0 | k_rope | 0]` (`[T, L]`, `[T, R]`) at `slot_mapping[T]` (page
    * S + offset) of `[num_pages, S, Lg + Rg]`; negative slots write nothing. One XLA scatter of
    whole rows, in place when the caller's jit donates `cache`."""
    latent_dim, rope_dim = latent.shape[1], k_rope.shape[1]
    _check_latent(latent_dim + rope_dim, latent_dim)
    lat_lanes, rope_lanes = part_widths(latent_dim, rope_dim)
    if cache.ndim != 3 or cache.shape[2] != lat_lanes + rope_lanes:
        raise ValueError(f"latent cache {cache.shape} must be [num_pages, S, {lat_lanes + rope_lanes}]")
    num_pages, page_size, _ = cache.shape
    rows = jnp.concatenate(
        [
            jnp.pad(latent, ((0, 0), (0, lat_lanes - latent_dim))),
            jnp.pad(k_rope, ((0, 0), (0, rope_lanes - rope_dim))),
        ],
        axis=1,
    )
    slot_mapping = slot_mapping.astype(jnp.int32)
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # out of range: dropped
    rows = saturating_cast(rows, cache.dtype)
    return cache.at[page, slot_mapping % page_size].set(rows, mode="drop", unique_indices=True)


def _mla_kernel(
    meta_ref,  # [META_WIDTH] this work item: seq, first token, number of rows, first position
    page_table_ref,  # [R, P_pad] block table, padded to whole KV blocks
    q_lat_ref,  # [M, Lg] this item's rows for this head block, pre-scaled by sm_scale
    q_rope_ref,  # [M, Rg]
    cache_ref,  # [num_pages, S, Lg + Rg] the whole cache
    o_ref,  # [M, Lg] f32 unnormalised output of this split
    m_ref,  # [M] f32 running max
    l_ref,  # [M] f32 running sum
    *,
    heads_per_program: int,
    block_q: int,
    pages_per_block: int,
    num_kv_splits: int,
    pages_per_seq: int,
):
    num_rows_padded, lat_lanes = q_lat_ref.shape
    rope_lanes = q_rope_ref.shape[1]
    num_pages, page_size, _ = cache_ref.shape
    block_kv = pages_per_block * page_size
    split = pl.program_id(2)
    seq, num_rows, first_pos = meta_ref[0], meta_ref[2], meta_ref[3]

    kv_hi = jnp.where(num_rows > 0, jnp.clip(first_pos + num_rows, 0, pages_per_seq * page_size), 0)
    blk_hi = pl.cdiv(kv_hi, block_kv)
    blocks_per_split = pl.cdiv(blk_hi, num_kv_splits)
    start = split * blocks_per_split
    stop = jnp.minimum(start + blocks_per_split, blk_hi)

    row = lax.broadcasted_iota(jnp.int32, (num_rows_padded,), 0)
    token = row // heads_per_program
    row_ok = (row < block_q * heads_per_program) & (token < num_rows)
    query_pos = first_pos + token  # [M]
    q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]

    def body(blk, carry):
        pages = page_table_ref[seq, pl.ds(blk * pages_per_block, pages_per_block)]
        pages = jnp.clip(pages, 0, num_pages - 1)  # entries past the sequence may be garbage
        lat = cache_ref[pages, :, pl.ds(0, lat_lanes)].reshape(block_kv, lat_lanes).astype(q_lat.dtype)
        rope = cache_ref[pages, :, pl.ds(lat_lanes, rope_lanes)].reshape(block_kv, rope_lanes)
        key_pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)  # [Tk]
        lat = jnp.where((key_pos < kv_hi)[:, None], lat, jnp.zeros_like(lat))  # values past kv_hi
        dims = (((1,), (1,)), ((), ()))
        scores = lax.dot_general(q_lat, lat, dims, preferred_element_type=jnp.float32)
        scores += lax.dot_general(q_rope, rope.astype(q_rope.dtype), dims, preferred_element_type=jnp.float32)
        visible = row_ok[:, None] & (key_pos[None, :] <= query_pos[:, None])  # [M, Tk]
        return online_softmax_step(scores, visible, lat, carry)

    init = (
        jnp.full((num_rows_padded,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows_padded,), jnp.float32),
        jnp.zeros((num_rows_padded, lat_lanes), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(start, stop, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def _validate(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, latent_dim):
    if q.ndim != 3 or cache.ndim != 3:
        raise ValueError(f"want q [T, H, C] and cache [num_pages, S, Lg + Rg]; got {q.shape}, {cache.shape}")
    width = q.shape[2]
    if not 0 < latent_dim < width:
        raise ValueError(f"latent_dim {latent_dim} must leave a rope part in q's rows of {width}")
    _check_latent(width, latent_dim)
    lanes = sum(part_widths(latent_dim, width - latent_dim))
    if cache.shape[2] != lanes:
        raise ValueError(
            f"cache {cache.shape} last dim must be {lanes} for rows of {latent_dim} + {width - latent_dim}"
        )
    page_size = cache.shape[1]
    if page_size & (page_size - 1):
        raise ValueError(f"cache {cache.shape}: page size {page_size} must be a power of two")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, None, None)


def hopper_or_newer() -> bool:
    """Whether the device programs are built for (JAX's default device, else its first) is a
    GPU of compute capability 9.0 or more; False on CPU (interpret mode) and for unknown kinds."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        return capability is not None and float(capability) >= 9.0
    except ValueError:
        return False


def default_block_sizes(
    *,
    page_size: int,
    pages_per_seq: int,
    num_tokens: int,
    max_num_seqs: int,
    num_head_blocks: int,
    large_tiles: bool = False,
) -> tuple[int, int, int]:
    """(num_kv_pages_per_block, num_queries_per_block, num_kv_splits): 32-key blocks, 64 for
    decode buckets with `large_tiles` (Hopper); decode buckets one token a work item, and KV
    splits (up to 8) while the work items and head blocks alone give fewer than `MIN_PROGRAMS`
    programs (each split's partial output is a float32 copy of the step's); others 2 tokens a
    work item and one split."""
    decode = num_tokens <= max_num_seqs
    # Prefill's work items of 2 tokens double the query tile: 64 keys would pass Hopper's limit.
    tokens = TOKENS_PER_KV_BLOCK_HOPPER if large_tiles and decode else TOKENS_PER_KV_BLOCK
    pages = max(1, min(tokens // page_size, 1 << (pages_per_seq.bit_length() - 1)))
    if not decode:
        return pages, QUERIES_PER_ITEM_PREFILL, 1
    programs = num_tokens * num_head_blocks
    splits = min(KV_SPLITS_DECODE, -(-MIN_PROGRAMS // programs), -(-pages_per_seq // pages))
    return pages, 1, max(1, splits)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "latent_dim",
        "interpret",
        "num_kv_pages_per_block",
        "num_queries_per_block",
        "num_kv_splits",
        "num_warps",
        "num_stages",
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
    interpret: bool = False,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> jax.Array:
    """Causal latent attention of ragged absorbed queries over their sequences' paged latent rows.

    Args:
      q: `[T, H, C]` `[W_UK q_nope | q_rope]` per head; sequence i owns rows
        `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens.
      cache: `[num_pages, S, Lg + Rg]` (module docstring), already holding these tokens' rows.
      kv_lens: `[R]` int32 cached tokens per sequence, this step's included.
      page_indices: `[R, P]` int32 block table.
      cu_q_lens: `[R + 1]` int32 cumulative query lengths (non-decreasing).
      num_seqs: int32 `[]` or `[1]`; rows past `cu_q_lens[num_seqs]` are padding (zeros).
      sm_scale: softmax scale on `q . row`.
      latent_dim: L, the values' width (the first L values of each row).
      interpret: False on a GPU; True to run the kernel on CPU (tests).
      num_kv_pages_per_block: pages per KV block, a power of two (default: `default_block_sizes`).
      num_queries_per_block: most query tokens of one sequence per work item (Tq).
      num_kv_splits: programs sharing one work item's KV range (flash-decoding splits).
      num_warps, num_stages: Triton launch parameters.

    Returns:
      `[T, H, L]` in q's dtype: each head's attention-weighted latent.
    """
    _validate(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, latent_dim)
    num_tokens, num_heads, width = q.shape
    page_size = cache.shape[1]
    num_slots, pages_per_seq = page_indices.shape
    heads = min(HEADS_PER_PROGRAM, 1 << (num_heads - 1).bit_length())  # Hb
    num_head_blocks = -(-num_heads // heads)
    defaults = default_block_sizes(
        page_size=page_size, pages_per_seq=pages_per_seq, num_tokens=num_tokens, max_num_seqs=num_slots,
        num_head_blocks=num_head_blocks, large_tiles=not interpret and hopper_or_newer(),
    )  # fmt: skip
    pages_per_block = num_kv_pages_per_block or defaults[0]
    block_q = num_queries_per_block or defaults[1]
    splits = num_kv_splits or defaults[2]
    if pages_per_block <= 0 or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"num_kv_pages_per_block={pages_per_block} must be a power of two")
    if block_q <= 0 or splits <= 0:
        raise ValueError(f"num_queries_per_block={block_q} and num_kv_splits={splits} must be positive")
    lat_lanes, rope_lanes = part_widths(latent_dim, width - latent_dim)
    num_rows_padded = _pow2(block_q * heads)
    num_work = min(num_tokens, pl.cdiv(num_tokens, block_q) + num_slots)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)

    meta, row_start, out_row, valid = plan_work_items(
        cu_q_lens, kv_lens, num_seqs, num_tokens, block_q, num_work
    )
    rows = jnp.clip(row_start[:, None] + jnp.arange(block_q), 0, num_tokens - 1)  # [W, Tq]
    qs = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype(cache.dtype))
    qs = jnp.pad(qs, ((0, 0), (0, num_head_blocks * heads - num_heads), (0, 0)))[rows]  # [W, Tq, Hp, C]
    qs = qs.reshape(num_work, block_q, num_head_blocks, heads, width).transpose(0, 2, 1, 3, 4)
    qs = qs.reshape(num_work, num_head_blocks, block_q * heads, width)
    row_pad = (0, num_rows_padded - block_q * heads)
    q_lat = jnp.pad(qs[..., :latent_dim], ((0, 0), (0, 0), row_pad, (0, lat_lanes - latent_dim)))
    q_rope = jnp.pad(qs[..., latent_dim:], ((0, 0), (0, 0), row_pad, (0, rope_lanes - width + latent_dim)))
    blocks_per_seq = pl.cdiv(pages_per_seq, pages_per_block)
    page_table = jnp.pad(page_indices, ((0, 0), (0, blocks_per_seq * pages_per_block - pages_per_seq)))

    part = (splits, num_work, num_head_blocks, num_rows_padded)
    row_spec = pl.BlockSpec((None, None, None, num_rows_padded), lambda w, h, s: (s, w, h, 0))
    o, m, l_sum = pl.pallas_call(
        functools.partial(
            _mla_kernel,
            heads_per_program=heads,
            block_q=block_q,
            pages_per_block=pages_per_block,
            num_kv_splits=splits,
            pages_per_seq=pages_per_seq,
        ),
        grid=(num_work, num_head_blocks, splits),
        in_specs=[
            pl.BlockSpec((None, META_WIDTH), lambda w, h, s: (w, 0)),
            pl.BlockSpec(page_table.shape, lambda w, h, s: (0, 0)),
            pl.BlockSpec((None, None, num_rows_padded, lat_lanes), lambda w, h, s: (w, h, 0, 0)),
            pl.BlockSpec((None, None, num_rows_padded, rope_lanes), lambda w, h, s: (w, h, 0, 0)),
            pl.BlockSpec(cache.shape, lambda w, h, s: (0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, num_rows_padded, lat_lanes), lambda w, h, s: (s, w, h, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, lat_lanes), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_paged_attention_gpu",
    )(meta, page_table, q_lat, q_rope, cache)

    # Merge the KV splits: out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s.
    weight = jnp.exp(m - jnp.max(m, axis=0))  # [N, W, Hb', M]
    total = jnp.sum(weight * l_sum, axis=0)
    out = jnp.sum(weight[..., None] * o, axis=0) / jnp.where(total == 0.0, 1.0, total)[..., None]
    out = out[:, :, : block_q * heads, :latent_dim].reshape(
        num_work, num_head_blocks, block_q, heads, latent_dim
    )
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_work * block_q, num_head_blocks * heads, latent_dim)
    return jnp.where(valid[:, None, None], out[out_row, :num_heads], 0.0).astype(q.dtype)
