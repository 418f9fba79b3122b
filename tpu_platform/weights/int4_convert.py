# SPDX-License-Identifier: Apache-2.0
"""Weight-only int4 of a float checkpoint (`vllm-xla convert --quantization int4`): a new model
directory holding a compressed-tensors W4A16 checkpoint (`pack-quantized`, symmetric `int`
weights, one scale per group of `group_size` inputs of each output channel), which every vLLM
backend, ours included, serves as it is (vLLM picks `compressed-tensors` from its config.json).

vLLM 0.32 has no online int4 weight-only method for a float checkpoint (no `rtn`; its one int4
name, `int4_per_group_32`, requantizes mxfp4 MoE experts at load on one GPU family), so the
quantization is done once here, as `vllm-xla convert` does int8's, and the result is an
ordinary 4-bit checkpoint.

Quantized: every projection the model reads into a dense or expert kernel (attention, MLP, MoE
experts; a layer it reads as several, Qwen3.5's `in_proj_qkv`, whole: one scale a group of
each output row, cut apart on load, `models.fused_outputs`) whose inputs split into groups of
`group_size`, with `models.int4.quantize_grouped` (`scale = max|w| / 7.5`, compressed-tensors'
symmetric range). MoE experts a checkpoint holds
fused in one 3-D tensor (Llama 4's `experts.gate_up_proj [E, D, 2F]` and `down_proj`, Gemma
4's) are quantized per expert and per group: the model's own split of such a tensor
(`checkpoint_tensors`, which its loader runs) gives each expert's gate, up and down `[out, in]`
weights, written under the per-expert names (`experts.{e}.gate_proj.weight_packed`, ...) that
llm-compressor writes for these models and vLLM's loaders read. A multimodal checkpoint's text
model is quantized under its own prefix (`language_model.`, `model.language_model.`: the model's
`checkpoint_name` rule, as the loader reads it); its other towers (vision, audio) stay in float
and are named in the config's `ignore`, as llm-compressor's recipes leave them. Kept as they are: the
embedding, norms, biases, the MoE router (a rounding there changes which experts run), the LM
head (tied or not: 4 bits on the layer whose every output is a logit costs tens of percent of
perplexity where the projections cost a few; served in the model's dtype, and int8 on the
native CPU kernels when tied, `models.quantization.quantize_tied_head_int8`), and experts in a
layout of their own (GPT-OSS's interleaved gate/up with biases: they stay in float, named in a
warning. vLLM 0.32's GPT-OSS loader reads its experts as mxfp4 blocks, as AMD Quark writes
them, or in float: there is no W4A16 layout of them to write that vLLM reads, and the released
GPT-OSS checkpoints are already 4.25-bit mxfp4, served as they are). A group size that does
not divide every projection's inputs is refused, naming the largest that does: a projection
left in float would keep its whole size, and one per channel would cost far more than a group.
The scales are stored in the source weight's dtype, as llm-compressor writes them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig, build, int4
from models.checkpoint_reads import checkpoint_files
from models.linear import Linear
from models.loader import model_name_rule, parameter_name_lookup, parameter_names_lookup
from models.moe import SparseMoE, StackedLinear

logger = logging.getLogger(f"vllm_xla.{__name__}")

DEFAULT_GROUP_SIZE = 128
_INDEX = "model.safetensors.index.json"
# Source files that hold weights (replaced by the quantized ones).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".gguf", ".bin", ".pt", ".pth")
_EXPERTS = ".experts"


@dataclasses.dataclass(frozen=True)
class _Projections:
    """The HF weights a model reads into a dense or expert kernel (the LM head's and a MoE
    router's aside): `weights`, those stored one tensor a projection; `kernels` and `ours`,
    our kernel paths and the loader's name table, and `split`, the model's rewrite of its
    checkpoint's tensors (`checkpoint_tensors`: fused experts split per expert), for the fused
    ones."""

    weights: frozenset[str]
    kernels: frozenset[str]
    ours: Callable[[str], str | None]
    split: Callable[[Iterator[tuple[str, np.ndarray]]], Iterator[tuple[str, np.ndarray]]] | None
    not_read: Callable[[str], bool] = lambda name: False  # another tower's (vision, audio)

    def experts(self, name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The per-expert `[out, in]` weights of `name` by their HF names, when it is a fused
        experts tensor (`[E, ..]`) the model splits into expert kernels under its own prefix;
        [] else. The parts keep the checkpoint's prefix (a multimodal checkpoint's
        `language_model.`), which the loader reads quantized layers through as it reads float
        ones (`models.loader.model_name_rule`)."""
        if self.split is None or value.ndim != 3 or f"{_EXPERTS}." not in name:
            return []
        stem = name[: name.rindex(f"{_EXPERTS}.") + len(_EXPERTS)] + "."
        parts = list(self.split(iter([(name, value)])))
        if len(parts) < 2 or not all(p.startswith(stem) and self.ours(p) in self.kernels for p, _ in parts):
            return []
        return parts

    def input_widths(self, name: str, shape: tuple[int, ...]) -> dict[str, int]:
        """The inputs of each projection the tensor `name` of `shape` holds (by HF weight name),
        read from its shape alone (a fused one split as a zero-strided view)."""
        if name in self.weights and len(shape) == 2:
            return {name: shape[1]}
        if len(shape) == 3:
            view = np.broadcast_to(np.zeros((), np.float32), shape)
            return {part: w.shape[1] for part, w in self.experts(name, view)}
        return {}


def convert_int4(source: str, out: str, group_size: int = DEFAULT_GROUP_SIZE) -> list[str]:
    """Writes `source` (a float safetensors model directory) as a W4A16 compressed-tensors
    checkpoint into `out`, a new directory; returns the HF names of the weights it quantized (a
    fused experts tensor's by its per-expert names). A ValueError names what cannot be
    converted."""
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(f"{source!r} is not a model directory with a config.json")
    files = checkpoint_files(source)
    if not files or not all(f.endswith(".safetensors") for f in files):
        raise ValueError(
            f"{source!r} holds no safetensors weights (a GGUF converts to a model directory with "
            "`vllm-xla model-dir --gguf FILE`; its 4-bit blocks are served as they are)"
        )
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out!r} exists and is not empty; name a new directory")
    if group_size < 8 or group_size % 8:
        raise ValueError(f"--group-size {group_size}: a multiple of 8 (int32 words of 8 values)")
    projections = _projections(source)
    _refuse_undivided_inputs(source, files, projections, group_size)
    os.makedirs(out, exist_ok=True)
    quantized, kept, left_float = [], set(), []
    weight_map = {}
    for file in files:
        tensors = {}
        for name, value in _tensors(file):
            experts = projections.experts(name, value)
            for expert, weight in experts:  # a fused experts tensor: each expert's projections
                tensors |= _packed(expert, weight, group_size)
                quantized.append(expert)
            if experts:
                continue
            if value.ndim == 3 and f"{_EXPERTS}." in name and projections.ours(name) is not None:
                left_float.append(name)  # experts in a layout of their own (GPT-OSS's)
            if name in projections.weights and value.ndim == 2 and value.shape[1] % group_size == 0:
                tensors |= _packed(name, value, group_size)
                quantized.append(name)
            else:
                tensors[name] = value
                other_tower = value.ndim == 2 and name.endswith(".weight") and projections.not_read(name)
                if name in projections.weights or other_tower:  # float: named in `ignore`
                    kept.add(name.removesuffix(".weight"))
        _save(tensors, os.path.join(out, os.path.basename(file)))
        weight_map |= {name: os.path.basename(file) for name in tensors}
    if not quantized:
        raise ValueError(
            f"no projection of {source!r} has inputs that split into groups of {group_size}: "
            "pass a --group-size that divides them"
        )
    if left_float:
        logger.warning(
            "vllm-xla convert --quantization int4 keeps %d expert tensors in float, in a layout no "
            "4-bit format of its own serves here: %s",
            len(left_float),
            ", ".join(sorted(left_float)[:4]) + (", ..." if len(left_float) > 4 else ""),
        )
    _copy_other_files(source, out, weight_map if len(files) > 1 else None)
    _write_config(out, group_size, sorted(kept))
    return quantized


def _refuse_undivided_inputs(
    source: str, files: list[str], projections: _Projections, group_size: int
) -> None:
    """ValueError naming a projection (`[out, in]`, or one expert's of a fused tensor) whose
    inputs do not split into groups of `group_size`, and the largest group size (a multiple of
    8) that splits every one."""
    from safetensors import safe_open

    widths = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in sorted(f.keys()):
                widths |= projections.input_widths(name, tuple(f.get_slice(name).get_shape()))
    undivided = sorted(name for name, width in widths.items() if width % group_size)
    if not undivided:
        return
    common = math.gcd(*widths.values())
    largest = max((g for g in range(8, common + 1, 8) if common % g == 0), default=None)
    fix = f"--group-size {largest} splits every one" if largest else "none of a multiple of 8 splits them all"
    raise ValueError(
        f"the inputs of {len(undivided)} projections of {source!r} do not split into groups of "
        f"{group_size} (e.g. {undivided[0]}, {widths[undivided[0]]} inputs); {fix}"
    )


def _tensors(file: str) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    with safe_open(file, framework="numpy") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _projections(source: str) -> _Projections:
    """The projections of the model at `source` (`_Projections`), from its config and names."""
    config = ModelConfig.from_pretrained(source)
    model = nnx.eval_shape(lambda: build(config, jnp.float32))
    routers = {id(m.router) for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)}
    head = getattr(model, "lm_head", None)
    kernels = {
        ".".join(str(p) for p in path) + ".kernel"
        for path, m in nnx.iter_modules(model)
        if isinstance(m, (Linear, StackedLinear)) and id(m) not in routers and m is not head
    }
    ours, rule = parameter_name_lookup(model), model_name_rule(model)  # names as the checkpoint holds them
    reads = parameter_names_lookup(model)  # a fused layer's (Qwen3.5's in_proj_qkv): its parts' kernels
    from safetensors import safe_open

    names = []
    for file in checkpoint_files(source):
        with safe_open(file, framework="numpy") as f:
            names += list(f.keys())
    weights = frozenset(
        name
        for name in names
        if name.endswith(".weight") and (paths := reads(name)) and set(paths) <= kernels
    )
    split = getattr(model, "checkpoint_tensors", None)
    return _Projections(weights, frozenset(kernels), ours, split, lambda name: rule(name) is None)


def _packed(name: str, value: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """An HF `[out, in]` float weight as compressed-tensors' `weight_packed`, `weight_scale`
    (`[out, in / G]`, the weight's dtype) and `weight_shape`."""
    q, scale = int4.quantize_grouped(np.asarray(value, np.float32).T, group_size)  # [in, out], [in / G, out]
    base = name.removesuffix("weight")
    return {
        f"{base}weight_packed": np.ascontiguousarray(int4.pack_int32(q.T)),
        f"{base}weight_scale": np.ascontiguousarray(scale.T.astype(value.dtype)),
        f"{base}weight_shape": np.asarray(value.shape, np.int64),
    }


def _save(tensors: dict[str, np.ndarray], path: str) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata={"format": "pt"})


def _copy_other_files(source: str, out: str, weight_map: dict[str, str] | None) -> None:
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(out, name))
    if weight_map is not None:
        with open(os.path.join(out, _INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def _write_config(out: str, group_size: int, kept: list[str]) -> None:
    """config.json's `quantization_config`: llm-compressor's W4A16 scheme at `group_size`."""
    weights = dict(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, dynamic=False
    )
    ignore = ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", *kept]
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ignore,
    }
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
