# SPDX-License-Identifier: Apache-2.0
"""Pre-quantized int8 checkpoints in the compressed-tensors format, loaded as they are.

A model directory whose `config.json` holds a `quantization_config` with `quant_method:
"compressed-tensors"` stores some linear layers' weights as int8 with a scale: W8A16 as
`pack-quantized` (`weight_packed`: four int8 values a little-endian int32, each offset by 128;
`weight_shape`; `weight_scale`), W8A8 as `int-quantized` / `naive-quantized` (`weight` int8;
`weight_scale`). Only 8-bit symmetric integer weights with one scale per output channel, per
tensor, or per group of `group_size` inputs of each channel (`strategy: "group"`, `weight_scale`
`[out, in / G]`, without activation reordering) are accepted; anything else is refused naming
the group and what it has. A checkpoint's groups share one layout (grouped with one
`group_size`, or not): the model's int8 kernels have one. A W8A8
checkpoint's activations are not quantized here: its weights serve as W8A16.

The layers the checkpoint holds a `weight_scale` for get int8 kernels before loading
(`int8_layout`), so their int8 values and scales are copied in unchanged; the others load in the
model's dtype (`models.quantization.quantize_int8` quantizes them at load when asked).

4-bit checkpoints (W4A16: `pack-quantized` with `num_bits: 4`, symmetric `int` weights per
channel or per group: eight values an int32 word, each offset by 8; `weight_shape`;
`weight_scale`) load alike as int4 values (`models.int4`, held as int8 on CPU), their MoE
experts' group scales kept (`[E, in / G, out]`). Asymmetric ones (`symmetric: false`: the
package stores signed values `q` in [-8, 7] with signed zero points `zp`, the weight `(q - zp) *
scale`) also hold `weight_zero_point`, packed eight output rows an int32 word on its first axis
(`[ceil(out / 8), in / G]`, each plus 8, as the package's `pack_to_int32(packed_dim=0)` writes
it) or, where the package leaves it unpacked, int8 `[out, in / G]`: a layer loads the same int4
values and scales plus float32 offsets `-zp * scale` (`models.int4`: `w = q * s + m`), MoE
experts too (their offsets stacked `[E, in / G, out]` like their scales, `models.moe`).

FP8 checkpoints (`float-quantized`, or `naive-quantized` with float weights: 8-bit symmetric
`type: "float"` weights, float8_e4m3fn `weight` and a float32 `weight_scale` per tensor, per
channel or per `block_structure` block) load alike as fp8 kernels (`models.fp8`): block scales
are held per group of the block's inputs of each channel (`models.fp8.block_scales`). Their
activation schemes, static (`input_scale` tensors, dropped) or dynamic, are served with
activations in the model's dtype. A checkpoint's groups are all int or all float.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from models import int4
from models.fp8 import FP8_DTYPE, block_scales
from models.int4 import INT4_DTYPE
from models.int8 import SCALE_DTYPE

METHOD = "compressed-tensors"
_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_STRATEGIES = ("channel", "tensor", "group")
_FLOAT_STRATEGIES = ("channel", "tensor", "block")
_INT8 = np.dtype(np.int8)


@dataclasses.dataclass(frozen=True)
class Int8Checkpoint:
    """A quantized checkpoint's reading: its HF-name table (ours plus one scale name per linear
    weight), the HF weight names that hold int8 (or fp8) values, and for block scales the block
    `(outputs, inputs)` and each such weight's HF shape `[out, in]`."""

    param_map: dict[str, str]
    int8_weights: frozenset[str]
    block: tuple[int, int] | None = None
    weight_shapes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    bits: int = 8  # of the packed values (`weight_packed`): 8, or 4 (`models.int4`)
    zero_points: bool = False  # 4-bit with zero points: `weight_zero_point` read as offsets

    def tensors(self, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors as plain `weight` (int8 or fp8 `[out, in]`) and `weight_scale`:
        `weight_packed` unpacked (trimmed to `weight_shape` when that comes), `weight_shape`
        consumed, block scales (`weight_scale`, or `weight_scale_inv` as `quant_method: fp8`
        names them) per group of inputs of each row, activation scales (`input_scale`) dropped."""
        packed: dict[str, np.ndarray] = {}
        waiting: dict[str, dict[str, np.ndarray]] = {}  # an asymmetric layer's scale or zero point
        for name, array in tensors:
            if name.endswith(".input_scale"):
                continue
            if self.zero_points and name.endswith((".weight_scale", ".weight_zero_point")):
                weight, kind = name[: name.rindex(".weight_")] + ".weight", name.rsplit(".", 1)[1]
                if kind == "weight_scale":
                    yield name, array
                parts = waiting.setdefault(weight, {})
                parts[kind] = np.asarray(array)
                if len(parts) == 2:
                    yield weight + "_offset", zero_point_offsets(weight, **waiting.pop(weight))
                continue
            if name.endswith(".weight_scale_inv"):
                name = name.removesuffix("_inv")
            if self.block is not None and name.endswith(".weight_scale"):
                weight = name.removesuffix("_scale")
                if weight in self.weight_shapes:
                    array = block_scales(array, self.weight_shapes[weight], self.block, weight)
                yield name, array
            elif name.endswith(".weight_packed"):
                packed[name.removesuffix("_packed")] = self._unpacked(array)
            elif name.endswith(".weight_shape"):
                weight = name.removesuffix("_shape")
                rows, cols = (int(v) for v in np.asarray(array).reshape(-1))
                yield weight, packed.pop(weight)[:rows, :cols]
            else:
                yield name, array
        yield from packed.items()
        for weight, have in waiting.items():
            lacking = "weight_zero_point" if "weight_scale" in have else "weight_scale"
            raise ValueError(
                f"the compressed-tensors checkpoint (symmetric false) lacks {weight}{lacking[6:]}"
            )

    def _unpacked(self, packed: np.ndarray) -> np.ndarray:
        return int4.unpack_int32(packed) if self.bits == 4 else unpack_int32(packed)


def zero_point_offsets(weight: str, weight_scale: np.ndarray, weight_zero_point: np.ndarray) -> np.ndarray:
    """The float32 offsets `-zp * scale` (HF orientation, the scale's shape `[out, in / G]` or
    `[out, 1]`) of a 4-bit layer's signed zero points `zp`: packed eight rows an int32 word on the
    first axis, each plus 8, or int8 as they are."""
    scale = np.asarray(weight_scale, np.float32)
    zeros = np.asarray(weight_zero_point)
    if zeros.dtype == np.int32:
        zeros = int4.unpack_unsigned(zeros, axis=0)[: scale.shape[0]].astype(np.int32) - int4.OFFSET
    if zeros.shape != scale.shape:
        raise ValueError(
            f"compressed-tensors tensor {weight}_zero_point holds zero points {zeros.shape}, its "
            f"scales {scale.shape}: not one per group and output"
        )
    return (-zeros.astype(np.float32) * scale).astype(SCALE_DTYPE)


def unpack_int32(packed: np.ndarray) -> np.ndarray:
    """`[out, in / 4]` int32 (compressed-tensors' 8-bit packing) -> `[out, in]` int8."""
    unsigned = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8)  # 4 values a word, low first
    return (unsigned.astype(np.int16) - 128).astype(np.int8).reshape(packed.shape[0], -1)


def quantization_config(path: str) -> dict | None:
    """The `quantization_config` of the model directory at `path`'s `config.json`, or None."""
    config = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if config is None or not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("quantization_config")


def check_config(config: dict) -> None:
    """ValueError unless every config group holds 8-bit symmetric int weights per channel, per
    tensor or per group of inputs (one `group_size` for all), activations dynamic or none; or
    every one 8-bit symmetric float weights per channel, per tensor or per block (one block
    for all), activations static, dynamic or none."""
    fmt = config.get("format")
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {_FORMATS}")
    if values_dtype(config) == FP8_DTYPE:
        _check_float_groups(config)
        return
    if fmt == "float-quantized":
        raise ValueError(
            "compressed-tensors format 'float-quantized' holds float (fp8) weights, but its "
            "config_groups give them type 'int': the config does not describe the tensors"
        )
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        found = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
        bits = found["num_bits"] if found["num_bits"] in (4, 8) else 8
        symmetric = found["symmetric"] if bits == 4 and found["symmetric"] in (True, False) else True
        wanted = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": found["strategy"]}
        if found != wanted or found["strategy"] not in _STRATEGIES:
            raise ValueError(
                f"compressed-tensors group {name!r} has weights {found}; vllm-xla loads 8-bit "
                f"symmetric or 4-bit int weights with strategy {' or '.join(_STRATEGIES)} only"
            )
        if bits == 4 and fmt != "pack-quantized":
            raise ValueError(
                f"compressed-tensors group {name!r} has 4-bit weights in format {fmt!r}; 4-bit "
                "weights come 'pack-quantized' (eight to an int32)"
            )
        if found["strategy"] == "group":
            _check_group(name, weights)
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic", False):
            raise ValueError(
                f"compressed-tensors group {name!r} has static activation scales; vllm-xla serves "
                "int8 weights with unquantized activations (dynamic W8A8 or W8A16 checkpoints)"
            )
    group_size(config)  # one layout for every group


def values_dtype(config: dict) -> np.dtype:
    """The dtype of a compressed-tensors checkpoint's quantized weights: float8_e4m3fn when its
    groups' weights are floats, int8 when 8-bit ints, int4 when 4-bit ints; a ValueError when
    they mix."""
    types = {
        ((group.get("weights") or {}).get("type", "int"), (group.get("weights") or {}).get("num_bits", 8))
        for group in (config.get("config_groups") or {}).values()
    }
    if len(types) > 1:
        raise ValueError(
            f"compressed-tensors groups mix weight types {sorted(map(str, types))} (type, bits); "
            "vllm-xla loads one quantized type a model"
        )
    kind, bits = types.pop() if types else ("int", 8)
    return FP8_DTYPE if kind == "float" else INT4_DTYPE if bits == 4 else _INT8


def _check_float_groups(config: dict) -> None:
    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"compressed-tensors format {config.get('format')!r} holds no float weights; FP8 "
            "checkpoints are 'float-quantized' (or 'naive-quantized')"
        )
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        found = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
        if found != {"num_bits": 8, "type": "float", "symmetric": True, "strategy": found["strategy"]} or (
            found["strategy"] not in _FLOAT_STRATEGIES
        ):
            raise ValueError(
                f"compressed-tensors group {name!r} has weights {found}; vllm-xla loads 8-bit "
                f"symmetric float (fp8) weights with strategy {' or '.join(_FLOAT_STRATEGIES)} only"
            )
        block = weights.get("block_structure")
        if found["strategy"] == "block" and not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)
        ):
            raise ValueError(
                f"compressed-tensors group {name!r} has strategy 'block' with block_structure "
                f"{block!r}; it needs [outputs, inputs] of a block"
            )
    block_of(config)  # one layout for every group


def block_of(config: dict | None) -> tuple[int, int] | None:
    """The `[outputs, inputs]` block of a compressed-tensors FP8 checkpoint's block scales, None
    when per channel or tensor (or not such a checkpoint). A ValueError when groups mix."""
    if not config or config.get("quant_method") != METHOD:
        return None
    blocks = {
        tuple((group.get("weights") or {}).get("block_structure") or ())
        if (group.get("weights") or {}).get("strategy") == "block"
        else None
        for group in (config.get("config_groups") or {}).values()
    }
    if len(blocks) > 1:
        raise ValueError(
            f"compressed-tensors groups mix fp8 scale layouts (blocks {sorted(blocks, key=str)}); "
            "vllm-xla loads one layout a model"
        )
    return next(iter(blocks), None)


def _check_group(name: str, weights: dict) -> None:
    size, order = weights.get("group_size"), weights.get("actorder")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"compressed-tensors group {name!r} has strategy 'group' without a group_size")
    if order not in (None, False):
        raise ValueError(
            f"compressed-tensors group {name!r} reorders its inputs (actorder {order!r}); vllm-xla "
            "loads grouped int8 weights whose groups are consecutive inputs only"
        )


def group_size(config: dict | None) -> int | None:
    """The inputs per scale of a compressed-tensors `config`'s int8 weights: its `group_size` when
    they are grouped, None per channel or tensor (or not compressed-tensors). A ValueError when
    its groups mix layouts or group sizes."""
    if not config or config.get("quant_method") != METHOD:
        return None
    if values_dtype(config) == FP8_DTYPE:
        block = block_of(config)
        return None if block is None else block[1]
    sizes = {
        (group.get("weights") or {}).get("group_size")
        if (group.get("weights") or {}).get("strategy") == "group"
        else None
        for group in (config.get("config_groups") or {}).values()
    }
    if len(sizes) > 1:
        raise ValueError(
            "compressed-tensors groups mix int8 scale layouts (group sizes "
            f"{sorted(sizes, key=str)}, None: per channel or tensor); vllm-xla loads one layout a model"
        )
    return next(iter(sizes), None)


def int8_layout(
    model: nnx.Module,
    path: str,
    names: Callable[[], list[str]],
    our_name: Callable[[str], str | None],
) -> Int8Checkpoint | None:
    """For a compressed-tensors checkpoint at `path` whose tensor names `names()` lists: gives each layer
    it quantized int8 zeros and a scale (in place, before loading) and returns how to read it;
    None for any other checkpoint. `our_name`: an HF name's parameter path (the loader's table)."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD:
        return None
    check_config(config)
    scaled = {n.removesuffix("_scale") for n in names() if n.endswith(".weight_scale")}
    dtype = values_dtype(config)
    held = int4.held_dtype() if dtype == INT4_DTYPE else dtype
    affine = has_zero_points(config)
    param_map = int8_kernels_for(
        model,
        scaled,
        our_name,
        path,
        group_size(config),
        held,
        experts_grouped=dtype == INT4_DTYPE,
        offsets=affine,
    )
    block = block_of(config) if dtype == FP8_DTYPE else None
    shapes = weight_shapes(model, scaled, our_name) if block is not None else {}
    bits = 4 if dtype == INT4_DTYPE else 8
    return Int8Checkpoint(param_map, frozenset(scaled), block, shapes, bits=bits, zero_points=affine)


def has_zero_points(config: dict | None) -> bool:
    """Whether a compressed-tensors `config`'s (4-bit) weights have zero points (`symmetric: false`)."""
    if not config or config.get("quant_method") != METHOD:
        return False
    groups = (config.get("config_groups") or {}).values()
    return any((group.get("weights") or {}).get("symmetric") is False for group in groups)


def weight_shapes(
    model: nnx.Module, weights: set[str], our_name: Callable[[str], str | None]
) -> dict[str, tuple[int, int]]:
    """The HF shape `[out, in]` of each of `weights` (HF linear weight names), from the model's
    kernels (`[in, out]`, or an expert stack's `[E, in, out]`)."""
    modules = {".".join(str(p) for p in path_): m for path_, m in nnx.iter_modules(model)}
    shapes = {}
    for weight in weights:
        module = modules.get((our_name(weight) or "").removesuffix(".kernel"))
        if module is not None:
            *_, inputs, outputs = module.kernel.get_value().shape
            shapes[weight] = (outputs, inputs)
    return shapes


def int8_kernels_for(
    model: nnx.Module,
    weights: set[str],
    our_name: Callable[[str], str | None],
    path: str,
    group_size: int | None = None,
    dtype: np.dtype = _INT8,
    *,
    experts_grouped: bool = False,
    offsets: bool = False,
) -> dict[str, str]:
    """Gives the layers of the HF linear `weights` (names ending `.weight`) that a checkpoint holds
    as int8 with a `<weight>_scale` int8 zeros and a scale (in place, before loading): per
    channel, or with `group_size` one per group of that many inputs (dense projections only,
    unless fp8 or `experts_grouped`: a 4-bit checkpoint's experts); returns the model's HF-name
    table with one scale name per linear weight. `offsets`: an affine 4-bit checkpoint's (zero
    points or minimums, `models.int4`): each such layer (an expert stack too) also gets zero
    offsets in its scale's layout, filled from its `<weight>_offset`."""
    param_map = dict(type(model).hf_param_map)
    for hf, ours in type(model).hf_param_map.items():
        if hf.endswith(".weight") and ours.endswith(".kernel"):
            param_map[f"{hf}_scale"] = f"{ours}_scale"
            if offsets:
                param_map[f"{hf}_offset"] = f"{ours}_offset"
    modules = {".".join(str(p) for p in path_): m for path_, m in nnx.iter_modules(model)}
    for weight in sorted(weights):
        ours = our_name(weight)
        if ours is None or ours.removesuffix(".kernel") not in modules:
            raise ValueError(
                f"quantized checkpoint tensor {weight!r} (as {type(model).__name__} reads its name: "
                f"`models.loader.model_name_rule`) in {path!r} has no weight to load into: its "
                "values and scale match no projection of the model"
            )
        module = modules[ours.removesuffix(".kernel")]
        if module.kernel_scale is None:
            shape = module.kernel.get_value().shape
            module.kernel = nnx.Param(np.zeros(shape, dtype))
            grouped = experts_grouped or dtype == FP8_DTYPE
            scale_shape = _scale_shape(weight, shape, group_size, path, experts_grouped=grouped)
            module.kernel_scale = nnx.Param(np.zeros(scale_shape, SCALE_DTYPE))
            if offsets:
                module.kernel_offset = nnx.Param(np.zeros(scale_shape, SCALE_DTYPE))
    return param_map


def _scale_shape(
    weight: str, shape: tuple[int, ...], group_size: int | None, path: str, *, experts_grouped: bool = False
) -> tuple[int, ...]:
    """The scale of an int8 or fp8 kernel of `shape` (`[in, out]`, or an expert stack's `[E, in,
    out]`, grouped only with `experts_grouped`: a block fp8 checkpoint's experts)."""
    if group_size is None:
        return shape[:-2] + shape[-1:]
    if len(shape) != 2 and not experts_grouped:
        raise ValueError(
            f"checkpoint tensor {weight!r} in {path!r} is an expert's with grouped int8 scales; "
            "vllm-xla keeps one int8 scale per channel for MoE experts: use a checkpoint quantized "
            "per channel"
        )
    *experts, inputs, outputs = shape
    if inputs % group_size:
        raise ValueError(
            f"checkpoint tensor {weight!r} in {path!r} has {inputs} inputs, not groups of {group_size}"
        )
    return (*experts, inputs // group_size, outputs)
