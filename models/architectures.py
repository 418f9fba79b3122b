# SPDX-License-Identifier: Apache-2.0
"""The architecture table: HF `architectures` names to the model and config classes that serve
them, built in or registered by a plugin.

Classes are held as `"module:Class"` names and imported on first use, so this module imports
nothing of the models: `models.config` reads it while parsing a `config.json`, and a front end
that only checks names never imports a model's code. A package outside this repository adds an
architecture with `register_architecture` (vLLM's `ModelRegistry` learns the name through
`plugin_shim.register_flax_model`, which calls it); the contract a registered class follows is
docs/models.md. The registered table is this process's one registry of architectures, written
only by that call (vLLM's general plugins make it in every process that serves).
"""

from __future__ import annotations

import dataclasses
import importlib

_DEFAULT_CONFIG = "models.config:ModelConfig"

_MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "models.gemma3:Gemma3ForCausalLM",
    "Gemma4ForCausalLM": "models.gemma4:Gemma4ForCausalLM",
    # The text model only: image and audio inputs are refused at start (`plugin_shim.feature_check`).
    "Gemma4ForConditionalGeneration": "models.gemma4:Gemma4ForCausalLM",
    "MixtralForCausalLM": "models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "models.deepseek:DeepseekV3ForCausalLM",
    "Llama4ForCausalLM": "models.llama4:Llama4ForCausalLM",
    # The text model only: image inputs are refused at start (`plugin_shim.feature_check`).
    "Llama4ForConditionalGeneration": "models.llama4:Llama4ForCausalLM",
    "Glm4MoeForCausalLM": "models.glm4_moe:Glm4MoeForCausalLM",
    "Qwen3NextForCausalLM": "models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "models.qwen3_next:Qwen3NextForCausalLM",
    # The text model only (the released checkpoints'): vLLM sees no multimodal model here.
    "Qwen3_5ForConditionalGeneration": "models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "models.qwen3_next:Qwen3NextForCausalLM",
    # Served by a pooling engine only (`runner="pooling"`: vLLM resolves them to it).
    "LlamaForSequenceClassification": "models.sequence_classification:LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": "models.sequence_classification:Qwen3ForSequenceClassification",
}
# Built-in architectures whose Flax model runs (`build`, `models.loader.load_model`) but which the
# engine does not serve yet, with the reason its start is refused.
_NOT_SERVED: dict[str, str] = {}
SUPPORTED_ARCHITECTURES = tuple(sorted(set(_MODEL_CLASSES) - set(_NOT_SERVED)))  # the built-in served ones
# Built-in architectures whose `config.json` has fields of their own (else `ModelConfig`).
_CONFIG_CLASSES: dict[str, str] = {
    "GptOssForCausalLM": "models.gpt_oss:GptOssConfig",
    "Gemma4ForCausalLM": "models.gemma4_config:Gemma4Config",
    "Gemma4ForConditionalGeneration": "models.gemma4_config:Gemma4Config",
    "DeepseekV2ForCausalLM": "models.deepseek_config:DeepseekConfig",
    "DeepseekV3ForCausalLM": "models.deepseek_config:DeepseekConfig",
    "Llama4ForCausalLM": "models.llama4:Llama4Config",
    "Llama4ForConditionalGeneration": "models.llama4:Llama4Config",
    "Glm4MoeForCausalLM": "models.glm4_moe:Glm4MoeConfig",
    "Qwen3NextForCausalLM": "models.qwen3_next:Qwen3NextConfig",
    "Qwen3_5ForCausalLM": "models.qwen3_next:Qwen3NextConfig",
    "Qwen3_5MoeForCausalLM": "models.qwen3_next:Qwen3NextConfig",
    "Qwen3_5ForConditionalGeneration": "models.qwen3_next:Qwen3NextConfig",
    "Qwen3_5MoeForConditionalGeneration": "models.qwen3_next:Qwen3NextConfig",
}


@dataclasses.dataclass(frozen=True)
class RegisteredArchitecture:
    """An architecture a plugin registered: its classes, or `"module:Class"` names imported on
    first use."""

    model_class: type | str
    config_class: type | str = _DEFAULT_CONFIG


_REGISTERED: dict[str, RegisteredArchitecture] = {}


def register_architecture(
    architecture: str, model_class: type | str, *, config_class: type | str = _DEFAULT_CONFIG
) -> None:
    """Serves checkpoints whose `config.json` names `architecture` (`architectures[0]`) with
    `model_class`, a Flax NNX module following docs/models.md (`"module:Class"` imports it when
    first built). `config_class`, a frozen dataclass subclassing `ModelConfig` whose
    `from_hf_dict` also reads the architecture's own `config.json` fields, parses its configs.

    Registering the same classes again does nothing; a built-in name, or a name registered with
    other classes, is a ValueError.
    """
    entry = RegisteredArchitecture(model_class, config_class)
    for value, kind in ((model_class, "model_class"), (config_class, "config_class")):
        if not isinstance(value, (type, str)):
            raise TypeError(f"{kind} must be a class or a 'module:Class' string, not {value!r}")
        if isinstance(value, str) and value.count(":") != 1:
            raise ValueError(f"{kind} {value!r}: expected 'module:Class'")
    if architecture in _MODEL_CLASSES:
        raise ValueError(
            f"architecture {architecture!r} is built into vllm-xla and cannot be replaced; "
            "register the model under its own name (its config.json's architectures[0])"
        )
    known = _REGISTERED.get(architecture)
    if known is not None and _same(known, entry):
        return
    if known is not None:
        raise ValueError(
            f"architecture {architecture!r} is already registered with {known.model_class!r}; "
            f"not registering {model_class!r}"
        )
    _REGISTERED[architecture] = entry


def _same(a: RegisteredArchitecture, b: RegisteredArchitecture) -> bool:
    return a == b or (
        imported(a.model_class) is imported(b.model_class)
        and imported(a.config_class) is imported(b.config_class)
    )


def supported_architectures() -> tuple[str, ...]:
    """Every architecture this process serves: the built-in ones and the registered ones."""
    return tuple(sorted({*SUPPORTED_ARCHITECTURES, *_REGISTERED}))


def registered(architecture: str) -> RegisteredArchitecture | None:
    """A plugin's entry for `architecture`; None for a built-in or unknown one."""
    return _REGISTERED.get(architecture)


def imported(value: type | str) -> type:
    """`value` itself, or the class a `"module:Class"` name points to (imported now)."""
    if isinstance(value, type):
        return value
    module, name = value.split(":")
    return getattr(importlib.import_module(module), name)


def model_class(architecture: str) -> type:
    """The class serving `architecture`, or a ValueError listing what is supported."""
    if architecture in _MODEL_CLASSES:
        return imported(_MODEL_CLASSES[architecture])
    if architecture in _REGISTERED:
        return imported(_REGISTERED[architecture].model_class)
    raise ValueError(unsupported_message(architecture))


def config_class(architecture: str) -> type:
    """The `ModelConfig` class that parses `architecture`'s `config.json`."""
    if architecture in _CONFIG_CLASSES:
        return imported(_CONFIG_CLASSES[architecture])
    entry = _REGISTERED.get(architecture)
    return imported(_DEFAULT_CONFIG if entry is None else entry.config_class)


def serving_refusal(architecture: str) -> str | None:
    """Why the engine does not serve built-in `architecture` yet, or None when it does."""
    reason = _NOT_SERVED.get(architecture)
    return None if reason is None else f"vllm-xla does not serve {architecture} yet: {reason}"


def unsupported_message(architecture: str) -> str:
    return (
        f"model architecture {architecture!r} is not supported by vllm-xla; supported: "
        f"{', '.join(supported_architectures())} (a plugin adds a Flax model: docs/models.md)"
    )
