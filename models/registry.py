# SPDX-License-Identifier: Apache-2.0
"""Architecture registry: HF `architectures` names to model classes, built in or registered.

A package outside this repository adds an architecture with `register_architecture` (vLLM's
`ModelRegistry` learns the name through `plugin_shim.register_flax_model`, which calls it); the
contract a registered class follows is docs/models.md. The registered table is this process's
one registry of architectures, written only by that call (vLLM's general plugins make it in
every process that serves).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import pathlib

import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from models.deepseek_config import DeepseekConfig
from models.gemma2 import Gemma2ForCausalLM
from models.gemma3 import Gemma3ForCausalLM
from models.gemma4 import Gemma4ForCausalLM
from models.gemma4_config import Gemma4Config
from models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from models.gpt_oss import GptOssConfig, GptOssForCausalLM
from models.llama import LlamaForCausalLM
from models.llama4 import Llama4Config, Llama4ForCausalLM
from models.mixtral import MixtralForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM
from models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from models.sequence_classification import LlamaForSequenceClassification, Qwen3ForSequenceClassification

_MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    # The text model only: image inputs are refused at start (`plugin_shim.feature_check`).
    "Llama4ForConditionalGeneration": Llama4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    # Served by a pooling engine only (`runner="pooling"`: vLLM resolves them to it).
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}
# Built-in architectures whose Flax model runs (`build`, `models.loader.load_model`) but which the
# engine does not serve yet, with the reason its start is refused.
_HYBRID_NOT_SERVED = (
    "its Gated DeltaNet layers keep a state per request (conv inputs and a recurrent state), "
    "which the vllm-xla worker does not allocate beside the KV pages yet; the Flax model "
    "runs outside the engine (models.load_model)"
)
_NOT_SERVED: dict[str, str] = {
    "Qwen3NextForCausalLM": _HYBRID_NOT_SERVED,
    "Qwen3_5ForCausalLM": _HYBRID_NOT_SERVED,
    "Qwen3_5MoeForCausalLM": _HYBRID_NOT_SERVED,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(set(_MODEL_CLASSES) - set(_NOT_SERVED)))  # the built-in served ones
# Built-in architectures whose `config.json` has fields of their own (else `ModelConfig`).
_CONFIG_CLASSES: dict[str, type[ModelConfig]] = {
    "GptOssForCausalLM": GptOssConfig,
    "Gemma4ForCausalLM": Gemma4Config,
    "DeepseekV2ForCausalLM": DeepseekConfig,
    "DeepseekV3ForCausalLM": DeepseekConfig,
    "Llama4ForCausalLM": Llama4Config,
    "Llama4ForConditionalGeneration": Llama4Config,
    "Glm4MoeForCausalLM": Glm4MoeConfig,
    "Qwen3NextForCausalLM": Qwen3NextConfig,
    "Qwen3_5ForCausalLM": Qwen3NextConfig,
    "Qwen3_5MoeForCausalLM": Qwen3NextConfig,
}


@dataclasses.dataclass(frozen=True)
class RegisteredArchitecture:
    """An architecture a plugin registered: its classes, or `"module:Class"` names imported on
    first use (a front end that only checks names then never imports the model's code)."""

    model_class: type[nnx.Module] | str
    config_class: type[ModelConfig] | str = ModelConfig


_REGISTERED: dict[str, RegisteredArchitecture] = {}


def register_architecture(
    architecture: str,
    model_class: type[nnx.Module] | str,
    *,
    config_class: type[ModelConfig] | str = ModelConfig,
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
    if known is not None and known != entry:
        raise ValueError(
            f"architecture {architecture!r} is already registered with {known.model_class!r}; "
            f"not registering {model_class!r}"
        )
    _REGISTERED[architecture] = entry


def supported_architectures() -> tuple[str, ...]:
    """Every architecture this process serves: the built-in ones and the registered ones."""
    return tuple(sorted({*SUPPORTED_ARCHITECTURES, *_REGISTERED}))


def _imported(value: type | str) -> type:
    if isinstance(value, type):
        return value
    module, name = value.split(":")
    return getattr(importlib.import_module(module), name)


def model_class(architecture: str) -> type[nnx.Module]:
    """The class serving `architecture`, or a ValueError listing what is supported."""
    if architecture in _MODEL_CLASSES:
        return _MODEL_CLASSES[architecture]
    if architecture in _REGISTERED:
        return _imported(_REGISTERED[architecture].model_class)
    raise ValueError(unsupported_message(architecture))


def config_class(architecture: str) -> type[ModelConfig]:
    """The `ModelConfig` class that parses `architecture`'s `config.json`."""
    if architecture in _CONFIG_CLASSES:
        return _CONFIG_CLASSES[architecture]
    entry = _REGISTERED.get(architecture)
    return ModelConfig if entry is None else _imported(entry.config_class)


def serving_refusal(architecture: str) -> str | None:
    """Why the engine does not serve built-in `architecture` yet, or None when it does."""
    reason = _NOT_SERVED.get(architecture)
    return None if reason is None else f"vllm-xla does not serve {architecture} yet: {reason}"


def unsupported_message(architecture: str) -> str:
    return (
        f"model architecture {architecture!r} is not supported by vllm-xla; supported: "
        f"{', '.join(supported_architectures())} (a plugin adds a Flax model: docs/models.md)"
    )


def architecture_fingerprint(architecture: str) -> str:
    """A hash of a registered architecture's code (every module of the packages its classes
    come from), for naming the programs compiled from it; "" for a built-in one, whose code
    the runner's own fingerprint covers."""
    entry = _REGISTERED.get(architecture)
    if entry is None:
        return ""
    digest = hashlib.sha256()
    for cls in (_imported(entry.model_class), _imported(entry.config_class)):
        for path in _package_sources(cls):
            digest.update(str(path).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _package_sources(cls: type) -> list[pathlib.Path]:
    """The `.py` files of the top-level package that defines `cls` (its one file for a module)."""
    if cls.__module__.split(".")[0] == __name__.split(".")[0]:
        return []  # ours: covered by the runner's own fingerprint
    top = importlib.import_module(cls.__module__.split(".")[0])
    origin = pathlib.Path(inspect.getfile(top))
    if origin.name != "__init__.py":
        return [origin]
    return sorted(origin.parent.rglob("*.py"))


def build(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> nnx.Module:
    """An uninitialised (zero) model of `config`'s architecture in `dtype`."""
    return model_class(config.architecture)(config, dtype=jnp.dtype(dtype))
