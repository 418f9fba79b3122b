# SPDX-License-Identifier: Apache-2.0
"""Where `models.moe.experts_routed` puts each routed (token, expert) assignment: the rows of its
tiles (each tile B rows of one expert) and the expert each tile multiplies by.

Two layouts. The routed one sorts the assignments by expert and pads each expert's rows to a
multiple of B, so that a step touches only the chosen experts' kernels; its tile count is a
static bound, and each tile gathers its own copy of its expert's kernels. The every-token one
gives each expert one tile holding every token, weighted by its routing weight (0 for a token
not routed to it): each expert's kernels are read once, in place. It pays for a decode step
under expert parallelism: most of a device's assignments are other devices' (weighted 0 and
sent to its first expert), yet the routed bound must allow for every assignment being its own,
so the routed tiles outnumber the device's experts several times over.

Axis letters as in `models.moe`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TileRows:
    """Rows of the tiles, flattened `[N*B]`: the token each row reads (T = the zero row), the
    weight its output is added with and, for weights on the inputs, the weight its input is
    scaled by (None otherwise); `tile_expert` the expert of each tile (`[N]`, or a full slice
    when tile i is expert i)."""

    token: jax.Array
    weight: jax.Array
    input_scale: jax.Array | None
    tile_expert: jax.Array | slice


def routed_rows(
    weights: jax.Array, experts: jax.Array, num_experts: int, rows: int, tiles: int, *, weights_on_input: bool
) -> TileRows:
    """The assignments sorted by expert, each expert's rows padded to a multiple of `rows` (B),
    in `tiles` (N) tiles; the rows past the last group are empty (zero row, weight 0)."""
    t, k = experts.shape
    a, e, b = t * k, num_experts, rows
    flat = experts.reshape(a)  # [A]
    order = jnp.argsort(flat, stable=True)  # [A] assignment at each sorted position
    sizes = jnp.bincount(flat, length=e)  # [E]
    padded = (sizes + b - 1) // b * b  # [E]
    padded_end = jnp.cumsum(padded)  # [E]
    group_start = jnp.cumsum(sizes) - sizes  # [E]
    sorted_expert = flat[order]  # [A]
    rank = jnp.arange(a) - group_start[sorted_expert]  # [A] position inside its group
    dest = padded_end[sorted_expert] - padded[sorted_expert] + rank  # [A] row in the tiled layout
    src = jnp.full((tiles * b,), a, jnp.int32).at[dest].set(order.astype(jnp.int32))  # a = empty
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(tiles) * b, side="right")  # [N]
    tile_expert = jnp.minimum(tile_expert, e - 1)  # tiles past the last group hold only empty rows
    token = jnp.append(jnp.arange(a, dtype=jnp.int32) // k, t)[src]  # [N*B]; t = the zero row
    w = jnp.append(weights.reshape(a), 0.0)[src]  # [N*B]; 0 on empty rows
    if weights_on_input:  # each row scaled by its weight before its expert; outputs count once
        return TileRows(token, (src < a).astype(jnp.float32), w, tile_expert)
    return TileRows(token, w, None, tile_expert)


def every_token_rows(
    weights: jax.Array, experts: jax.Array, num_experts: int, *, weights_on_input: bool
) -> TileRows:
    """One tile per expert (B = T), expert e's tile every token in order, each weighted by the
    sum of its weights routed to e (0 when none is)."""
    t = experts.shape[0]
    combine = jnp.zeros((t, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(t)[:, None], experts].add(weights.astype(jnp.float32))  # [T, E]
    w = combine.T.reshape(-1)  # [E*T]
    token = jnp.tile(jnp.arange(t, dtype=jnp.int32), num_experts)  # [E*T]
    if weights_on_input:  # the input scaled by its weight; an expert's output counts where chosen
        return TileRows(token, (w != 0).astype(jnp.float32), w, slice(None))
    return TileRows(token, w, None, slice(None))
