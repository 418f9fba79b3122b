# SPDX-License-Identifier: Apache-2.0
"""4-bit GPTQ checkpoints (`quant_method: "gptq"`), loaded as they are as int4 kernels (`models.int4`).

Such a model directory's `config.json` holds a `quantization_config` like `{"quant_method":
"gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}`, and each quantized
linear layer `<layer>` holds (vLLM's `auto_gptq` layout, `G` the group size, all inputs when
`group_size` is -1):

- `<layer>.qweight`: int32 `[in / 8, out]`, eight 4-bit values of consecutive inputs a word, the
  first in the lowest bits, each stored plus 8 (`uint4b8`): the weight is `(stored - 8) * scale`;
- `<layer>.scales`: float16 `[in / G, out]`, one per group of `G` consecutive inputs and output;
- `<layer>.qzeros`: int32 `[in / G, out / 8]`, the zero points, eight output columns a word:
  a symmetric checkpoint's are all 8, which vLLM's kernels do not read either (dropped); an
  asymmetric one's (`sym: false`) are read: the original format (`checkpoint_format` "gptq", the
  default) stores each zero point minus one, "gptq_v2" as it is (as vLLM's GPTQ kernels read
  them), and the weight is `(stored - z) * scale`;
- `<layer>.g_idx`: int32 `[in]`, each input's group: `i // G` without activation order
  (checked, then dropped); with it (`desc_act: true`, most GPTQ checkpoints on the hub) the
  groups of a random-looking order of the inputs, the weight of input row `i` being
  `(stored - z[g_idx[i]]) * scale[g_idx[i]]`.

The stored values minus 8 are int4 as they stand, so a layer loads as int4 values `[in, out]`
with float32 scales `[in / G, out]` (`[out]` per channel), exactly the weights vLLM computes
with; an asymmetric checkpoint's also with float32 offsets `(8 - z) * scale` in the scales'
layout (`models.int4`: `w = q * s + m`).

Activation order is served by sorting a layer's kernel rows by group at load (`input_order`,
stable: each group's inputs in their own order), so its groups are consecutive again and the
weights load packed into the same int4 kernel, scales and offsets as any GPTQ layer's; the layer
keeps the order (`linear.Linear.input_order`) and gathers its inputs into it in the program, a
`[T, in]` gather beside a weight read of `in * out / 2` bytes. Permuting the producing layer's
outputs instead would avoid the gather only where one layer produces the input (down_proj), not
for q/k/v and gate/up (the normalized residual, read by several layers) nor o_proj (attention's
heads), so every reordered layer gathers alike. A layer whose `g_idx` is already `i // G`
(desc_act set, its order trivial) is served as without activation order. The g_idx tensors are
read before the weights (they are small) so each reordered layer gets its order ahead of its
qweight. On a mesh the order is whole on every device; o_proj's and down_proj's rows split on
whole groups as any GPTQ layer's (a TP size that cuts a group is refused by name), and XLA
brings each device the inputs its rows read. MoE experts, each in its own order, load so too:
`models.gptq_expert_orders`.

Refused by name: other bit widths (GPTQ's 8-bit and 2/3-bit), a `g_idx` that is not `i // G`
under `desc_act: false` or whose groups do not each hold `group_size` inputs, projections fused
into one (q/k/v, gate/up) whose orders differ and an expert whose gate and up orders differ, a
quantized head (`lm_head: true`) and per-module `dynamic` overrides. An asymmetric MoE's
experts load with their offsets stacked like their scales (`models.moe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from models import int4
from models.compressed_tensors import int8_kernels_for, quantization_config
from models.gptq_expert_orders import InputOrders, expert_input_orders, expert_slot
from models.linear import Linear
from models.moe import StackedLinear

METHOD = "gptq"
_SUFFIXES = (".qweight", ".scales", ".qzeros", ".g_idx")
_FORMATS = ("gptq", "gptq_v2")  # v1 stores zero points minus one


def check_config(config: dict) -> None:
    """ValueError naming the field unless `config` is a GPTQ config vllm-xla serves."""
    bits, sym = config.get("bits"), config.get("sym", True)
    if bits != 4:
        raise ValueError(
            f"GPTQ checkpoint with bits={bits!r}: vllm-xla loads 4-bit GPTQ weights only (for 8-bit "
            "weights use an int8 compressed-tensors checkpoint, or --quantization "
            "int8_per_channel_weight_only on the float model)"
        )
    if not isinstance(sym, bool):
        raise ValueError(f"GPTQ checkpoint with sym={sym!r}: it is true (symmetric) or false (zero points)")
    if config.get("checkpoint_format", "gptq") not in _FORMATS:
        raise ValueError(
            f"GPTQ checkpoint_format {config.get('checkpoint_format')!r} is not one of {_FORMATS}"
        )
    size = config.get("group_size", -1)
    if not isinstance(size, int) or (size != -1 and size < 1):
        raise ValueError(f"GPTQ checkpoint group_size {size!r} is neither -1 (per channel) nor positive")
    if config.get("lm_head"):
        raise ValueError("GPTQ checkpoint with a quantized head (lm_head=true) is not supported")
    if config.get("dynamic"):
        raise ValueError(
            "GPTQ checkpoint with per-module `dynamic` overrides is not supported: vllm-xla loads "
            "one bit width and group size a model"
        )


def group_size(config: dict | None) -> int | None:
    """The inputs per scale of a GPTQ `config`'s weights: None per channel (or not GPTQ)."""
    if not config or config.get("quant_method") != METHOD:
        return None
    size = config.get("group_size", -1)
    return None if size == -1 else size


@dataclasses.dataclass(frozen=True)
class GptqCheckpoint:
    """A GPTQ checkpoint's reading: its HF-name table (ours plus one scale name per linear
    weight, and an offset name when asymmetric), its group size (None: per channel), and for an
    asymmetric one what its stored zero points lack (1 in the original format, 0 in v2)."""

    param_map: dict[str, str]
    group_size: int | None
    zero_shift: int | None = None  # None: symmetric, zero points dropped
    act_order: bool = False  # `desc_act`: each layer's g_idx read before loading, into `orders`
    orders: InputOrders = dataclasses.field(default_factory=InputOrders)

    def tensors(self, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors as plain int4 `weight` `[out, in]` and float32 `weight_scale`
        (`[out, in / G]`, or `[out]` per channel: HF orientation); `g_idx` checked and dropped;
        `qzeros` dropped when symmetric, else with the scales as float32 `weight_offset` (the
        scales' layout). Under activation order each reordered layer's rows sorted, and an
        expert's gate and up outputs in its down projection's order (`orders`)."""
        waiting: dict[str, dict[str, np.ndarray]] = {}  # an asymmetric layer's scales or zeros
        for name, array in tensors:
            layer, _, kind = name.rpartition(".")
            if kind == "qweight":
                values = self._columns(layer, int4.unpack_int32(array, axis=0), kind)
                yield from self._weight(layer, values)
            elif kind == "scales":
                array = self._columns(layer, np.asarray(array), kind)
                yield layer + ".weight_scale", self._hf_layout(array)
                if self.zero_shift is not None:
                    yield from self._offset(waiting, layer, "scales", array)
            elif kind == "g_idx":
                if not self.act_order:
                    self._check_g_idx(name, np.asarray(array))
            elif kind == "qzeros":
                if self.zero_shift is not None:
                    zeros = int4.unpack_unsigned(array, axis=1).astype(np.int32) + self.zero_shift
                    yield from self._offset(waiting, layer, "zeros", self._columns(layer, zeros, kind))
            else:
                yield name, self._columns(layer, array, kind) if kind == "bias" else array
        for layer, have in waiting.items():
            lacking = "qzeros" if "scales" in have else "scales"
            raise ValueError(f"the GPTQ checkpoint (sym false) lacks {layer}.{lacking}")

    def _weight(self, layer: str, values: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """A layer's int4 values `[in, out]` as its HF `weight` `[out, in]`; under activation
        order with its rows in group order, and the order its inputs are gathered into
        (`input_order`) beside them."""
        order = self.orders.rows.get(layer)
        if order is not None:
            if order.shape[0] != values.shape[0]:
                raise ValueError(
                    f"GPTQ tensor {layer}.g_idx gives {order.shape[0]} inputs a group, its qweight "
                    f"holds {values.shape[0]} inputs"
                )
            values = values[order]
        if layer in self.orders.gathered:
            yield layer + ".input_order", self.orders.gathered[layer]
        yield layer + ".weight", values.T

    def _columns(self, layer: str, array: np.ndarray, kind: str) -> np.ndarray:
        """`array`'s last axis (the layer's outputs; zero points' padded to whole words) in the
        order of its expert's down projection's rows, when that expert's down is reordered."""
        order = self.orders.columns.get(layer)
        if order is None:
            return array
        if array.shape[-1] < order.size:
            raise ValueError(
                f"GPTQ tensor {layer}.{kind} has {array.shape[-1]} outputs; its expert's down "
                f"projection reads {order.size} (its g_idx)"
            )
        return np.asarray(array)[..., order]

    def _hf_layout(self, value: np.ndarray) -> np.ndarray:
        """A `[in / G, out]` per-group tensor as `[out, in / G]` float32, `[out]` per channel."""
        value = np.asarray(value, np.float32).T
        return value[:, 0] if self.group_size is None else value

    def _offset(
        self, waiting: dict[str, dict[str, np.ndarray]], layer: str, kind: str, value: np.ndarray
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The layer's `weight_offset` once both its scales and zero points have come."""
        parts = waiting.setdefault(layer, {})
        parts[kind] = value
        if len(parts) == 2:
            del waiting[layer]
            scale, zeros = parts["scales"], parts["zeros"]
            if zeros.shape[0] != scale.shape[0] or zeros.shape[1] < scale.shape[1]:
                raise ValueError(
                    f"GPTQ tensor {layer}.qzeros holds zero points {zeros.shape}, its scales "
                    f"{tuple(scale.shape)}: not one per group and output"
                )
            offset = int4.affine_from_zero_points(scale, zeros[:, : scale.shape[1]])
            yield layer + ".weight_offset", self._hf_layout(offset)

    def _check_g_idx(self, name: str, g_idx: np.ndarray) -> None:
        inputs = np.arange(g_idx.shape[0])
        if not np.array_equal(g_idx, inputs // (self.group_size or g_idx.shape[0])):
            raise ValueError(
                f"checkpoint tensor {name!r} reorders the inputs of its groups (activation "
                "order) while the checkpoint's quantization_config says desc_act false: set "
                "desc_act true in its config.json to serve it so"
            )


def input_order(name: str, g_idx: np.ndarray, group_size: int | None) -> np.ndarray | None:
    """The order of a layer's inputs that makes its groups consecutive, from its `g_idx` (tensor
    `name`): the inputs sorted by group, in their own order within one (int32 `[in]`); None
    when they already are (`g_idx[i] == i // G`: no reordering to serve). A ValueError naming
    the tensor unless every group holds exactly `group_size` inputs."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    inputs = g_idx.shape[0] if g_idx.ndim == 1 else 0
    size = group_size or inputs
    if g_idx.ndim != 1 or not inputs or inputs % size:
        raise ValueError(
            f"GPTQ tensor {name!r} has shape {g_idx.shape}: not one group index an input in groups of {size}"
        )
    groups = inputs // size
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"GPTQ tensor {name!r} holds group indices outside [0, {groups})")
    counts = np.bincount(g_idx, minlength=groups)
    if (counts != size).any():
        group = int(np.flatnonzero(counts != size)[0])
        raise ValueError(
            f"GPTQ tensor {name!r} puts {counts[group]} inputs in group {group}, not group_size "
            f"{size}: vllm-xla serves activation order whose groups each hold group_size inputs"
        )
    if np.array_equal(g_idx, np.arange(inputs) // size):
        return None
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def give_input_orders(
    model: nnx.Module,
    path: str,
    our_name: Callable[[str], str | None],
    g_indices: Callable[[], dict[str, np.ndarray]],
) -> InputOrders:
    """For a GPTQ checkpoint with activation order at `path` (`desc_act`; whose `g_idx` tensors
    by name `g_indices()` reads): gives each dense layer it reorders an `input_order`, and each
    expert stack whose gate it reorders one a row an expert (zeros, in place, before loading:
    `models.gptq_expert_orders`), and returns how each layer loads; none for any other
    checkpoint. Also run before the served structure is derived from the model
    (`models.weight_stream`), which must then hold the orders."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD or not config.get("desc_act"):
        return InputOrders()
    check_config(config)
    modules = {".".join(str(p) for p in path_): m for path_, m in nnx.iter_modules(model)}
    dense, stacks, expert_orders = {}, {}, {}
    for name, g_idx in sorted(g_indices().items()):
        layer = name.removesuffix(".g_idx")
        ours = (our_name(layer + ".weight") or "").removesuffix(".kernel")
        order = input_order(name, g_idx, group_size(config))
        if isinstance(modules.get(ours), StackedLinear) and expert_slot(layer) is not None:
            stacks[layer], expert_orders[layer] = (ours, expert_slot(layer)), order
        elif order is not None:
            if not isinstance(modules.get(ours), Linear):
                raise ValueError(
                    f"GPTQ tensor {name!r} in {path!r} reorders the inputs of a layer that "
                    "vllm-xla loads neither as a projection nor as an MoE expert (`experts.{e}.`)"
                )
            modules[ours].input_order = nnx.Param(np.zeros(order.shape, np.int32))
            dense[layer] = order
    experts = expert_input_orders(stacks, expert_orders, modules)
    return InputOrders(dense | experts.rows, dense | experts.gathered, experts.columns)


def _input_order_names(model: nnx.Module, param_map: dict[str, str]) -> None:
    """`param_map` plus the name each projection's input order loads from."""
    for hf, ours in type(model).hf_param_map.items():
        if hf.endswith(".weight") and ours.endswith(".kernel"):
            layer, ours_layer = hf.removesuffix(".weight"), ours.removesuffix(".kernel")
            param_map[layer + ".input_order"] = ours_layer + ".input_order"


def gptq_layout(
    model: nnx.Module,
    path: str,
    names: Callable[[], list[str]],
    our_name: Callable[[str], str | None],
    g_indices: Callable[[], dict[str, np.ndarray]],
) -> GptqCheckpoint | None:
    """For a GPTQ checkpoint at `path` whose tensor names `names()` lists: gives each layer it
    quantized int4 zeros (held as `int4.held_dtype`) and a scale (in place, before loading), and
    under activation order (`desc_act`, whose `g_idx` tensors by name `g_indices()` reads) each
    layer it reorders an input order; returns how to read it; None for any other checkpoint.
    `our_name`: an HF name's parameter path (the loader's table)."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD:
        return None
    check_config(config)
    size = group_size(config)
    quantized = {n.removesuffix(".qweight") + ".weight" for n in names() if n.endswith(".qweight")}
    affine = not config.get("sym", True)
    param_map = int8_kernels_for(
        model, quantized, our_name, path, size, int4.held_dtype(), experts_grouped=True, offsets=affine
    )
    shift = (1 if config.get("checkpoint_format", "gptq") == "gptq" else 0) if affine else None
    orders = give_input_orders(model, path, our_name, g_indices)
    if orders.gathered:
        _input_order_names(model, param_map)
    return GptqCheckpoint(param_map, size, shift, bool(config.get("desc_act")), orders)
