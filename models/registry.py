# SPDX-License-Identifier: Apache-2.0
"""Architecture registry: HF `architectures` names to model classes."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_MODEL_CLASSES))


def model_class(architecture: str) -> type[nnx.Module]:
    """The class serving `architecture`, or a ValueError listing what is supported."""
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported by vllm-xla; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def build(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> nnx.Module:
    """An uninitialised (zero) model of `config`'s architecture in `dtype`."""
    return model_class(config.architecture)(config, dtype=jnp.dtype(dtype))
