# SPDX-License-Identifier: Apache-2.0
"""Architecture registry: HF `architectures` names to model classes."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.gemma2 import Gemma2ForCausalLM
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.mixtral import MixtralForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM

_MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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
