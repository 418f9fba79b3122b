# SPDX-License-Identifier: Apache-2.0
"""Top-k routed mixture-of-experts MLP (Mixtral, Qwen3-MoE): routing, a dense reference and the
routed grouped matmul the models run.

Axis letters: T tokens, D hidden, F expert MLP size, E experts, k experts per token,
A = T * k routed (token, expert) assignments, B rows per tile, N tiles.

Why a sort-by-expert tiled matmul and not `jax.lax.ragged_dot`: XLA:CPU expands `ragged_dot` into
a dense dot over every expert (its cost grows with E, not with k), which is exactly
the work routing should avoid. Here the A assignments are sorted by expert and each expert's
rows are padded to a multiple of B, so every B-row tile belongs to one expert; each tile is
multiplied by its own expert's weights. The tile count is bounded statically by
`(A + min(E, A) * (B - 1)) // B`, so a decode step (A < E) touches only A experts' weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from models import expert_load
from models.config import ModelConfig
from models.int4 import dequantize_affine
from models.int8 import dequantize
from models.layers import activation
from models.linear import Linear
from models.metadata import AttentionMetadata
from models.moe_layout import MAX_TILE_ROWS, every_token_pays, every_token_rows, routed_rows
from models.moe_tiles import grouped_tile_dot, tile_offset_product, tiles_sum
from models.mxfp4 import Mxfp4Stack
from models.sharding import DATA_AXIS, MODEL_AXIS

# Elements of the expert kernels one chunk of tiles gathers (128 MiB in bfloat16): a prefill
# step's tiles outnumber the experts, and every tile's own copy of its expert's kernels at once
# would take a few times the whole stack's bytes (dequantized, for 8- and 4-bit experts).
MAX_CHUNK_KERNEL_ELEMENTS = 1 << 26


def route(router_logits: jax.Array, top_k: int, *, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over experts (float32), the `top_k` best, optionally renormalized to sum to 1.

    Args:
      router_logits: `[T, E]`.
    Returns:
      weights `[T, k]` float32 and expert ids `[T, k]` int32.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_dense_reference(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    act: Callable[[jax.Array], jax.Array],
    *,
    weights_on_input: bool = False,
) -> jax.Array:
    """Every expert on every token, combined with the routing weights (zero when not chosen).
    `weights_on_input`: each chosen expert gets its token scaled by the weight and its outputs
    are summed (Llama 4), instead of its output scaled.

    Args:
      x: `[T, D]`; gate, up: `[E, D, F]`; down: `[E, F, D]`; weights, experts: `[T, k]`.
    Returns:
      `[T, D]` in x's dtype.
    """
    t = x.shape[0]
    combine = jnp.zeros((t, gate.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(t)[:, None], experts].add(weights)  # [T, E]
    if weights_on_input:
        xs = (x[:, None, :].astype(jnp.float32) * combine[:, :, None]).astype(x.dtype)  # [T, E, D]
        h = act(jnp.einsum("ted,edf->tef", xs, gate)) * jnp.einsum("ted,edf->tef", xs, up)
        chosen = (combine != 0).astype(jnp.float32)
        y = jnp.einsum("tef,efd->ted", h, down)
        return jnp.einsum("ted,te->td", y.astype(jnp.float32), chosen).astype(x.dtype)
    h = act(jnp.einsum("td,edf->tef", x, gate)) * jnp.einsum("td,edf->tef", x, up)  # [T, E, F]
    y = jnp.einsum("tef,efd->ted", h, down)  # [T, E, D]
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile B: about half the mean group size, a power of two in [1, MAX_TILE_ROWS]."""
    mean_half = num_assignments // (2 * min(num_experts, num_assignments))
    return min(MAX_TILE_ROWS, 1 << max(0, mean_half.bit_length() - 1))


def num_tiles(num_assignments: int, num_experts: int, rows: int) -> int:
    """Static bound on the tiles of B=`rows`: each non-empty group wastes under one tile."""
    return (num_assignments + min(num_experts, num_assignments) * (rows - 1)) // rows


def tile_chunks(
    tiles: int, kernel_elements: int, max_elements: int = MAX_CHUNK_KERNEL_ELEMENTS
) -> tuple[int, int]:
    """(chunks, tiles per chunk) for `tiles` tiles whose kernels take `kernel_elements` each:
    as few chunks as keep one chunk's gathered kernels within `max_elements`, the tiles spread
    evenly over them (the last chunks may hold a few more empty tiles than `tiles` needs)."""
    per_chunk = max(1, max_elements // max(1, kernel_elements))
    chunks = -(-tiles // per_chunk)
    return chunks, -(-tiles // chunks)


def experts_routed(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    act: Callable[[jax.Array], jax.Array],
    *,
    rows: int | None = None,
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    gate_bias: jax.Array | None = None,
    weights_on_input: bool = False,
    max_chunk_elements: int = MAX_CHUNK_KERNEL_ELEMENTS,
    offsets: tuple[jax.Array | None, jax.Array | None, jax.Array | None] | None = None,
    input_order: jax.Array | None = None,
    every_token_tiles: bool | None = None,
) -> jax.Array:
    """The same result as `experts_dense_reference`, computing each token only for its k experts.

    `rows` (B) overrides `tile_rows`. Shapes as in `experts_dense_reference`. `scales`: int8
    gate, up and down with their per-channel scales `[E, F]`, `[E, F]`, `[E, D]` (`models.int8`):
    each tile's int8 weights are converted to x's dtype in the dot, its scales applied after;
    or 4-bit ones with group scales `[E, in / G, out]`. `offsets`: affine 4-bit stacks' offsets
    in their scales' layouts (zero points, `models.int4`: `w = q * s + m`, None for a stack
    without), each tile adding its rows' group sums times its expert's offsets to the product.
    `up=None`: `gate` is a fused gate-and-up kernel `[E, D, F']` and `act` maps its `[.., F']`
    products to the `[.., F]` hidden values (GPT-OSS's clamped SwiGLU). `gate_bias [E, F']`: added
    to the gate (or fused) products before `act`. `weights_on_input`: as in
    `experts_dense_reference` (each assignment's row scaled before its expert, outputs summed).
    A kernel may be an `Mxfp4Stack` (GPT-OSS's mxfp4 experts): each tile's expert is dequantized
    to x's dtype for its dot. `input_order [E, D]` int32 (GPTQ activation order,
    `models.gptq_expert_orders`): row r of expert e's gate and up kernels weighs input
    `input_order[e, r]`, so each tile's rows are gathered into its expert's order for those two
    products. The tiles run in chunks (`tile_chunks`, a loop over them when more
    than one) so that the expert kernels gathered for one chunk's tiles stay within
    `max_chunk_elements`, whatever the step's token count. A step of at most `MAX_TILE_ROWS`
    tokens whose routed tiles would outnumber the experts may run one tile of every token per
    expert instead, each expert's kernels read once: where that pays, by the step's shape and
    the platform (`models.moe_layout.every_token_pays`); `every_token_tiles` True or False
    decides it (tests). An expert id of E (another device's expert) adds nothing.
    """
    t = x.shape[0]
    e, k = gate.shape[0], experts.shape[1]
    b = rows or tile_rows(t * k, e)
    tiles = num_tiles(t * k, e, b)
    on_cpu, elsewhere = _every_token_layouts(t, e, tiles, b, _weight_bits(gate), every_token_tiles)
    kernel_elements = max(math.prod(w.shape[1:]) for w in (gate, up, down) if w is not None)
    scale_of = (None, None, None) if scales is None else scales
    offset_of = (None, None, None) if offsets is None else offsets

    def tile_dot(spec: str, rows_in: jax.Array, ids: jax.Array, which: int) -> jax.Array:
        kernel, scale, offset = (gate, up, down)[which], scale_of[which], offset_of[which]
        if isinstance(kernel, Mxfp4Stack):
            return kernel.tile_matmul(rows_in, ids)
        if scale is None:
            return jnp.einsum(spec, rows_in, kernel[ids])
        if scale.ndim == 3:  # `[E, in / G, out]`: a scale per group of inputs of each column
            product = grouped_tile_dot(rows_in, kernel[ids], scale[ids])
        else:
            product = jnp.einsum(
                spec, rows_in, kernel[ids].astype(x.dtype), preferred_element_type=jnp.float32
            )
            product = product * scale[ids][:, None, :]
        if offset is not None:
            product = product + tile_offset_product(rows_in, offset[ids])
        return product.astype(x.dtype)

    def tiles_hidden(rows_in: jax.Array, ids: jax.Array | slice) -> jax.Array:
        """`rows_in [C, B, D]` through the gate and up kernels of the experts `ids [C]` -> `[C, B, F]`."""
        if input_order is not None:  # each tile's inputs in its expert's order of gate/up rows
            rows_in = jax.vmap(lambda rows, order: rows[:, order])(rows_in, input_order[ids])
        h = tile_dot("nbd,ndf->nbf", rows_in, ids, 0)
        if gate_bias is not None:
            h = h + gate_bias[ids][:, None, :].astype(h.dtype)
        h = act(h)
        if up is not None:
            h = h * tile_dot("nbd,ndf->nbf", rows_in, ids, 1)  # [C, B, F]
        return h

    def tiles_mlp(rows_in: jax.Array, ids: jax.Array) -> jax.Array:
        """`rows_in [C, B, D]` through the experts `ids [C]` -> `[C, B, D]`."""
        return tile_dot("nbf,nfd->nbd", tiles_hidden(rows_in, ids), ids, 2)

    def every_token_sum() -> jax.Array:
        """Each expert on every token, in place of a gather of its rows, combined by weight."""
        layout = every_token_rows(weights, experts, e, weights_on_input=weights_on_input)
        w = layout.weight.reshape(e, t)  # [E, T]
        rows_in = jnp.broadcast_to(x, (e, *x.shape))  # [E, T, D]
        if layout.input_scale is not None:
            rows_in = (rows_in.astype(jnp.float32) * layout.input_scale.reshape(e, t, 1)).astype(x.dtype)
        h = tiles_hidden(rows_in, slice(None))  # [E, T, F]
        # The weights folded into the down matmul's sum over the experts: no `[E, T, D]` outputs
        # are made (a kernel with per-expert output scales or offsets needs each expert's first).
        hw = h * w[:, :, None].astype(h.dtype)
        if isinstance(down, Mxfp4Stack):
            return down.tile_matmul(hw, slice(None), summed=True)
        if scale_of[2] is None and offset_of[2] is None:
            return jnp.einsum("etf,efd->td", hw, down, preferred_element_type=jnp.float32).astype(x.dtype)
        y = tile_dot("nbf,nfd->nbd", h, slice(None), 2)  # [E, T, D]
        return jnp.einsum("etd,et->td", y.astype(jnp.float32), w).astype(x.dtype)

    def run(every_token: bool) -> jax.Array:
        if every_token:
            return every_token_sum()
        chunks, per_chunk = tile_chunks(tiles, kernel_elements, max_chunk_elements)
        layout = routed_rows(weights, experts, e, b, chunks * per_chunk, weights_on_input=weights_on_input)
        return tiles_sum(x, layout, b, (chunks, per_chunk), tiles_mlp)

    if on_cpu == elsewhere:
        return run(on_cpu)
    # Static per step shape: the one branch of the platform lowered is compiled.
    return jax.lax.platform_dependent(cpu=lambda: run(on_cpu), default=lambda: run(elsewhere))


def _every_token_layouts(
    tokens: int, experts: int, tiles: int, rows: int, weight_bits: int, wanted: bool | None
) -> tuple[bool, bool]:
    """(on CPU, elsewhere): whether the every-token tiles run, `wanted` (True or False) where
    they can (fewer tiles than the routed ones, at most MAX_TILE_ROWS tokens), else where they
    pay (`models.moe_layout.every_token_pays`)."""
    if wanted is None:
        return every_token_pays(tokens, experts, tiles, rows, weight_bits)
    possible = wanted and experts < tiles and tokens <= MAX_TILE_ROWS
    return possible, possible


def _weight_bits(kernel: jax.Array | Mxfp4Stack) -> int:
    """Bits a weight of an expert stack takes (4 for mxfp4, int4's 4 as held on TPU and GPU)."""
    if isinstance(kernel, Mxfp4Stack):
        return 4
    dtype = jnp.dtype(kernel.dtype)
    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits


def experts_routed_on_mesh(
    mesh: Mesh,
    x: jax.Array,
    stacks: tuple[jax.Array, jax.Array, jax.Array],
    weights: jax.Array,
    experts: jax.Array,
    act: Callable[[jax.Array], jax.Array],
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    gate_bias: jax.Array | None = None,
    weights_on_input: bool = False,
    offsets: tuple[jax.Array | None, jax.Array | None, jax.Array | None] | None = None,
    input_order: jax.Array | None = None,
) -> jax.Array:
    """`experts_routed` with each expert split over `mesh`'s model axis (gate/up on F, down on F,
    as `models.sharding` places them): each device combines its partial outputs into `[T, D]`
    with the routing weights, then one sum over the devices. Left to XLA, the split down
    projection is summed over the routed `[tiles * rows, D]` rows, before the combine: top-k
    times the bytes. `up` (None), `gate_bias`, `offsets` and `input_order` (whole on every
    device) as in `experts_routed`: a fused kernel's columns split like gate's, so each
    device's `act` must see whole units of its own;
    offsets split like their scales (a device's group sums over its own share of down's inputs
    are its part of the sum)."""
    whole, split_f = PartitionSpec(), PartitionSpec(None, None, MODEL_AXIS)
    stack_specs = (split_f, split_f, PartitionSpec(None, MODEL_AXIS, None))
    # Per-channel scales: gate/up `[E, F]` split like their columns, down's `[E, D]` whole;
    # grouped ones (`[E, in / G, out]`) like their kernels: gate/up on F, down on its F groups.
    scale_specs = (PartitionSpec(None, MODEL_AXIS), PartitionSpec(None, MODEL_AXIS), whole)
    if scales is not None and scales[0].ndim == 3:
        scale_specs = stack_specs
    # An mxfp4 stack (blocks and scales `[E, out, in / 32, ..]`): gate/up split on their
    # outputs, down on its input blocks.
    mxfp4_specs = (PartitionSpec(None, MODEL_AXIS), PartitionSpec(None, MODEL_AXIS), split_f)
    stack_specs = tuple(
        mx if isinstance(s, Mxfp4Stack) else spec
        for s, spec, mx in zip(stacks, stack_specs, mxfp4_specs, strict=True)
    )

    def local(x, stacks, weights, experts, gate_bias, offsets, input_order, *scales):
        partial = experts_routed(
            x, *stacks, weights, experts, act, scales=scales or None, gate_bias=gate_bias,
            weights_on_input=weights_on_input, offsets=offsets, input_order=input_order,
        )  # fmt: skip
        return jax.lax.psum(partial, MODEL_AXIS)

    extra, extra_specs = (scales, scale_specs) if scales is not None else ((), ())
    offsets = (None, None, None) if offsets is None else offsets
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            whole,
            stack_specs,
            whole,
            whole,
            PartitionSpec(None, MODEL_AXIS),
            scale_specs,
            whole,
            *extra_specs,
        ),
        out_specs=whole,
        check_vma=False,
    )(x, stacks, weights, experts, gate_bias, tuple(offsets), input_order, *extra)


def experts_by_index(
    x: jax.Array,
    stacks: tuple[jax.Array, jax.Array | None, jax.Array],
    weights: jax.Array,
    experts: jax.Array,
    act: Callable[[jax.Array], jax.Array],
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    gate_bias: jax.Array | None = None,
    weights_on_input: bool = False,
    down_bias: jax.Array | None = None,
    offsets: tuple[jax.Array | None, jax.Array | None, jax.Array | None] | None = None,
    input_order: jax.Array | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    over_replicas: bool = False,
) -> jax.Array:
    """`experts_routed` under expert parallelism: every expert array split on its expert axis,
    each device holding its E / N experts whole (`models.sharding.EXPERT_PARALLEL_RULE`; device
    i experts `i * E / N ..`). Each device runs its own experts on the assignments routed to them
    (the others' sent to expert id E / N, in no tile, weight 0), and sums combine them: no token
    or weight moves before them. `down_bias [E, D]` (GPT-OSS): added once per chosen expert, by
    the device holding it. Other arguments as in `experts_routed_on_mesh`.

    On `mesh`'s model axis (one replica's N devices) the tokens and their routing are on every
    device (attention's sum left them replicated), and one `[T, D]` sum over the devices
    combines their parts: the split experts' all-reduce. `over_replicas` (run inside a
    `shard_map` manual over `DATA_AXIS`, `tpu_platform.replica_step`; `mesh` the replica's own,
    None for a device a replica): `x` and its routing are this replica's own tokens, the stacks
    its devices' experts (replica r holding experts `r * E / R ..`). Every replica's tokens and
    routing are gathered, each device runs its own experts on them, and the sums are scattered
    back, each replica keeping its own rows: an all-gather and a reduce-scatter of `[T, D]` a
    replica. Per token of a replica they move 2 (R - 1) rows (to each other replica and back); a
    ragged all-to-all would move its k routed rows out and back, those on other replicas:
    2k (R - 1) / R. So R / k times the all-to-all's bytes: the same at R = k (top-8 models over
    8 replicas), fewer below, more above, with no ragged sizes to exchange first and no device
    waiting on the busiest expert's rows."""
    replica = jnp.zeros((), jnp.int32)
    if over_replicas:
        x, weights, experts = (jax.lax.all_gather(a, DATA_AXIS, tiled=True) for a in (x, weights, experts))
        replica = jax.lax.axis_index(DATA_AXIS)
    offsets = (None, None, None) if offsets is None else tuple(offsets)
    own = _own_experts(act, weights_on_input)
    extra = scales or ()
    if mesh is None:  # a device a replica
        partial = own(replica, x, stacks, weights, experts, gate_bias, down_bias, offsets, input_order, extra)
    else:  # each of the devices its own experts, by hand: one sum over them
        devices = mesh.shape[MODEL_AXIS]

        def local(replica, x, stacks, weights, experts, gate_bias, down_bias, offsets, input_order, *scales):
            device = replica * devices + jax.lax.axis_index(MODEL_AXIS)
            partial = own(
                device, x, stacks, weights, experts, gate_bias, down_bias, offsets, input_order, scales
            )
            return jax.lax.psum(partial, MODEL_AXIS)

        split, whole = PartitionSpec(MODEL_AXIS), PartitionSpec()
        partial = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(whole, whole, split, whole, whole, split, split, split, split, *(split for _ in extra)),
            out_specs=whole,
            check_vma=False,
        )(replica, x, stacks, weights, experts, gate_bias, down_bias, offsets, input_order, *extra)
    if not over_replicas:
        return partial
    return jax.lax.psum_scatter(partial, DATA_AXIS, scatter_dimension=0, tiled=True)


def _own_experts(act: Callable[[jax.Array], jax.Array], weights_on_input: bool) -> Callable:
    """One device's part of the experts split by index: `(device, x, stacks, ...)` runs the
    device's `count` experts (ids `device * count ..`) on the assignments routed to them (the
    others' sent to id `count`, in no tile, weight 0), its down bias added once per chosen
    expert it holds; the `[T, D]` partial sum, to be summed over the devices."""

    def own(device, x, stacks, weights, experts, gate_bias, down_bias, offsets, input_order, scales):
        count = stacks[0].shape[0]
        ids = experts - device * count
        mine = (ids >= 0) & (ids < count)
        weights = jnp.where(mine, weights, 0.0)
        partial = experts_routed(
            x, *stacks, weights, jnp.where(mine, ids, count), act, scales=scales or None,
            gate_bias=gate_bias, weights_on_input=weights_on_input, offsets=offsets,
            input_order=input_order,
        )  # fmt: skip
        if down_bias is not None:
            ids = jnp.where(mine, ids, 0)
            bias = jnp.einsum("tk,tkd->td", weights, down_bias[ids].astype(jnp.float32))
            partial = (partial.astype(jnp.float32) + bias).astype(x.dtype)
        return partial

    return own


class StackedLinear(nnx.Module):
    """One `[in, out]` kernel per expert, stacked `[E, in, out]` (filled expert by expert on load);
    int8 and fp8 kernels have their per-channel scales `[E, out]` in `kernel_scale`
    (`models.int8`), or a block fp8 or 4-bit checkpoint's `[E, in / G, out]` (`models.fp8`,
    `models.int4`); affine 4-bit ones (zero points) their offsets in `kernel_offset`, the
    scale's layout. A gate stack whose experts' rows a GPTQ act-order checkpoint sorted has each
    expert's order in `input_order` (int32 `[E, in]`, up's rows in it too:
    `models.gptq_expert_orders`)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dtype: jnp.dtype):
        self.kernel = nnx.Param(np.zeros((num_experts, in_features, out_features), dtype))  # until loaded
        self.kernel_scale: nnx.Param | None = nnx.data(None)
        self.kernel_offset: nnx.Param | None = nnx.data(None)
        self.input_order: nnx.Param | None = nnx.data(None)


class Experts(nnx.Module):
    """The E gated expert MLPs: gate/up `[E, D, F]`, down `[E, F, D]`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: jnp.dtype):
        self.gate_proj = StackedLinear(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.up_proj = StackedLinear(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.down_proj = StackedLinear(num_experts, intermediate_size, hidden_size, dtype=dtype)


class SparseMoE(nnx.Module):
    """Router `[D, E]` + experts; `x[T, D] -> [T, D]` through the routed path. A subclass whose
    routing weights scale the experts' inputs (Llama 4) sets `weights_on_input`."""

    weights_on_input: ClassVar[bool] = False
    # Experts split by index over the step's mesh (`use_expert_parallel`), else inside each expert.
    expert_parallel: bool = False

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool,
        dtype: jnp.dtype,
        act: str = "silu",
    ):
        activation(act)  # fail at build time on an unknown name
        self.router = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.top_k, self.renormalize, self.act = top_k, renormalize, act

    @classmethod
    def from_config(
        cls, config: ModelConfig, intermediate_size: int, *, renormalize: bool, dtype: jnp.dtype
    ) -> SparseMoE:
        """`config.num_experts` experts of `intermediate_size`, top `num_experts_per_tok`, `hidden_act`."""
        return cls(
            config.hidden_size, intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=renormalize, dtype=dtype, act=config.hidden_act,
        )  # fmt: skip

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Routing weights `[T, k]` (float32) and expert ids `[T, k]` for `x[T, D]`: the softmax
        top-k of `route` (a subclass may route otherwise: `models.deepseek_moe`)."""
        return route(self.router(x), self.top_k, renormalize=self.renormalize)

    def _stacks(self) -> tuple[StackedLinear, StackedLinear, StackedLinear]:
        ex = self.experts
        return ex.gate_proj, ex.up_proj, ex.down_proj

    def __call__(
        self, x: jax.Array, md: AttentionMetadata | None = None, *, dense: bool = False
    ) -> jax.Array:
        """`md`: the step's metadata (its mesh splits the experts: by index under
        `expert_parallel`, `experts_by_index`; else inside each, `experts_routed_on_mesh`,
        when the rules table could split them: F divisible by the TP size, else they are whole).
        `dense=True` runs `experts_dense_reference` instead (tests; int8 weights dequantized)."""
        return self.run_experts(x, *self.select_experts(x), md, dense=dense)

    def run_experts(
        self,
        x: jax.Array,
        weights: jax.Array,
        experts: jax.Array,
        md: AttentionMetadata | None = None,
        *,
        dense: bool = False,
    ) -> jax.Array:
        """The experts on `x [T, D]` with routing `weights`, `experts [T, k]` chosen already (a
        model whose router reads another input than its experts: Gemma 4); `md`, `dense` as in
        `__call__`."""
        stacks, act = self._stacks(), activation(self.act)
        expert_load.record(self, experts, stacks[0].kernel.shape[0], md)
        int8 = stacks[0].kernel_scale is not None
        offsets = tuple(None if s.kernel_offset is None else s.kernel_offset[...] for s in stacks)
        order = None if stacks[0].input_order is None else stacks[0].input_order[...]
        if dense:
            kernels = [_dequantized(s, x.dtype) if int8 else s.kernel[...] for s in stacks]
            if order is not None:  # gate's and up's rows back in the inputs' own order
                kernels[:2] = [jax.vmap(lambda w, o: w[jnp.argsort(o)])(k, order) for k in kernels[:2]]
            return experts_dense_reference(
                x, *kernels, weights, experts, act, weights_on_input=self.weights_on_input
            )
        scales = tuple(s.kernel_scale[...] for s in stacks) if int8 else None
        kernels = tuple(s.kernel[...] for s in stacks)
        options = dict(weights_on_input=self.weights_on_input, offsets=offsets, input_order=order)
        if md is not None and (md.mesh is not None or md.replicas > 1) and self.expert_parallel:
            return experts_by_index(
                x,
                kernels,
                weights,
                experts,
                act,
                scales,
                mesh=md.mesh,
                over_replicas=md.replicas > 1,
                **options,
            )
        if md is not None and md.mesh is not None and kernels[0].shape[2] % md.tp_size == 0:
            return experts_routed_on_mesh(md.mesh, x, kernels, weights, experts, act, scales, **options)
        return experts_routed(x, *kernels, weights, experts, act, scales=scales, **options)


def _dequantized(stack: StackedLinear, dtype: jnp.dtype) -> jax.Array:
    """A quantized expert stack's weights in `dtype` (`q * s`, plus the offsets when affine)."""
    if stack.kernel_offset is None:
        return dequantize(stack.kernel[...], stack.kernel_scale[...], dtype)
    return dequantize_affine(stack.kernel[...], stack.kernel_scale[...], stack.kernel_offset[...], dtype)


def use_expert_parallel(model: nnx.Module) -> int:
    """Has every mixture of experts in `model` (a module with an `expert_parallel` flag: `SparseMoE`
    and its subclasses, GPT-OSS's) run its experts split by index over the step's mesh, as
    `models.sharding` places them with `expert_parallel=True`. Returns how many it set."""
    layers = [module for _, module in nnx.iter_graph(model) if hasattr(type(module), "expert_parallel")]
    for module in layers:
        module.expert_parallel = True
    return len(layers)
