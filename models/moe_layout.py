# SPDX-License-Identifier: Apache-2.0
"""Where `models.moe.experts_routed` puts each routed (token, expert) assignment: the rows of its
tiles (each tile B rows of one expert) and the expert each tile multiplies by.

Two layouts. The routed one sorts the assignments by expert and pads each expert's rows to a
multiple of B, so that a step touches only the chosen experts' kernels; its tile count is a
static bound, and each tile gathers its own copy of its expert's kernels. The every-token one
gives each expert one tile holding every token, weighted by its routing weight (0 for a token
not routed to it): each expert's kernels are read once, in place. It pays for a decode step
whose routed tile bound outnumbers the experts (64 tokens of top-8 over 128 experts: about 320
tiles of 2 rows; under expert parallelism the bound allows for every assignment being the
device's own), as long as its extra rows of compute stay cheaper than the kernel reads it saves
(`every_token_pays`).

An assignment whose expert id is `num_experts` (another device's expert, under expert
parallelism) is in no tile: the routed tiles hold only the device's own rows, first, so that a
loop over chunks of tiles can stop at the last used one (`TileRows.used_tiles`).

Axis letters as in `models.moe`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_TILE_ROWS = 128
# The lowest ratio of peak bfloat16 flops to memory bandwidth of the TPU and GPU chips we
# compile for (A100's, `tpu_platform.planner.targets`): below it a decode step's matmuls stay
# memory-bound on every one of them.
ACCELERATOR_FLOPS_PER_BYTE = 150
# XLA:CPU is compute-bound, but there too every tile's gathered copy of its expert's kernels
# costs more than a few times the rows of compute: measured on two cores, the every-token tiles
# were faster up to about 3x the routed rows and mixed (slower in bfloat16) past 10x.
CPU_EXTRA_ROWS = 8


@dataclasses.dataclass(frozen=True)
class TileRows:
    """Rows of the tiles, flattened `[N*B]`: the token each row reads (T = the zero row), the
    weight its output is added with and, for weights on the inputs, the weight its input is
    scaled by (None otherwise); `tile_expert` the expert of each tile (`[N]`, or a full slice
    when tile i is expert i); `used_tiles` how many tiles, from the first, hold any row (an
    int32 scalar; the rest are empty)."""

    token: jax.Array
    weight: jax.Array
    input_scale: jax.Array | None
    tile_expert: jax.Array | slice
    used_tiles: jax.Array | int


def every_token_pays(tokens: int, experts: int, tiles: int, rows: int, weight_bits: int) -> tuple[bool, bool]:
    """(on CPU, on a TPU or GPU): whether the every-token layout beats `tiles` routed tiles of
    `rows` rows. It must read fewer kernels (`experts < tiles`) and hold at most MAX_TILE_ROWS
    tokens a tile. On a TPU or GPU its `tokens * experts` rows of compute must also stay under
    the time its kernels take to read (each weight of `weight_bits` bits does two flops per
    token: `16 * tokens / weight_bits` flops per byte); on CPU its rows must stay within
    `CPU_EXTRA_ROWS` times the routed ones."""
    if experts >= tiles or tokens > MAX_TILE_ROWS:
        return False, False
    on_cpu = tokens * experts <= CPU_EXTRA_ROWS * tiles * rows
    return on_cpu, 16 * tokens <= ACCELERATOR_FLOPS_PER_BYTE * weight_bits


def routed_rows(
    weights: jax.Array, experts: jax.Array, num_experts: int, rows: int, tiles: int, *, weights_on_input: bool
) -> TileRows:
    """The assignments sorted by expert, each expert's rows padded to a multiple of `rows` (B),
    in `tiles` (N) tiles; the rows past the last group are empty (zero row, weight 0), and so
    is every assignment to expert `num_experts` (another device's)."""
    t, k = experts.shape
    a, e, b = t * k, num_experts, rows
    flat = experts.reshape(a)  # [A]
    order = jnp.argsort(flat, stable=True)  # [A] assignment at each sorted position
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1, mode="drop")  # [E]
    padded = (sizes + b - 1) // b * b  # [E]
    padded_end = jnp.cumsum(padded)  # [E]
    group_start = jnp.cumsum(sizes) - sizes  # [E]
    sorted_expert = flat[order]  # [A]
    rank = jnp.arange(a) - group_start[sorted_expert]  # [A] position inside its group
    dest = padded_end[sorted_expert] - padded[sorted_expert] + rank  # [A] row in the tiled layout
    dest = jnp.where(sorted_expert < e, dest, tiles * b)  # another device's: no row
    src = jnp.full((tiles * b,), a, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(tiles) * b, side="right")  # [N]
    tile_expert = jnp.minimum(tile_expert, e - 1)  # tiles past the last group hold only empty rows
    token = jnp.append(jnp.arange(a, dtype=jnp.int32) // k, t)[src]  # [N*B]; t = the zero row
    w = jnp.append(weights.reshape(a), 0.0)[src]  # [N*B]; 0 on empty rows
    used = padded_end[-1] // b
    if weights_on_input:  # each row scaled by its weight before its expert; outputs count once
        return TileRows(token, (src < a).astype(jnp.float32), w, tile_expert, used)
    return TileRows(token, w, None, tile_expert, used)


def every_token_rows(
    weights: jax.Array, experts: jax.Array, num_experts: int, *, weights_on_input: bool
) -> TileRows:
    """One tile per expert (B = T), expert e's tile every token in order, each weighted by the
    sum of its weights routed to e (0 when none is; an assignment to expert `num_experts`
    counts nowhere)."""
    t = experts.shape[0]
    combine = jnp.zeros((t, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(t)[:, None], experts].add(weights.astype(jnp.float32), mode="drop")
    w = combine.T.reshape(-1)  # [E*T]
    token = jnp.tile(jnp.arange(t, dtype=jnp.int32), num_experts)  # [E*T]
    if weights_on_input:  # the input scaled by its weight; an expert's output counts where chosen
        return TileRows(token, (w != 0).astype(jnp.float32), w, slice(None), num_experts)
    return TileRows(token, w, None, slice(None), num_experts)
