# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel placement of a model's parameters: one rules table, and what follows from it.

Every supported architecture names its parameters alike (Llama's layout: `self_attn.*_proj`,
`mlp.*_proj`, `embed_tokens`, `lm_head`, `mlp.experts.*`), so one table serves the decoder
family. The mesh has one axis, `MODEL_AXIS` (vLLM's `tensor_parallel_size`):

- column-parallel (output features split): q/k/v and the fused `qkv_proj`, gate/up and the fused
  `gate_up_proj`, with their biases. The fused kernels are built so that each device's slice is
  its own whole heads (`[q_i, k_i, v_i]` blocks) and its own `[gate_i, up_i]` columns
  (`linear.Linear.concatenated(blocks=N)`), so attention and the activation need no exchange;
- row-parallel (input features split): `o_proj` and `down_proj`; XLA sums the partial products
  (one all-reduce per block); their biases are replicated (added once, after the sum);
- LoRA adapter slots follow their projection: a column-parallel one's `b` split on its
  outputs, a row-parallel one's `a` on its inputs, each device updating its own slice; the
  small rank-side factor is replicated;
- an int8 kernel's scale (`kernel_scale`, a tied head's `head_scale`) follows its kernel: per
  output channel (`[out]`) split where the columns are, replicated for the row-parallel ones;
  grouped (`[in / G, out]`, `GROUPED_SCALE_RULES`) split on its last axis for the
  column-parallel ones and on its groups for the row-parallel ones, whose every device must
  then hold whole groups of inputs (else `parameter_spec` refuses the TP size by name); an
  affine int4 kernel's offsets (`kernel_offset`, the scale's layout) are split like its scale;
  a reordered kernel's input order (`input_order`, GPTQ's activation order) is whole on every
  device (the gather of a row-parallel layer's inputs then reads across devices: XLA moves them),
  and so are an expert stack's orders (`[E, D]`, by expert under expert parallelism);
- vocab-parallel: the embedding table (rows; the lookup is masked per device and summed,
  `layers.Embedding`) and the LM head (columns: each device computes its vocabulary slice of
  the logits, gathered before sampling);
- MoE experts on the model axis, split inside each expert (gate/up on F, down on F), as vLLM's
  tensor parallelism does without expert parallelism: it works for any expert count (8 experts
  on 8 devices or 128), keeps the routed grouped matmul unchanged (no all-to-all of tokens), and
  balances the work whatever the router picks; the router is replicated;
- Gated DeltaNet (`models.gated_deltanet`): its input projections column-parallel (whole key
  heads a device, with their value heads), `out_proj` row-parallel, A_log and dt_bias split on
  the value heads; its conv weight (a few taps a channel) whole on every device;
- everything else (norms, router, RoPE tables, a shared expert's gate) is replicated.

Expert parallelism (`expert_parallel=True`, vLLM's `--enable-expert-parallel`) replaces the
experts' rules with one: every array under `.experts.` (kernels, scales, GPT-OSS's biases) is
split on its expert axis, so each of the N devices holds E / N whole experts (device i experts
`i * E / N` to `(i + 1) * E / N - 1`); the router and DeepSeek's and Llama 4's shared experts
keep the rules above. E must divide by N (`check_model_splits` refuses it by name); the experts'
intermediate size then need not.

A vocabulary the mesh does not divide is not split (a tiny test model's, say): `parameter_spec`
replicates it, and `vocab_parallel` tells the embedding so. Every other dimension a rule splits
(heads, KV heads up to replication, the MLP's and the experts' intermediate sizes) must divide:
`check_model_splits` refuses the TP size at start, naming the dimension and the sizes that work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig

MODEL_AXIS = "model"
# Data-parallel replicas in one program (`tpu_platform.replica_step`): a mesh of D x N devices,
# each replica's N on the model axis. Only expert-parallel experts are split over it.
DATA_AXIS = "data"

_COLUMN = PartitionSpec(None, MODEL_AXIS)
_ROW = PartitionSpec(MODEL_AXIS, None)
_SPLIT = PartitionSpec(MODEL_AXIS)
_REPLICATED = PartitionSpec()

# `q_b_proj` and `kv_b_proj`: latent attention's per-head up-projections (`models.latent_attention`);
# `in_proj_*`: Gated DeltaNet's input projections, whose features are per head (`models.gated_deltanet`).
_COLUMN_LINEARS = (
    r"(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|q_b_proj|kv_b_proj|in_proj_[a-z]+)"
)
_ROW_LINEARS = r"(o_proj|down_proj|out_proj)"

# (pattern over a parameter's dotted path, its PartitionSpec); the first match wins.
DECODER_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    (r"\.experts\.(gate_proj|up_proj)\.kernel$", PartitionSpec(None, None, MODEL_AXIS)),  # [E, D, F]
    (r"\.experts\.down_proj\.kernel$", PartitionSpec(None, MODEL_AXIS, None)),  # [E, F, D]
    # int8 kernels' per-output-channel scales: split like their kernel's columns
    (r"\.experts\.(gate_proj|up_proj)\.kernel_(scale|offset)$", PartitionSpec(None, MODEL_AXIS)),  # [E, F]
    # GPT-OSS: fused experts in the checkpoint's layout, gate/up pairs interleaved on the last axis
    (r"\.experts\.gate_up_proj$", PartitionSpec(None, None, MODEL_AXIS)),  # [E, D, 2F]
    (r"\.experts\.gate_up_proj_bias$", PartitionSpec(None, MODEL_AXIS)),  # [E, 2F]
    (r"\.experts\.down_proj$", PartitionSpec(None, MODEL_AXIS, None)),  # [E, F, D]
    # its mxfp4 experts (`models.mxfp4`), `[out, in]`: gate/up on their outputs, down on its input blocks
    (r"\.experts\.gate_up_proj_(blocks|scales)$", PartitionSpec(None, MODEL_AXIS)),  # [E, 2F, D / 32, ..]
    (r"\.experts\.down_proj_(blocks|scales)$", PartitionSpec(None, None, MODEL_AXIS)),  # [E, D, F / 32, ..]
    (r"\.self_attn\.sinks$", _SPLIT),  # [N], with the query heads
    (r"\.linear_attn\.(A_log|dt_bias)$", _SPLIT),  # [Hv], with the value heads
    (rf"\.{_COLUMN_LINEARS}\.kernel$", _COLUMN),  # [D, out]
    (rf"\.{_COLUMN_LINEARS}\.(bias|kernel_scale|kernel_offset)$", _SPLIT),
    (rf"\.{_ROW_LINEARS}\.kernel$", _ROW),  # [in, D]
    (rf"\.{_ROW_LINEARS}\.bias$", _REPLICATED),
    # LoRA slots (`models.lora`): B split on its outputs like a column-parallel kernel, A on its
    # inputs like a row-parallel one; the other factor, `[S, in, P * R]` or `[S, P * R, out]`
    # of a small rank, whole
    (rf"\.{_COLUMN_LINEARS}\.lora\.b$", PartitionSpec(None, None, MODEL_AXIS)),  # [S, P * R, out]
    (rf"\.{_ROW_LINEARS}\.lora\.a$", PartitionSpec(None, MODEL_AXIS, None)),  # [S, in, P * R]
    (r"embed_tokens\.embedding$", _ROW),  # [V, D]
    (r"embed_tokens\.head_kernel$", _COLUMN),  # [D, V], a tied head's copy
    (r"embed_tokens\.head_scale$", _SPLIT),  # [V], its int8 scales
    # LM heads, a multi-token-prediction layer's `shared_head` too (`models.mtp`)
    (r"(lm_head|shared_head)\.kernel$", _COLUMN),  # [D, V]
    (r"(lm_head|shared_head)\.kernel_scale$", _SPLIT),  # [V]
    (r".*", _REPLICATED),
)
# int8 scales of one per group of inputs and output (`[in / G, out]`, `models.int8`): a
# 2-D `kernel_scale` or `head_scale` outside the experts (theirs are per channel, `[E, out]`).
GROUPED_SCALE_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    # a block fp8 or 4-bit checkpoint's experts (`[E, in / G, out]`, `models.fp8`, `models.int4`)
    # and affine 4-bit ones' offsets: split like their kernels
    (r"\.experts\.(gate_proj|up_proj)\.kernel_(scale|offset)$", PartitionSpec(None, None, MODEL_AXIS)),
    (r"\.experts\.down_proj\.kernel_(scale|offset)$", PartitionSpec(None, MODEL_AXIS, None)),
    (rf"\.{_COLUMN_LINEARS}\.kernel_(scale|offset)$", _COLUMN),
    (rf"\.{_ROW_LINEARS}\.kernel_(scale|offset)$", _ROW),
    (r"embed_tokens\.head_scale$", _COLUMN),
    (r"(lm_head|shared_head)\.kernel_scale$", _COLUMN),
    (r".*", _REPLICATED),
)
_GROUPED_ROW = PartitionSpec(None, MODEL_AXIS, None)  # an expert stack's grouped row-parallel scale
# Under expert parallelism: every expert array split on its expert axis (`[E, ...]`).
EXPERT_PARALLEL_RULE = (r"\.experts\.", _SPLIT)
_COMPILED_RULES = tuple((re.compile(pattern), spec) for pattern, spec in DECODER_RULES)
_COMPILED_GROUPED = tuple((re.compile(pattern), spec) for pattern, spec in GROUPED_SCALE_RULES)
_SCALE = re.compile(r"(kernel_scale|kernel_offset|head_scale)$")
_EXPERTS = re.compile(EXPERT_PARALLEL_RULE[0])


def is_grouped_scale(path: str, ndim: int) -> bool:
    """Whether the parameter at dotted `path` with `ndim` axes is a weight scale per group of
    inputs (`[in / G, out]`, an expert stack's `[E, in / G, out]`)."""
    if _SCALE.search(path) is None:
        return False
    return ndim == (3 if _EXPERTS.search(path) else 2)


def rule_spec(path: str, ndim: int | None = None) -> PartitionSpec:
    """The rules table's PartitionSpec for the parameter at dotted `path` (before divisibility);
    `ndim`, its axes when known, tells a grouped int8 scale from a per-channel one."""
    rules = _COMPILED_GROUPED if ndim is not None and is_grouped_scale(path, ndim) else _COMPILED_RULES
    for pattern, spec in rules:
        if pattern.search(path):
            return spec
    return _REPLICATED  # unreachable: the last rule matches everything


def parameter_spec(
    path: str, shape: tuple[int, ...], tp_size: int, *, expert_parallel: bool = False
) -> PartitionSpec:
    """The PartitionSpec of the parameter at dotted `path` (e.g. `model.layers.0.self_attn.
    qkv_proj.kernel`) of `shape` on a mesh of `tp_size` devices along `MODEL_AXIS`;
    `expert_parallel`: the experts' arrays by expert index instead (`EXPERT_PARALLEL_RULE`), a
    ValueError when `tp_size` does not divide their expert count.

    The rule's split dimensions, unless `tp_size` is 1 or does not divide one of them: then the
    parameter is replicated (one device holds it whole). This is the one lookup for placing,
    checking and restoring parameters.

    A row-parallel kernel's grouped int8 scale (`[in / G, out]`) whose groups `tp_size` does not
    divide is a ValueError: a device's share of the inputs would end inside a group.
    """
    if tp_size > 1 and expert_parallel and _EXPERTS.search(path):
        check_expert_parallel(shape[0], tp_size)
        return _SPLIT
    spec = rule_spec(path, len(shape))
    if tp_size == 1 or not spec:
        return _REPLICATED
    if spec in (_ROW, _GROUPED_ROW) and is_grouped_scale(path, len(shape)) and shape[-2] % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split {path}: its kernel's inputs are in "
            f"{shape[-2]} groups sharing a weight scale (int8, fp8 or int4), which do not divide by "
            f"{tp_size}, so a device's share would end inside a group; use a "
            f"tensor_parallel_size dividing {shape[-2]}"
        )
    for axis, name in enumerate(spec):
        if name is not None and (axis >= len(shape) or shape[axis] % tp_size):
            return _REPLICATED
    return spec


def check_expert_parallel(num_experts: int, ep_size: int, *, replicas: int = 1) -> None:
    """A ValueError naming the fix when `num_experts` do not split into `ep_size` equal shares
    (`replicas`: the data-parallel replicas among them, `ep_size / replicas` devices each)."""
    if num_experts % ep_size:
        sizes = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        group, fix = f"tensor_parallel_size={ep_size}", f"--tensor-parallel-size one of {sizes}"
        if replicas > 1:
            group = f"data_parallel_size={replicas} x tensor_parallel_size={ep_size // replicas}"
            fix = f"sizes whose product is one of {sizes}"
        raise ValueError(
            f"--enable-expert-parallel with {group} cannot split this model's {num_experts} "
            f"experts by index: {num_experts} does not divide by {ep_size}; use {fix}, or leave "
            "expert parallelism off"
        )


def parameter_sharding(
    path: str, shape: tuple[int, ...], mesh: Mesh, *, expert_parallel: bool = False
) -> NamedSharding:
    """`parameter_spec` on `mesh` (its `MODEL_AXIS` size is the TP size). On a mesh with a
    `DATA_AXIS` of D replicas, every parameter is whole in each replica and placed within it as
    on its own N devices, except the experts under `expert_parallel`: split by index over all
    D x N devices, replica by replica (replica r's device i holds share r * N + i)."""
    replicas = dict(mesh.shape).get(DATA_AXIS, 1)
    if replicas > 1 and expert_parallel and _EXPERTS.search(path):
        check_expert_parallel(shape[0], replicas * mesh.shape[MODEL_AXIS], replicas=replicas)
        return NamedSharding(mesh, PartitionSpec((DATA_AXIS, MODEL_AXIS)))
    spec = parameter_spec(path, shape, mesh.shape[MODEL_AXIS], expert_parallel=expert_parallel)
    return NamedSharding(mesh, spec)


def addressable_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> frozenset[int] | None:
    """The indices along the first axis of an array of `shape` placed with `sharding` that this
    process's devices hold (an expert stack's experts, one host of several); None when they hold
    every row."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])) if index else range(shape[0]))
    return None if len(rows) == shape[0] else frozenset(rows)


def addressable_box(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The part of an array of `shape` placed with `sharding` that this process's devices hold,
    as one slice an axis, when their shares tile exactly such a box smaller than the array (one
    host's devices on one split axis); None otherwise (read it whole)."""
    shares = {
        tuple(index[axis].indices(size)[:2] for axis, size in enumerate(shape))
        for index in sharding.addressable_devices_indices_map(shape).values()
    }
    if not shape or not shares:
        return None
    box = tuple((min(s[a][0] for s in shares), max(s[a][1] for s in shares)) for a in range(len(shape)))
    volume = lambda ranges: int(np.prod([stop - start for start, stop in ranges]))  # noqa: E731
    if volume(box) == int(np.prod(shape)) or sum(map(volume, shares)) != volume(box):
        return None
    return tuple(slice(start, stop) for start, stop in box)


def state_shardings(state: nnx.State, mesh: Mesh, *, expert_parallel: bool = False):
    """A `NamedSharding` for every leaf of a model's `state` (same tree), for placing or
    restoring it onto `mesh`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: parameter_sharding(
            key_path_name(path), np.shape(leaf), mesh, expert_parallel=expert_parallel
        ),
        state,
    )


def key_path_name(path: tuple) -> str:
    """A JAX key path into a model's state as the dotted name the rules match
    (`model.layers.0.self_attn.qkv_proj.kernel`)."""
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.GetAttrKey) and entry.name != "value":
            parts.append(entry.name)
    return ".".join(parts)


def place_state(state: nnx.State, mesh: Mesh, *, expert_parallel: bool = False) -> nnx.State:
    """`state` (host or device arrays) on `mesh`, leaf by leaf straight to its sharding: a device
    receives only its own slice of a split weight (its own experts under `expert_parallel`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(
            leaf,
            parameter_sharding(key_path_name(path), np.shape(leaf), mesh, expert_parallel=expert_parallel),
        ),
        state,
    )


def vocab_parallel(vocab_size: int, tp_size: int) -> bool:
    """Whether the embedding and head are split on the vocabulary (`parameter_spec`'s rule)."""
    return tp_size > 1 and vocab_size % tp_size == 0


def kv_heads_on_mesh(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """The KV heads the sharded model keeps: `num_kv_heads` when `tp_size` divides them, else
    `tp_size` (each head repeated `tp_size // num_kv_heads` times, one per device, as vLLM
    does). A ValueError names what does not divide and the sizes that work."""
    check_tensor_parallel(num_heads, num_kv_heads, tp_size)
    return num_kv_heads if num_kv_heads % tp_size == 0 else tp_size


def check_tensor_parallel(
    num_heads: int, num_kv_heads: int, tp_size: int, dimensions: Sequence[tuple[str, int]] = ()
) -> None:
    """Raises a ValueError naming the fix when a model of these heads, and of these other split
    `dimensions` (`split_dimensions`: name, size), cannot run at `tp_size`."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")

    def fits(n: int) -> bool:
        return _heads_fit(num_heads, num_kv_heads, n) and all(size % n == 0 for _, size in dimensions)

    if fits(tp_size):
        return
    if num_heads % tp_size:
        reason = f"its {num_heads} query heads do not divide by {tp_size}"
    elif not _heads_fit(num_heads, num_kv_heads, tp_size):
        reason = f"its {num_kv_heads} KV heads neither divide by {tp_size} nor divide it (replication)"
    else:
        name, size = next((name, size) for name, size in dimensions if size % tp_size)
        reason = f"its {name} ({size}) does not divide by {tp_size}"
    sizes = [n for n in range(1, num_heads + 1) if fits(n)]
    raise ValueError(
        f"tensor_parallel_size={tp_size} cannot shard this model: {reason}; "
        f"use --tensor-parallel-size one of {sizes}"
    )


def split_dimensions(config: ModelConfig, *, expert_parallel: bool = False) -> tuple[tuple[str, int], ...]:
    """The model's dimensions besides its heads that the rules table splits over the devices and
    that must divide by the TP size: the MLP's intermediate size (gate/up columns, down rows, the
    fused gate/up built in per-device blocks) where a layer has a dense MLP, and the experts'
    (`moe_intermediate_size`; Mixtral's `intermediate_size`). The vocabulary is not among them: a
    vocabulary the mesh does not divide is replicated (`vocab_parallel`), never cut.
    `expert_parallel`: the experts are whole (split by index), their size is not among them."""
    dimensions = []
    dense_everywhere = getattr(config, "dense_mlp_beside_experts", False)  # Gemma 4
    if dense_everywhere or any(not config.is_moe_layer(layer) for layer in range(config.num_layers)):
        dimensions.append(("intermediate_size", config.intermediate_size))
    if config.num_experts and not expert_parallel:
        dimensions.append(("experts' intermediate size", config.moe_intermediate_size))
    if getattr(config, "shared_expert_intermediate_size", 0):
        dimensions.append(("shared expert's intermediate size", config.shared_expert_intermediate_size))
    if getattr(config, "state_layers", ()):  # Gated DeltaNet: whole key heads a device
        dimensions.append(("linear_num_key_heads", config.linear_num_key_heads))
    dimensions.extend(_per_layer_kv_widths(config))
    return tuple(dimensions)


def _per_layer_kv_widths(config: ModelConfig) -> list[tuple[str, int]]:
    """A model whose layers differ in KV heads or head dim (Gemma 4) widens its k and v heads
    after projecting them rather than repeating them in the kernel, so each distinct k/v
    projection width (KV heads x head dim) is split as it is."""
    kv_heads, head_dims = getattr(config, "layer_kv_heads", None), getattr(config, "layer_head_dims", None)
    if not kv_heads or not head_dims:
        return []
    projecting = getattr(config, "first_kv_shared_layer", len(kv_heads))  # later layers reuse a cache
    widths: dict[int, int] = {}
    for layer, (k, h) in enumerate(zip(kv_heads[:projecting], head_dims[:projecting], strict=True)):
        widths.setdefault(k * h, layer)
    return [(f"layer {layer}'s k/v projection width", width) for width, layer in widths.items()]


def check_model_splits(config: ModelConfig, tp_size: int, *, expert_parallel: bool = False) -> None:
    """Raises a ValueError naming the dimension, its size and the TP sizes that work when a
    dimension the rules table splits (heads, KV heads, `split_dimensions`) does not split
    `tp_size` ways, or, under `expert_parallel`, the experts do not; at start, before any
    weight is read."""
    dimensions = split_dimensions(config, expert_parallel=expert_parallel)
    check_tensor_parallel(config.num_heads, config.num_kv_heads, tp_size, dimensions)
    if expert_parallel and config.num_experts:
        check_expert_parallel(config.num_experts, tp_size)


def _heads_fit(num_heads: int, num_kv_heads: int, tp_size: int) -> bool:
    return num_heads % tp_size == 0 and (num_kv_heads % tp_size == 0 or tp_size % num_kv_heads == 0)


def repeat_kv_heads(kernel: np.ndarray, num_kv_heads: int, repeats: int, *, axis: int) -> np.ndarray:
    """A k or v projection's `[.., K * H]` output features (on `axis`) with each head repeated
    `repeats` times in place (`k0 k0 k1 k1 ..`), so device i of `K * repeats` holds head
    `i // repeats`. NumPy or JAX arrays (abstract ones too: `nnx.eval_shape`)."""
    xp = np if isinstance(kernel, np.ndarray) else jax.numpy
    shape = kernel.shape
    head_dim = shape[axis] // num_kv_heads
    split = (*shape[:axis], num_kv_heads, 1, head_dim, *shape[axis + 1 :])
    heads = xp.reshape(kernel, split)
    tile = [1] * len(split)
    tile[axis + 1] = repeats
    repeated = (*shape[:axis], num_kv_heads * repeats * head_dim, *shape[axis + 1 :])
    return xp.reshape(xp.tile(heads, tile), repeated)


def interleave_blocks(parts: list[np.ndarray], blocks: int, *, axis: int):
    """`parts` concatenated on `axis` so that block j of the result is the j-th of `blocks`
    equal slices of every part, side by side (`[a_0 b_0 | a_1 b_1 | ..]`): split in `blocks`
    contiguous pieces, each device gets its own slice of every part. `blocks == 1`: plain
    concatenation. NumPy or JAX arrays."""
    xp = np if isinstance(parts[0], np.ndarray) else jax.numpy
    if blocks == 1:
        return xp.concatenate(parts, axis=axis)
    pieces = [xp.split(part, blocks, axis=axis) for part in parts]
    return xp.concatenate([piece[j] for j in range(blocks) for piece in pieces], axis=axis)


FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED = re.compile(r"\.(qkv_proj|gate_up_proj)\.(kernel|bias|kernel_scale|kernel_offset|input_order)$")


def shared_input_order(orders: Sequence) -> object | None:
    """The one input order (`Linear.input_order`) of projections fused into one, which read the
    same inputs: None when none reorders them; a ValueError naming the projections' orders when
    they differ (a fused kernel's rows have one order)."""
    if all(order is None for order in orders):
        return None
    first = orders[0]
    abstract = any(isinstance(order, jax.core.Tracer) for order in orders)  # under `nnx.eval_shape`
    if any(order is None for order in orders) or not (
        abstract or all(np.array_equal(np.asarray(order), np.asarray(first)) for order in orders[1:])
    ):
        raise ValueError(
            "the projections fused into one (q/k/v or gate/up) reorder their inputs differently "
            "(their checkpoint's g_idx differ): a fused kernel needs one input order; such a "
            "checkpoint is not served"
        )
    return first


def fused_parts(path: str) -> tuple[str, ...]:
    """The parameters a fused q/k/v or gate/up parameter at dotted `path` is made of, in order
    (`...qkv_proj.kernel` -> `...q_proj.kernel`, `...k_proj.kernel`, `...v_proj.kernel`); () for
    any other parameter."""
    match = _FUSED.search(path)
    if match is None:
        return ()
    prefix, leaf = path[: match.start()], match.group(2)
    return tuple(f"{prefix}.{part}.{leaf}" for part in FUSED_PARTS[match.group(1)])


def fuse_parts(
    path: str, parts: list[np.ndarray], *, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int
) -> np.ndarray:
    """The fused parameter at `path` as `load_model(tp_size=tp_size)` prepares it, from its
    `fused_parts` as checkpoints hold them (the model's own `num_kv_heads`): the KV heads repeated
    up to the mesh (`kv_heads_on_mesh`), then the parts in `tp_size` blocks (`interleave_blocks`);
    an input order (`linear.Linear.input_order`) is the parts' one (`shared_input_order`)."""
    if path.endswith(".input_order"):
        return shared_input_order(parts)
    axis = parts[0].ndim - 1
    if ".qkv_proj." in path:
        repeats = kv_heads_on_mesh(num_heads, num_kv_heads, tp_size) // num_kv_heads
        if repeats > 1:
            q, k, v = parts
            parts = [q, *(repeat_kv_heads(x, num_kv_heads, repeats, axis=axis) for x in (k, v))]
    return interleave_blocks(parts, tp_size, axis=axis)


def fused_layout(
    path: str,
    value: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    from_tp: int,
    to_tp: int,
) -> np.ndarray:
    """A prepared parameter (`load_model(tp_size=from_tp)`) as `load_model(tp_size=to_tp)`
    prepares it: the fused q/k/v and gate/up columns re-blocked, the KV heads repeated or
    un-repeated (`kv_heads_on_mesh`). Other parameters do not depend on the TP size. For
    checkpoints of prepared weights restored at another TP size. `num_kv_heads`: the model's own.
    """
    if from_tp == to_tp or not _FUSED.search(path) or path.endswith(".input_order"):
        return value
    axis = value.ndim - 1
    heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    if ".gate_up_proj." in path:
        parts = _unblocked(value, [value.shape[axis] // 2] * 2, from_tp, axis)
        return fuse_parts(path, parts, **heads, tp_size=to_tp)
    kv_from = kv_heads_on_mesh(num_heads, num_kv_heads, from_tp)
    kv_width = kv_from * head_dim
    # q's columns: N * H, or twice that where each head's output gate rides with it (Qwen3-Next)
    widths = [value.shape[axis] - 2 * kv_width, kv_width, kv_width]
    q, k, v = _unblocked(value, widths, from_tp, axis)
    k, v = (_own_kv_heads(x, kv_from, num_kv_heads, head_dim, axis) for x in (k, v))
    return fuse_parts(path, [q, k, v], **heads, tp_size=to_tp)


def _unblocked(value: np.ndarray, widths: list[int], blocks: int, axis: int) -> list[np.ndarray]:
    """The parts `interleave_blocks` fused (each `widths[i]` wide) back from `blocks` blocks."""
    pieces = [np.split(block, np.cumsum([w // blocks for w in widths])[:-1], axis=axis)
              for block in np.split(value, blocks, axis=axis)]  # fmt: skip
    return [np.concatenate([piece[i] for piece in pieces], axis=axis) for i in range(len(widths))]


def _own_kv_heads(x: np.ndarray, have: int, num_kv_heads: int, head_dim: int, axis: int) -> np.ndarray:
    """k or v columns of `have` heads (the model's `num_kv_heads`, each repeated alike) back to
    the model's own heads: the first copy of each."""
    if have == num_kv_heads:
        return x
    heads = np.reshape(x, (*x.shape[:axis], num_kv_heads, have // num_kv_heads, head_dim))
    return np.reshape(np.take(heads, 0, axis=axis + 1), (*x.shape[:axis], num_kv_heads * head_dim))
