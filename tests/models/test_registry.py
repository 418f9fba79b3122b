# SPDX-License-Identifier: Apache-2.0
"""The architecture registry without vLLM: a registered architecture is built, parsed with its
own config class and named in the supported list; what cannot be registered is refused."""

import dataclasses

import pytest

from models import ModelConfig, architectures, registry
from models.llama import LlamaForCausalLM

HF = {
    "architectures": ["TinyPluginForCausalLM"], "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "extra_scale": 3.0,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ExtraConfig(ModelConfig):
    extra_scale: float = 1.0

    @classmethod
    def from_hf_dict(cls, hf):
        return dataclasses.replace(super().from_hf_dict(hf), extra_scale=float(hf["extra_scale"]))


class TinyPlugin(LlamaForCausalLM):
    pass


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(architectures, "_REGISTERED", {})


def test_a_registered_architecture_is_parsed_built_and_listed():
    assert ModelConfig.from_hf_dict(HF).architecture == "TinyPluginForCausalLM"
    with pytest.raises(ValueError, match="'TinyPluginForCausalLM' is not supported by vllm-xla"):
        registry.model_class("TinyPluginForCausalLM")
    registry.register_architecture("TinyPluginForCausalLM", TinyPlugin, config_class=ExtraConfig)
    config = ModelConfig.from_hf_dict(HF)
    assert type(config) is ExtraConfig and config.extra_scale == 3.0 and config.hidden_size == 16
    assert type(registry.build(config)) is TinyPlugin
    assert "TinyPluginForCausalLM" in registry.supported_architectures()
    assert set(registry.SUPPORTED_ARCHITECTURES) < set(registry.supported_architectures())


def test_classes_named_as_strings_are_imported_when_built():
    name = f"{__name__}:TinyPlugin"
    registry.register_architecture("TinyPluginForCausalLM", name, config_class=f"{__name__}:ExtraConfig")
    assert registry.model_class("TinyPluginForCausalLM") is TinyPlugin
    assert type(ModelConfig.from_hf_dict(HF)) is ExtraConfig


def test_registering_again_is_idempotent_and_a_clash_is_refused():
    registry.register_architecture("TinyPluginForCausalLM", TinyPlugin)
    registry.register_architecture("TinyPluginForCausalLM", TinyPlugin)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_architecture("TinyPluginForCausalLM", LlamaForCausalLM)
    with pytest.raises(ValueError, match="built into vllm-xla"):
        registry.register_architecture("LlamaForCausalLM", TinyPlugin)
    with pytest.raises(ValueError, match="expected 'module:Class'"):
        registry.register_architecture("OtherForCausalLM", "no_class_here")


def test_the_fingerprint_covers_every_module_of_a_plugins_package(tmp_path, monkeypatch):
    assert registry.architecture_fingerprint("LlamaForCausalLM") == ""  # ours: in the runner's own
    package = tmp_path / "fingerprinted_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("SCALE = 1\n")
    (package / "model.py").write_text(
        "from models.llama import LlamaForCausalLM\n\n\nclass Model(LlamaForCausalLM): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_architecture("FingerprintedForCausalLM", "fingerprinted_plugin.model:Model")
    first = registry.architecture_fingerprint("FingerprintedForCausalLM")
    assert first == registry.architecture_fingerprint("FingerprintedForCausalLM")
    (package / "helpers.py").write_text("SCALE = 2\n")  # a module the model may use
    assert registry.architecture_fingerprint("FingerprintedForCausalLM") != first
