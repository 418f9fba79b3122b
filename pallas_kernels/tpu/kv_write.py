# SPDX-License-Identifier: Apache-2.0
"""The KV write of the Mosaic TPU backend: DMA kernels that update the cache in place.

Why not an XLA scatter (`write_kv_reference`, kept as the reference): XLA's TPU layout assignment
gives a scatter into `[num_pages, 2K, S, Dp]` its own preferred layout of the whole cache, while
the attention kernel's custom call fixes the default one, so the compiled step converted the
entire cache array between the two before every layer (a copy of the cache per layer, and temp
memory the size of the cache). Here every access to the cache is a Mosaic DMA on the default
layout, and the cache is aliased from input to output: the step holds no second copy of it.

How (T tokens, K kv heads, S page size, Dp padded head dim, Rt rows of the dtype's sublane
tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit values):
* In HBM each `[S, Dp]` slab is stored in `(Rt, 128)` tiles, and 16- and 8-bit rows are packed
  two or four to a 32-bit word, so a DMA cannot write a single token's row: Mosaic accepts only
  tile-aligned row ranges. The write therefore goes by tile: the `[2K, Rt, Dp]` block of a page
  holding rows `Rt * j ... Rt * j + Rt - 1` of every slab.
* The wrapper maps the tokens to the distinct tiles they touch (a sort of the tile numbers, so
  tokens of one tile share one tile buffer whatever their order; padding slots touch none).
* `_read_kernel` DMAs those tiles from the cache into `[T, 2K, Rt, Dp]` tile buffers in HBM; an
  XLA scatter puts the tokens' rows into those small buffers; `_write_kernel` DMAs the tiles
  back into the cache (aliased in -> out). All DMAs of a call are started before the first wait.
* Long prefills go in chunks of tokens (`CHUNK_BYTES`, `MAX_CHUNK_TOKENS`), one after another.

Traffic: a decode token reads and writes one tile (`2K * Rt * Dp` values), a prefill chunk each
tile once; temp memory is the tile buffers of one chunk of tokens (`CHUNK_BYTES` at most),
independent of the cache's size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import saturating_cast
from pallas_kernels.tpu.layout import padded_head_dim, sublane_tile

NO_TILE = -1  # a tile buffer that holds no cache tile (padding)
# Most bytes of tile buffers one chunk of tokens uses: a long prefill goes in several chunks, so
# its temp memory stays bounded (and a decode step's is one small chunk).
CHUNK_BYTES = 32 << 20
# Most tokens of one chunk: its tile numbers are scalar-prefetched into SMEM, which is small.
MAX_CHUNK_TOKENS = 1024


def _check_shapes(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> None:
    if kv_cache.ndim != 4 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(
            f"write_kv wants kv_cache [num_pages, 2K, S, Dp] and k, v [T, K, D]; got kv_cache "
            f"{kv_cache.shape}, k {k.shape}, v {v.shape}"
        )
    _, num_rows, _, lanes = kv_cache.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_rows != 2 * num_kv_heads or lanes != padded_head_dim(head_dim):
        raise ValueError(
            f"kv_cache {kv_cache.shape} does not hold k/v {k.shape}: expected "
            f"[num_pages, {2 * num_kv_heads}, S, {padded_head_dim(head_dim)}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] = ({num_tokens},)")


def _rows(kv_cache: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`[T, 2K, Dp]` rows to store: k0 v0 k1 v1 .. in the cache's dtype, lanes past D zero."""
    num_tokens, num_kv_heads, head_dim = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    lanes = kv_cache.shape[-1]
    return jnp.pad(saturating_cast(kv, kv_cache.dtype), ((0, 0), (0, 0), (0, lanes - head_dim)))


def write_kv_reference(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes k, v `[T, K, D]` at `slot_mapping[T]` (page * S + offset) into `[num_pages, 2K, S, Dp]`
    with one XLA scatter; negative slots are padding and write nothing."""
    _check_shapes(kv_cache, k, v, slot_mapping)
    num_pages, _, page_size, _ = kv_cache.shape
    slot_mapping = slot_mapping.astype(jnp.int32)
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # out of range: dropped
    offset = slot_mapping % page_size
    return kv_cache.at[page, :, offset, :].set(_rows(kv_cache, k, v), mode="drop", unique_indices=True)


def tile_plan(slot_mapping: jax.Array, tile_rows: int) -> tuple[jax.Array, jax.Array]:
    """`(buffer of each token, tile of each buffer)` for tokens at `slot_mapping[T]`.

    A tile is numbered `slot // tile_rows` (page * tiles per page + row block: page sizes are
    multiples of `tile_rows`). Tokens of one tile get one buffer, the distinct tiles buffers
    0, 1, .. in increasing order; a padding token's buffer is T (out of range) and unused
    buffers hold `NO_TILE`.
    """
    num_tokens = slot_mapping.shape[0]
    slot_mapping = slot_mapping.astype(jnp.int32)
    padding = jnp.iinfo(jnp.int32).max
    tile = jnp.where(slot_mapping >= 0, lax.div(slot_mapping, jnp.int32(tile_rows)), padding)
    order = jnp.argsort(tile)
    sorted_tile = tile[order]
    first = jnp.concatenate([jnp.ones(1, bool), sorted_tile[1:] != sorted_tile[:-1]])
    buffer_sorted = jnp.cumsum(first, dtype=jnp.int32) - 1
    buffer_sorted = jnp.where(sorted_tile == padding, num_tokens, buffer_sorted)
    buffer_of_token = jnp.zeros(num_tokens, jnp.int32).at[order].set(buffer_sorted, unique_indices=True)
    tile_of_buffer = jnp.full(num_tokens, NO_TILE, jnp.int32).at[buffer_sorted].set(sorted_tile, mode="drop")
    return buffer_of_token, tile_of_buffer


def _tile_ref(cache_ref, tile: jax.Array, tiles_per_page: int, tile_rows: int):
    """The `[2K, Rt, Dp]` view of cache tile `tile` (non-negative)."""
    page = lax.div(tile, jnp.int32(tiles_per_page))
    row = pl.multiple_of(lax.rem(tile, jnp.int32(tiles_per_page)) * tile_rows, tile_rows)
    return cache_ref.at[page, :, pl.ds(row, tile_rows), :]


def _copy_tiles(
    tile_of_buffer_ref, src_ref, dst_ref, sem, *, to_cache: bool, tiles_per_page: int, tile_rows: int
):
    """Starts a DMA per buffer that holds a tile (cache -> buffers, or back), then waits for all."""
    num_buffers = tile_of_buffer_ref.shape[0]

    def copy(i, tile):
        cache_view = _tile_ref(dst_ref if to_cache else src_ref, tile, tiles_per_page, tile_rows)
        buffer_view = src_ref.at[i] if to_cache else dst_ref.at[i]
        src, dst = (buffer_view, cache_view) if to_cache else (cache_view, buffer_view)
        return pltpu.make_async_copy(src, dst, sem.at[0])

    def start(i, started):
        tile = tile_of_buffer_ref[i]

        @pl.when(tile >= 0)
        def _():
            copy(i, tile).start()

        return started + (tile >= 0).astype(jnp.int32)

    started = lax.fori_loop(0, num_buffers, start, jnp.int32(0))

    def wait(i, carry):
        copy(0, jnp.int32(0)).wait()  # every copy has the same size: any descriptor waits for one
        return carry

    lax.fori_loop(0, started, wait, 0)


def _read_kernel(tile_of_buffer_ref, cache_ref, buffers_ref, sem, **kw):
    _copy_tiles(tile_of_buffer_ref, cache_ref, buffers_ref, sem, to_cache=False, **kw)


def _write_kernel(tile_of_buffer_ref, buffers_ref, cache_in_ref, cache_ref, sem, **kw):
    del cache_in_ref  # the same buffer as cache_ref (aliased)
    _copy_tiles(tile_of_buffer_ref, buffers_ref, cache_ref, sem, to_cache=True, **kw)


def _tile_call(kernel, out_shape, num_operands: int, name: str, interpret, aliases=None):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_operands,
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        input_output_aliases=aliases or {},
        interpret=interpret,
        name=name,
    )


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Writes k, v `[T, K, D]` at `slot_mapping[T]` (page * S + offset) into `[num_pages, 2K, S, Dp]`.

    Negative slots are padding and write nothing; slots must be distinct. The cache is updated in
    place when the caller's jit donates it (the kernels alias it from input to output).
    `interpret`: False on TPU; True or `pltpu.InterpretParams(...)` to run on CPU (tests).
    """
    _check_shapes(kv_cache, k, v, slot_mapping)
    return write_rows(kv_cache, _rows(kv_cache, k, v), slot_mapping, interpret=interpret)


def write_rows(
    cache: jax.Array, rows: jax.Array, slot_mapping: jax.Array, *, interpret: bool | pltpu.InterpretParams
) -> jax.Array:
    """Writes `rows [T, N, lanes]` (the cache's dtype) at `slot_mapping[T]` of a cache `[num_pages,
    N, S, lanes]` (row n of a token into slab n of its page), by tiles as the module docstring
    says; negative slots write nothing. The KV write's engine, and the latent cache's
    (`mla_kernel.py`, N = 1)."""
    _, num_rows, page_size, lanes = cache.shape
    tile_rows = sublane_tile(cache.dtype)
    if page_size % tile_rows:
        raise ValueError(f"page size {page_size} must be a multiple of {tile_rows} for {cache.dtype}")
    geometry = dict(tiles_per_page=page_size // tile_rows, tile_rows=tile_rows)
    tile_bytes = num_rows * tile_rows * lanes * cache.dtype.itemsize
    chunk = min(MAX_CHUNK_TOKENS, max(1, CHUNK_BYTES // tile_bytes))
    # Chunk by chunk: each chunk's read follows the previous chunk's write (it reads its output),
    # so a tile two chunks share gets both chunks' rows.
    for start in range(0, rows.shape[0], chunk):
        chunk_slots = slot_mapping[start : start + chunk]
        cache = _write_chunk(cache, rows[start : start + chunk], chunk_slots, geometry, interpret)
    return cache


def _write_chunk(kv_cache, rows, slot_mapping, geometry, interpret):
    """One chunk of tokens: read the tiles they touch, put their rows in, write the tiles back."""
    num_tokens = rows.shape[0]
    _, num_rows, _, lanes = kv_cache.shape
    tile_rows = geometry["tile_rows"]
    buffer_of_token, tile_of_buffer = tile_plan(slot_mapping, tile_rows)
    buffers_shape = jax.ShapeDtypeStruct((num_tokens, num_rows, tile_rows, lanes), kv_cache.dtype)
    read = _tile_call(
        functools.partial(_read_kernel, **geometry), buffers_shape, 1, "kv_read_tiles", interpret
    )
    buffers = read(tile_of_buffer, kv_cache)
    row = lax.rem(jnp.maximum(slot_mapping.astype(jnp.int32), 0), jnp.int32(tile_rows))
    buffers = buffers.at[buffer_of_token, :, row, :].set(rows, mode="drop")
    write = _tile_call(
        functools.partial(_write_kernel, **geometry),
        jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        2,
        "kv_write_tiles",
        interpret,
        aliases={2: 0},  # operand 2 (after the scalar-prefetched tile numbers): the cache
    )
    return write(tile_of_buffer, buffers, kv_cache)
