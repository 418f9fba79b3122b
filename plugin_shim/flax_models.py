# SPDX-License-Identifier: Apache-2.0
"""Out-of-tree Flax models: registering an architecture with both `models` and vLLM.

vLLM resolves `config.json`'s `architectures` through its own `ModelRegistry` before any platform
hook runs, and reads what a model class supports (generation, pooling, multimodal inputs) from
it. On this platform the model vLLM resolves is never built: a placeholder class stands for the
Flax model, declaring a text-generation model and nothing more.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn

from models.config import ModelConfig
from models.registry import (
    register_architecture,
    serving_refusal,
    supported_architectures,
    unsupported_message,
)

if TYPE_CHECKING:
    from flax import nnx
    from vllm.config import VllmConfig


class FlaxModelPlaceholder(nn.Module):
    """What vLLM's registry inspects for a registered Flax architecture (a text-generation model:
    vLLM's `VllmModelForTextGeneration` methods); building it is an error, since the platform's
    worker serves the Flax model."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        raise RuntimeError(
            f"{type(self).__name__} is a Flax model served by the vllm-xla platform; vLLM's own "
            "model runners cannot build it (is the vllm-xla platform active?)"
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class HybridFlaxModelPlaceholder(FlaxModelPlaceholder):
    """A placeholder declaring a hybrid model (vLLM's `IsHybrid`: state layers beside attention),
    so that vLLM's config steps for hybrids run (`plugin_shim.hybrid`)."""

    is_hybrid: ClassVar[Literal[True]] = True


# Built-in hybrids whose vLLM model module imports what this platform's install leaves out
# (Qwen3.5's imports its vision model, which needs torchvision): vLLM's registry would fail to
# inspect them, so a placeholder stands in for vLLM's class, which is never built here anyway.
# The released checkpoints' multimodal classes are declared text-only so: their text model is
# what this platform serves, and vLLM then refuses image and video inputs itself.
_HYBRID_PLACEHOLDERS = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def register_hybrid_placeholders() -> None:
    """Puts the hybrid placeholders in vLLM's registry (again: the same classes), before vLLM
    resolves the model (`XlaPlatform.pre_register_and_update`)."""
    from vllm import ModelRegistry

    for architecture in _HYBRID_PLACEHOLDERS:
        ModelRegistry.register_model(architecture, _hybrid_placeholder(architecture))


@functools.cache
def _hybrid_placeholder(architecture: str) -> type[HybridFlaxModelPlaceholder]:
    return type(architecture, (HybridFlaxModelPlaceholder,), {"__module__": __name__})


def register_flax_model(
    architecture: str,
    model_class: type[nnx.Module] | str,
    *,
    config_class: type[ModelConfig] | str = ModelConfig,
) -> None:
    """Serves `architecture` with a Flax model on this platform: `models.register_architecture`,
    and vLLM's `ModelRegistry` so that vLLM resolves the name in a checkpoint's `config.json`.

    Call it from a `vllm.general_plugins` entry point (vLLM runs those in every process it
    starts); the contract the classes follow is docs/models.md. A name vLLM has a model of its
    own for keeps it in vLLM's registry (vLLM reads what it supports from it; our worker serves
    the Flax model), so that vLLM without this platform still serves it.
    """
    from vllm import ModelRegistry

    register_architecture(architecture, model_class, config_class=config_class)
    if architecture in ModelRegistry.get_supported_archs():
        return
    placeholder = type(architecture, (FlaxModelPlaceholder,), {"__module__": __name__})
    ModelRegistry.register_model(architecture, placeholder)


def refuse_unsupported_architecture(vllm_config: VllmConfig) -> None:
    """Raises a ValueError listing what is served when the checkpoint's architecture (its
    `config.json`'s `architectures[0]`, which the worker builds) is neither built in nor
    registered by a plugin; vLLM may know it, but its torch model does not run here. A built-in
    architecture the engine does not serve yet is refused with the reason
    (`models.registry.serving_refusal`)."""
    model = vllm_config.model_config
    if model is None:
        return
    architectures = getattr(model.hf_config, "architectures", None) or model.architectures
    if not architectures:
        return
    refusal = serving_refusal(architectures[0])
    if refusal is not None:
        raise ValueError(refusal)
    if architectures[0] not in supported_architectures():
        raise ValueError(unsupported_message(architectures[0]))
