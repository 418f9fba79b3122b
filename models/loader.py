# SPDX-License-Identifier: Apache-2.0
"""Weight loading: a checkpoint's tensors (`checkpoint_reads`; HF safetensors, single file or
sharded index, and GGUF) mapped onto a built model's parameters, and the model made ready to serve."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import (
    awq_checkpoint,
    compressed_tensors,
    fp8_checkpoint,
    fused_outputs,
    gguf_reader,
    gptq_checkpoint,
    int4,
)
from models.checkpoint_kinds import checkpoint_values, gguf_q4_weights, gguf_q8_0_weights
from models.checkpoint_reads import checkpoint_names, iter_checkpoint, read_tensors
from models.config import ModelConfig
from models.expert_stacks import ExpertStacks
from models.fp8 import is_fp8
from models.int8 import checkpoint_scale
from models.linear import keep_float_layers
from models.local_reads import Box, expert_reads, part_reader
from models.param_names import compile_param_map, our_name
from models.registry import build
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import kv_heads_on_mesh

# Checkpoint tensors that carry no parameter of ours (recomputed or duplicated).
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


def model_name_rule(model: nnx.Module) -> Callable[[str], str | None]:
    """The name `hf_param_map` reads a checkpoint tensor under: the model's `checkpoint_name`
    where it has one (a multimodal checkpoint's text-model prefix rewritten, None for its other
    towers), else the name as it is. Every reader of checkpoint names goes through it, the
    quantized layouts' (scales, packed values, `g_idx`) as the float weights'."""
    return getattr(model, "checkpoint_name", lambda name: name)


def model_names(model: nnx.Module, names: list[str]) -> list[str]:
    """`names` (a checkpoint's) as `model` reads them (`model_name_rule`), those it skips
    (`skips_checkpoint_tensor`) left out, a fused layer's as its parts' (`fused_outputs`)."""
    rule, skipped = model_name_rule(model), _skip_rule(model)
    renamed = (ours for ours in map(rule, names) if ours is not None and not skipped(ours))
    return list(fused_outputs.split_names(renamed, _fused_layers(model)))


def _skip_rule(model: nnx.Module) -> Callable[[str], bool]:
    """Whether `model` leaves a checkpoint tensor (by the name it reads) unread (DeepSeek's
    multi-token-prediction layers)."""
    return getattr(model, "skips_checkpoint_tensor", lambda name: False)


def _reads_as_stored(model: nnx.Module) -> bool:
    """Whether `model` reads each checkpoint tensor under one name as it is stored: it neither
    splits (`checkpoint_tensors`: Llama 4's stacked experts) nor cuts (`fused_outputs`) any."""
    return not _fused_layers(model) and not hasattr(model, "checkpoint_tensors")


def _fused_layers(model: nnx.Module) -> tuple[fused_outputs.FusedOutputs, ...]:
    """The checkpoint layers `model` reads as several projections (Qwen3.5's `in_proj_qkv`)."""
    return tuple(getattr(model, "fused_outputs", ()))


def model_tensors(
    model: nnx.Module,
    tensors: Iterator[tuple[str, np.ndarray]],
    units: fused_outputs.OutputUnits | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """A checkpoint's `(name, array)` stream as `model`'s map reads it: renamed by
    `model_name_rule` (those it skips dropped), a fused layer's tensors cut into its parts' in
    the checkpoint format's `units` (`fused_outputs`: Qwen3.5's qkv; float when None), then split
    where the model splits tensors (`checkpoint_tensors`: Llama 4's and Gemma 4's stacked experts)."""
    rule = model_name_rule(model)
    renamed = ((ours, array) for name, array in tensors if (ours := rule(name)) is not None)
    layers = _fused_layers(model)
    if layers:
        renamed = fused_outputs.split_tensors(renamed, layers, units or fused_outputs.OutputUnits())
    split = getattr(model, "checkpoint_tensors", None)
    return renamed if split is None else split(renamed)


def g_indices(model: nnx.Module, path: str) -> dict[str, np.ndarray]:
    """A GPTQ checkpoint's `g_idx` tensors at `path` by the names `model` reads them under (a
    fused layer's given to each of its parts: they share their inputs)."""
    rule, layers = model_name_rule(model), _fused_layers(model)
    found = {rule(name): g_idx for name, g_idx in read_tensors(path, ".g_idx").items()}
    return {
        part: g_idx
        for name, g_idx in found.items()
        if name is not None
        for part in fused_outputs.split_names([name], layers)
    }


def parameter_name_lookup(model: nnx.Module) -> Callable[[str], str | None]:
    """The parameter path of `model` (with `{i}` filled; an expert's tensor names its stack) that
    a checkpoint tensor's HF name (as the checkpoint holds it: `model_name_rule` applied here)
    loads into, None for a name the model does not read."""
    compiled, rule = compile_param_map(type(model).hf_param_map), model_name_rule(model)

    def lookup(hf: str) -> str | None:
        renamed = rule(hf)
        return None if renamed is None else (our_name(renamed, compiled) or (None,))[0]

    return lookup


def parameter_names_lookup(model: nnx.Module) -> Callable[[str], list[str]]:
    """`parameter_name_lookup` for a tensor that may load into several parameters: a fused
    layer's (`fused_outputs`, Qwen3.5's `in_proj_qkv`) its parts' paths; [] for a name the
    model does not read (or one of whose parts it does not)."""
    compiled, rule, layers = (
        compile_param_map(type(model).hf_param_map),
        model_name_rule(model),
        _fused_layers(model),
    )

    def lookup(hf: str) -> list[str]:
        renamed = rule(hf)
        parts = [] if renamed is None else list(fused_outputs.split_names([renamed], layers))
        found = [(our_name(part, compiled) or (None,))[0] for part in parts]
        return [] if None in found else found

    return lookup


def read_into(model: nnx.Module, path: str, **options: Any) -> None:
    """Sets `model`'s parameters from the checkpoint at `path` (`iter_parameters` and its
    `options`). They are looked up once the first tensor is out: a quantized checkpoint's layout
    adds its scales to the model first."""
    params: dict[str, nnx.Variable] = {}
    for ours, value in iter_parameters(model, path, **options):
        if not params:
            flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
            params = {".".join(map(str, key)): var for key, var in flat}
        params[ours].set_value(value)


def iter_parameters(
    model: nnx.Module, path: str, stacks: ExpertStacks | None = None, **options: Any
) -> Iterator[tuple[str, np.ndarray]]:
    """`_iter_parameters`, its errors about a fused layer's parts naming the checkpoint's tensor."""
    try:
        yield from _iter_parameters(model, path, stacks, **options)
    except ValueError as error:
        named = fused_outputs.named_as_checkpoint(error, _fused_layers(model))
        if named is error:
            raise
        raise named from error


def _iter_parameters(
    model: nnx.Module,
    path: str,
    stacks: ExpertStacks | None = None,
    *,
    int8: bool = False,
    int4_blocks: bool = False,
    only: Callable[[str], bool] | None = None,
    parts: Callable[[str], Box | None] | None = None,
    q8_0_embedding: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(our dotted parameter path, host value)` for every parameter of `model` (built,
    unprepared: its values are read for their shapes and dtypes only) from the checkpoint at
    `path`, one at a time in checkpoint order, each as `load_weights` sets it.

    Driven by the model's `hf_param_map`. Linear weights (HF `[out, in]`) are transposed to our
    `[in, out]` kernels (left F-ordered: a device transfer lays them out, faster) and every
    tensor is cast to the parameter's dtype. An HF name with an `{e}` field is one expert's
    tensor: it fills slot e of our expert-stacked `[E, ...]` parameter, yielded once all E slots
    are filled (`stacks` holds the partial ones). A checkpoint tensor with no home, a missing
    parameter or expert, or a shape mismatch is an error naming the tensor.

    A compressed-tensors int8 checkpoint's quantized layers load as int8 kernels with their
    scales, unchanged (`models.compressed_tensors`); an fp8 one's (compressed-tensors FP8 or
    `quant_method: fp8`: `models.fp8_checkpoint`) as fp8 kernels with theirs. `int8` (the
    model is served with int8 weights): a GGUF's Q8_0 linear weights load as int8 kernels and
    scales too, as they are: one scale per block of 32 inputs of each column (`gguf_reader`);
    `int4_blocks` (the model is served with affine int4 weights): an all-4-bit GGUF's
    projections load as int4 kernels with a scale and an offset per such block. `only`: the
    checkpoint tensors to read (a part of a checkpoint: the others are neither read nor matched).
    `parts` (a host of several): the box of a whole parameter (by our path, in our orientation)
    that this process's devices hold, read alone where the tensor is the parameter as it is
    (`models.local_reads.part_reader`); the rest of the value is zeros, which must reach no device.
    `q8_0_embedding`: a GGUF's Q8_0 embedding blocks, read already (for a tied head's copy): the
    embedding is made from them, not read again.
    """
    compiled = compile_param_map(type(model).hf_param_map)
    units = fused_outputs.output_units(compressed_tensors.quantization_config(path))
    gguf: dict[str, bool] = {}  # a GGUF's quantized blocks read as they are

    def ours_of(hf: str) -> str | None:
        return (our_name(hf, compiled) or (None,))[0]

    names = lambda: model_names(model, checkpoint_names(path, only))  # noqa: E731
    layout = (
        compressed_tensors.int8_layout(model, path, names, ours_of)
        or fp8_checkpoint.fp8_layout(model, path, names, ours_of)
        or gptq_checkpoint.gptq_layout(model, path, names, ours_of, lambda: g_indices(model, path))
        or awq_checkpoint.awq_layout(model, path, names, ours_of)
    )
    if layout is not None:
        compiled = compile_param_map(layout.param_map)
    elif int4_blocks and (q4 := gguf_q4_weights(path)):
        param_map = compressed_tensors.int8_kernels_for(
            model, q4, ours_of, path, gguf_reader.Q4_BLOCK, int4.held_dtype(), offsets=True
        )
        compiled, gguf = compile_param_map(param_map), {"int4_q4": True}
    elif int8 and (q8_0 := gguf_q8_0_weights(path)):
        param_map = compressed_tensors.int8_kernels_for(model, q8_0, ours_of, path, gguf_reader.Q8_0_BLOCK)
        compiled, gguf = compile_param_map(param_map), {"int8_q8_0": True}
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    expected = {".".join(str(p) for p in key): var.get_value() for key, var in params.items()}
    stacks = ExpertStacks() if stacks is None else stacks
    rule = model_name_rule(model)
    read = expert_reads(only, rule, type(model).hf_param_map, stacks)
    as_stored = layout is None and not gguf and _reads_as_stored(model)  # a float tensor as it is
    part = part_reader(rule, compiled, expected, parts) if as_stored else None
    reading = iter_checkpoint(path, only=read, part=part, q8_0_embedding=q8_0_embedding, **gguf)
    tensors = model_tensors(model, reading, None if gguf else units)
    if layout is not None:
        tensors = layout.tensors(tensors)
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A model may leave tensors it does not serve unread (DeepSeek's multi-token-prediction layers).
    skipped = _skip_rule(model)
    filled: set[str] = set()
    for hf, array in tensors:
        found = our_name(hf, compiled)
        if found is None or found[0] not in expected:
            if any(p.match(hf) for p in _IGNORED) or (tied and hf == "lm_head.weight") or skipped(hf):
                continue
            raise ValueError(
                f"checkpoint tensor {hf!r} in {path!r} has no parameter in {type(model).__name__}"
            )
        ours, expert = found
        value = np.asarray(array)
        current = expected[ours]
        if is_fp8(value.dtype) and not is_fp8(current.dtype):
            raise ValueError(
                f"checkpoint tensor {hf!r} in {path!r} holds fp8 values without a scale of its "
                "own (no weight_scale or weight_scale_inv beside it, or a quantization_config "
                "that does not say fp8): vllm-xla cannot tell what they stand for"
            )
        if ours.endswith("kernel"):
            value = value.T
        elif ours.endswith(("kernel_scale", "kernel_offset")):  # -> `[out]`, or `[in / G, out]` grouped
            try:
                value = checkpoint_scale(value, current.shape if expert is None else current.shape[1:])
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {hf!r} in {path!r}: {e}") from None
        if expert is not None:
            value = stacks.put(ours, expert, value, current.shape, current.dtype, hf)
            if value is None:
                continue
        elif value.shape != current.shape:
            raise ValueError(f"checkpoint tensor {hf!r} has shape {value.shape}, expected {current.shape}")
        else:
            value = value.astype(current.dtype)
        filled.add(ours)
        yield ours, value
    stacks.check_complete(path)
    missing = sorted(set(expected) - filled)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} parameters, e.g. {missing[:5]}")


def give_input_orders(model: nnx.Module, path: str) -> None:
    """Gives the layers a GPTQ checkpoint with activation order at `path` reorders their input
    orders (`models.gptq_checkpoint.give_input_orders`), before a served structure is derived
    from `model`; nothing for any other checkpoint."""
    compiled = compile_param_map(type(model).hf_param_map)
    gptq_checkpoint.give_input_orders(
        model, path, lambda hf: (our_name(hf, compiled) or (None,))[0], lambda: g_indices(model, path)
    )


def keep_checkpoint_float_layers(model: nnx.Module, path: str) -> list[str]:
    """Marks the layers a pre-quantized checkpoint at `path` holds in float (`linear.keep_float`:
    a `weight` with no scale beside it, which its recipe's `ignore` / `ignored_layers` left so),
    before a served structure is derived from `model`: a preparation's quantization pass keeps
    them float, as `iter_parameters` loads them. Returns their paths; none for a float checkpoint
    (quantized at load as asked) or a layer whose experts are quantized in part."""
    if checkpoint_values(path) is None:
        return []
    names = set(model_names(model, checkpoint_names(path)))
    compiled = compile_param_map(type(model).hf_param_map)
    modules = {".".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
    scaled: dict[str, set[bool]] = {}
    for hf in names:
        ours = (our_name(hf, compiled) or (None,))[0] if hf.endswith(".weight") else None
        if ours is not None and ours.endswith(".kernel") and ours.removesuffix(".kernel") in modules:
            has_scale = any(f"{hf}{suffix}" in names for suffix in ("_scale", "_scale_inv"))
            scaled.setdefault(ours.removesuffix(".kernel"), set()).add(has_scale)
    kept = sorted(name for name, found in scaled.items() if found == {False})
    keep_float_layers(model, kept)
    return kept


def load_weights(model: nnx.Module, path: str, *, on_host: bool = False) -> None:
    """Fills every parameter of `model` from the checkpoint at `path` (`iter_parameters`), then
    puts them on JAX's default device in one transfer (`on_host`: left as NumPy arrays, for a
    caller that transforms them before its own transfer). For a model served on devices,
    `models.weight_stream.stream_model` puts each tensor on its device(s) as it is read instead."""
    by_name: dict[str, nnx.Variable] | None = None
    for ours, value in iter_parameters(model, path):
        if by_name is None:  # read once the first tensor is out: an int8 checkpoint adds scales first
            params = nnx.to_flat_state(nnx.state(model, nnx.Param))
            by_name = {".".join(map(str, key)): var for key, var in params}
        by_name[ours].set_value(value)
    if not on_host:
        put_on_device(model)


def put_on_device(model: nnx.Module, device: jax.Device | None = None) -> None:
    """Moves every variable of `model` to `device` (default: JAX's default device) in one transfer."""
    nnx.update(model, jax.device_put(nnx.state(model), device))


def prepare_for_serving(model: nnx.Module, config: ModelConfig, tp_size: int = 1) -> None:
    """Derives the served layout from the loaded parameters: KV heads repeated up to `tp_size`
    when fewer, the tied head's `[D, V]` copy and the fused projections (one block a device on a
    mesh of `tp_size`: `models.sharding`). Also runs under `nnx.eval_shape` (abstract values): it
    then gives the served layout's shapes without any weights, which a checkpoint of it is
    restored into."""
    repeat_kv_heads_for_mesh(model, kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp_size))
    if config.tie_word_embeddings:
        model.model.embed_tokens.transpose_for_head()
    fuse_projections(model, tp_size)
    for _, module in list(nnx.iter_modules(model)):  # GPT-OSS's mxfp4 experts: whole blocks a device
        if hasattr(module, "pad_for_mesh"):
            module.pad_for_mesh(tp_size)


def load_model(
    path: str, dtype: jnp.dtype = jnp.float32, *, on_host: bool = False, tp_size: int = 1
) -> tuple[ModelConfig, nnx.Module]:
    """Parses the config, builds the model and loads its weights onto JAX's default device
    (`on_host`: as NumPy arrays; see `load_weights`). `tp_size > 1` prepares the weights for a
    mesh of that many devices (`models.sharding`): KV heads repeated up to `tp_size` when fewer,
    fused projections in one block a device; placing them is the caller's (`place_state`)."""
    config = ModelConfig.from_pretrained(path)
    model = build(config, dtype)
    keep_checkpoint_float_layers(model, path)  # left float by a quantization pass after the load
    load_weights(model, path, on_host=True)
    prepare_for_serving(model, config, tp_size)
    if not on_host:
        put_on_device(model)
    return config, model
