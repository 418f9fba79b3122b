# SPDX-License-Identifier: Apache-2.0
"""The tiles of `models.moe.experts_routed`: their rows gathered, run through the experts and
added back to the tokens (`tiles_sum`), and the tile matmuls of quantized expert stacks with a
scale per group of inputs (`grouped_tile_dot`) or affine offsets (`tile_offset_product`).

Axis letters as in `models.moe`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from models.moe_layout import TileRows


def tiles_sum(
    x: jax.Array,
    layout: TileRows,
    rows: int,
    chunking: tuple[int, int],
    tiles_mlp: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """`x [T, D]`'s rows in `layout`'s tiles of `rows` (B) rows through `tiles_mlp`, each
    output row added to its token's with its weight: `[T, D]`. `chunking`: (chunks, tiles per
    chunk); past one chunk, a loop over the chunks holding used tiles (`layout.used_tiles`)."""
    t, d = x.shape
    chunks, per_chunk = chunking
    token, w, row_scale, tile_expert = layout.token, layout.weight, layout.input_scale, layout.tile_expert
    x_padded = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # [T + 1, D]

    def add_chunk(out: jax.Array, token_c: jax.Array, ids: jax.Array, w_c: jax.Array, scale_c) -> jax.Array:
        """`out [T + 1, D]` plus one chunk's tiles (`ids [C]`, rows `token_c [C*B]`) weighted."""
        rows_in = x_padded[token_c].reshape(-1, rows, d)  # [C, B, D]
        if scale_c is not None:
            rows_in = (rows_in.astype(jnp.float32) * scale_c.reshape(-1, rows, 1)).astype(x.dtype)
        y = tiles_mlp(rows_in, ids).reshape(-1, d)  # [C*B, D]
        return out.at[token_c].add(y.astype(jnp.float32) * w_c[:, None])

    out = jnp.zeros((t + 1, d), jnp.float32)
    if chunks == 1:
        out = add_chunk(out, token, tile_expert, w, row_scale)
    else:
        # A loop over the chunks, one chunk's kernels gathered at a time, each chunk's rows
        # gathered and its outputs added to the tokens' rows inside it: no `[N, B, D]` buffer of
        # every tile's rows or outputs, which XLA's GPU compiler allocates for every MoE layer of
        # the step at once. It stops after the last chunk holding rows: the static bound allows
        # for the worst routing (under expert parallelism, every assignment on one device's
        # experts), and the empty chunks past it would cost a chunk's matmuls each.
        per_chunk_rows = (token, w) + (() if row_scale is None else (row_scale,))
        token_c, w_c, *scale_c = (v.reshape(chunks, per_chunk * rows) for v in per_chunk_rows)
        ids = tile_expert.reshape(chunks, per_chunk)

        def body(i: jax.Array, out: jax.Array) -> jax.Array:
            return add_chunk(out, token_c[i], ids[i], w_c[i], scale_c[0][i] if scale_c else None)

        used_chunks = (layout.used_tiles + per_chunk - 1) // per_chunk
        out = jax.lax.fori_loop(0, used_chunks, body, out)
    return out[:t].astype(x.dtype)


def grouped_tile_dot(rows: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """`rows [N, B, in] @ (kernel * scale) [N, in, out]` in float32 for a kernel of 8- or 4-bit
    values with a scale per group of inputs of each column (`scale [N, in / G, out]`, block fp8
    and 4-bit experts): on TPU and GPU a partial product per group, each times its scales,
    summed over the groups, the values converted to the rows' dtype inside the dot and no
    dequantized weight made. XLA:CPU has no bfloat16 dot batched over two axes (tiles and
    groups): there each tile's kernel is dequantized in float32 for one dot a tile, as
    `models.int8.int8_dot_dequantized` does for a dense layer."""
    return jax.lax.platform_dependent(
        rows, kernel, scale, cpu=_grouped_tile_dot_dequantized, default=_grouped_tile_dot_per_group
    )


def _grouped_tile_dot_per_group(rows: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    n, b, inputs = rows.shape
    groups = scale.shape[1]
    size = inputs // groups
    xg = rows.reshape(n, b, groups, size)
    kg = kernel.reshape(n, groups, size, kernel.shape[-1]).astype(rows.dtype)
    partial = jnp.einsum("nbgi,ngif->nbgf", xg, kg, preferred_element_type=jnp.float32)
    return jnp.einsum("nbgf,ngf->nbf", partial, scale.astype(jnp.float32))


def _grouped_tile_dot_dequantized(rows: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    n, inputs, outputs = kernel.shape
    groups = scale.shape[1]
    w = kernel.astype(jnp.float32).reshape(n, groups, inputs // groups, outputs)
    w = (w * scale.astype(jnp.float32)[:, :, None, :]).reshape(n, inputs, outputs)
    return jnp.einsum("nbi,nif->nbf", rows.astype(jnp.float32), w, preferred_element_type=jnp.float32)


def tile_offset_product(rows: jax.Array, offset: jax.Array) -> jax.Array:
    """`rows [N, B, in]` times affine offsets in float32 (`models.int4.offset_product` a tile at a
    time): each group's input sums `[N, B, in / G]` times `offset [N, in / G, out]`, or each
    row's sum times `offset [N, out]` per channel. At full float32 precision: the offsets may
    nearly cancel the scaled values' product."""
    rows, offset = rows.astype(jnp.float32), offset.astype(jnp.float32)
    if offset.ndim == 2:
        return jnp.sum(rows, axis=-1, keepdims=True) * offset[:, None, :]
    n, b, _ = rows.shape
    sums = rows.reshape(n, b, offset.shape[1], -1).sum(axis=-1)
    return jnp.einsum(
        "nbg,ngf->nbf", sums, offset, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
