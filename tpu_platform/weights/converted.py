# SPDX-License-Identifier: Apache-2.0
"""Converted model directories: a model's prepared weights written ahead of time (`vllm-xla convert`).

A converted directory is a model directory like any other for vLLM (config.json, tokenizer,
generation config: copied from the source), whose weights are one Orbax checkpoint of the
prepared state in `xla_prepared/` instead of safetensors or GGUF. Convert once, on a host with
the memory to load the source, copy the directory anywhere, and serve it as the model: each
array is then read straight into its shards on the serving devices, whatever their number.

A conversion keeps the unpacked layout unless asked (`packing`): a runner that packs kernels for
the native CPU dense kernel packs them after the restore, and one that does not (TPU, GPU)
refuses a packed conversion by name.
"""

from __future__ import annotations

import logging
import os
import shutil

import jax
import numpy as np
from flax import nnx

from models import ModelConfig
from models.linear import float_layers
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import (
    ShardingFor,
    UnusableCheckpoint,
    load_prepared,
    metadata_for,
    read_metadata,
    restore_prepared,
    save_prepared,
)

logger = logging.getLogger(f"vllm_xla.{__name__}")

PREPARED_DIR = "xla_prepared"
# Source files that hold weights (not copied: the conversion replaces them).
_WEIGHT_SUFFIXES = (
    ".safetensors", ".safetensors.index.json", ".gguf", ".bin", ".pt", ".pth", ".msgpack", ".h5"
)  # fmt: skip


def converted_weights(model_path: str) -> str | None:
    """The prepared-weights checkpoint of a converted model directory, or None for any other model."""
    candidate = os.path.join(model_path, PREPARED_DIR)
    return candidate if os.path.isdir(candidate) else None


def convert(source: str, out: str, preparation: Preparation) -> str:
    """Loads and prepares the model at `source` (a model directory) and writes it to `out`, a new
    directory: the source's other files and the prepared weights' checkpoint. Returns the
    checkpoint's path."""
    if not os.path.isdir(source) or not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(
            f"{source!r} is not a model directory with a config.json; for a GGUF file, "
            "`vllm-xla model-dir --gguf FILE` makes one"
        )
    if converted_weights(source) is not None:
        raise ValueError(f"{source!r} is already converted; serve it as it is or convert its source")
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out!r} exists and is not empty; name a new directory")
    # Streamed onto the host's CPU device (never an accelerator the whole model may not fit on).
    on_cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    model_config, model = load_prepared(source, preparation, on_cpu)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(out, name))
    state = nnx.state(model)
    checkpoint = os.path.join(out, PREPARED_DIR)
    metadata = metadata_for(
        model_config, preparation, state, float_layers(model), source=os.path.abspath(source)
    )
    save_prepared(checkpoint, state, metadata)
    return checkpoint


def restore_converted(
    checkpoint: str, model_config: ModelConfig, preparation: Preparation, shardings: ShardingFor
) -> nnx.Module:
    """The prepared model restored from a conversion onto `shardings`, packed as `preparation`
    packs when the conversion is unpacked. A conversion that cannot serve so is a ValueError
    naming the fix (there are no source weights beside it to fall back to)."""
    try:
        stored = _stored_preparation(read_metadata(checkpoint))
        if stored.dtype != preparation.dtype:
            raise UnusableCheckpoint(
                f"it holds {stored.dtype} weights and the model runs in {preparation.dtype}: pass "
                f"--dtype {stored.dtype}, or convert the source again with --dtype {preparation.dtype}"
            )
        if stored.int8 and not preparation.int8:  # either int8 layout serves as it was converted
            raise UnusableCheckpoint(
                f"it holds {stored.quantization} weights: serve it with "
                "--quantization int8_per_channel_weight_only, or convert the source again"
            )
        if stored.packing not in ("none", preparation.packing):
            raise UnusableCheckpoint(
                f"its kernels are packed ({stored.packing}) for the native CPU dense kernel, which "
                f"this device does not run ({preparation.packing}): convert with --packing none"
            )
        model = restore_prepared(checkpoint, model_config, stored, shardings, tp_size=preparation.tp_size)
    except UnusableCheckpoint as error:
        raise ValueError(f"the converted weights at {checkpoint} cannot be served: {error}") from error
    if stored.packing != preparation.packing or stored.int8 != preparation.int8:
        # Packing runs only on the CPU device, whose arrays NumPy views in place: repacked on the
        # host (views), the kernels cost one copy each on their way back, not a device op each.
        nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
        preparation.apply(model)
    return model


def _stored_preparation(metadata: dict) -> Preparation:
    dtype, _, rest = str(metadata.get("preparation", "")).partition("-")
    packing, _, tp = rest.partition("-tp")
    packing, int8, group = packing.partition("-int8")
    try:
        return Preparation(dtype, packing, int(tp or 1), f"int8{group}" if int8 else "none")
    except ValueError as error:
        raise UnusableCheckpoint(f"unknown preparation {metadata.get('preparation')!r}") from error
