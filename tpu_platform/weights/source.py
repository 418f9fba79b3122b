# SPDX-License-Identifier: Apache-2.0
"""Where a runner's weights come from, fastest first: a converted model directory (restored onto
the weight shardings), the weights cache (`load_format="npcache"`) when it holds them, else the
checkpoint, streamed tensor by tensor onto the weight shardings (`prepared.load_prepared`) and,
with npcache, stored in the cache for the next start. `load_served_weights` makes that choice and
says which source it took and why (`WeightSource`)."""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from models import ModelConfig
from models.checkpoint_kinds import gguf_4bit_quantization, gguf_float16_scales, gguf_q8_0_embedding
from models.compressed_tensors import quantization_config
from models.mxfp4 import METHODS as MXFP4_METHODS
from models.mxfp4 import is_mxfp4
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.weights.cache import WeightsCache
from tpu_platform.weights.converted import converted_weights, restore_converted
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import ShardingFor, load_prepared


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """The source a model's served weights came from (`name`, as the start-up log says it) and why
    that one (`reason`)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


class ServedWeights(NamedTuple):
    """A model with its served weights, its config, and where the weights came from."""

    config: ModelConfig
    model: nnx.Module
    source: WeightSource


def load_served_weights(
    config: RunnerConfig,
    dtype: jnp.dtype,
    dense_isa: str | None,
    shardings: ShardingFor,
    memo_dir: str | None = None,
) -> ServedWeights:
    """The model of `config.model_path` with its served weights, from the first source that has
    them: a converted model directory, the weights cache (npcache), the checkpoint. `dense_isa`: the
    native dense kernel's instruction set (kernels are packed for it), or None; `memo_dir`: where
    the code digests are memoized (the executable cache's directory)."""
    path = config.model_path
    converted = converted_weights(path)
    # quantized in the source's own layout (a converted directory keeps the one it was converted in)
    quantized = "none"
    if config.quantization in MXFP4_METHODS:  # the checkpoint's mxfp4 experts, kept as they are
        check_mxfp4_checkpoint(path)
    elif config.quantization is not None:
        quantized = "int8" if converted else int8_quantization(path, config.quantization)
    elif converted is None:  # a GGUF's 4-bit blocks as they are, when nothing is asked
        quantized = gguf_4bit_quantization(path) or "none"
    as_shipped = converted is None and config.quantization is None  # a GGUF's own blocks' scales
    preparation = Preparation.for_dense_isa(
        dtype.name, dense_isa, config.tensor_parallel_size, quantized,
        float16_scales=as_shipped and gguf_float16_scales(path),
        float16_head_scales=as_shipped and gguf_q8_0_embedding(path),
    )  # fmt: skip
    if converted is not None:
        model_config = ModelConfig.from_pretrained(path)
        model = restore_converted(converted, model_config, preparation, shardings)
        return ServedWeights(
            model_config, model, WeightSource(CONVERTED, f"{path} is a converted model directory")
        )
    cache = _weights_cache(config, preparation, memo_dir)
    if cache is not None:
        model_config = ModelConfig.from_pretrained(path)
        model = cache.load(model_config, shardings)
        if model is not None:
            reason = f"load_format='npcache' and it holds the {preparation.name} weights"
            return ServedWeights(model_config, model, WeightSource(CACHED, reason))
    model_config, model = load_prepared(path, preparation, shardings)
    if cache is not None:
        cache.store(model_config, model)
    return ServedWeights(model_config, model, WeightSource(CHECKPOINT, _checkpoint_reason(config, cache)))


# The sources' names, fastest first.
CONVERTED = "the converted checkpoint"
CACHED = "the weights cache"
CHECKPOINT = "the checkpoint"


def _checkpoint_reason(config: RunnerConfig, cache: WeightsCache | None) -> str:
    if cache is not None:
        return "the weights cache had no entry for it: stored there for the next start"
    if config.load_format != "npcache":
        return f"load_format={config.load_format!r} (npcache keeps the prepared weights in a weights cache)"
    return "load_format='npcache', but there is no cache directory (VLLM_XLA_CACHE_DIR) to keep them in"


def check_mxfp4_checkpoint(path: str) -> None:
    """vLLM's `quantization="mxfp4"` serves a checkpoint whose experts are mxfp4 as they are
    (GPT-OSS as released); a float checkpoint is not quantized to mxfp4 at load."""
    if not is_mxfp4({"quantization_config": quantization_config(path)}):
        raise ValueError(
            f"quantization='mxfp4' serves a checkpoint whose experts are mxfp4 (GPT-OSS as "
            f"released, quantization_config quant_method 'mxfp4'); {path!r} is not one, and "
            "vllm-xla does not quantize to mxfp4 at load: leave quantization unset, or use "
            "'fp8' or 'int8_per_channel_weight_only'"
        )


def _weights_cache(
    config: RunnerConfig, preparation: Preparation, memo_dir: str | None
) -> WeightsCache | None:
    if config.load_format != "npcache" or not config.cache_dir:
        return None
    directory = os.path.join(config.cache_dir, "weights")
    return WeightsCache.for_model(directory, config.model_path, preparation, memo_dir)
