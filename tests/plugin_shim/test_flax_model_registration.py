# SPDX-License-Identifier: Apache-2.0
"""`plugin_shim.register_flax_model` in this process, through vLLM's own configuration (no
engine): vLLM resolves a registered architecture it did not know, keeps its own model of a name
it knows, and an architecture nothing serves here is refused with the served list."""

import json
import pathlib
import shutil

import pytest
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs

from models import architectures, registry, supported_architectures
from models.llama import LlamaForCausalLM
from plugin_shim import register_flax_model
from tests.tiny_models import save_tiny_llama


class RegisteredLlama(LlamaForCausalLM):
    pass


@pytest.fixture(autouse=True)
def fresh_registries(monkeypatch):
    monkeypatch.setattr(architectures, "_REGISTERED", {})
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("registration") / "llama"))


def _variant(llama: str, tmp_path: pathlib.Path, **fields) -> str:
    path = tmp_path / "variant"
    shutil.copytree(llama, path, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((pathlib.Path(llama) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, **fields)))
    return str(path)


def _config(model: str, **kwargs):
    return EngineArgs(model=model, max_model_len=64, **kwargs).create_engine_config()


def test_vllm_resolves_a_registered_architecture_as_a_generation_model(llama, tmp_path):
    model = _variant(llama, tmp_path, architectures=["RegisteredLlamaForCausalLM"])
    with pytest.raises(ValueError, match="RegisteredLlamaForCausalLM"):  # vLLM's own refusal
        _config(model)
    register_flax_model("RegisteredLlamaForCausalLM", RegisteredLlama)
    config = _config(model)
    assert config.model_config.architecture == "RegisteredLlamaForCausalLM"
    assert config.model_config.runner_type == "generate"
    assert "RegisteredLlamaForCausalLM" in supported_architectures()
    placeholder = ModelRegistry.models["RegisteredLlamaForCausalLM"].load_model_cls()
    with pytest.raises(RuntimeError, match="Flax model served by the vllm-xla platform"):
        placeholder(vllm_config=config)


def test_a_name_vllm_serves_itself_keeps_vllms_model(llama, tmp_path):
    vllms_own = ModelRegistry.models["GraniteForCausalLM"]
    register_flax_model("GraniteForCausalLM", RegisteredLlama)
    assert ModelRegistry.models["GraniteForCausalLM"] is vllms_own
    assert registry.model_class("GraniteForCausalLM") is RegisteredLlama


def test_an_architecture_vllm_knows_but_nothing_here_serves_is_refused_at_config(llama, tmp_path):
    # vLLM serves it with its own Llama; no Flax model here is registered under the name.
    model = _variant(llama, tmp_path, architectures=["InternLM3ForCausalLM"])
    with pytest.raises(ValueError) as raised:
        _config(model)
    text = str(raised.value)
    assert "model architecture 'InternLM3ForCausalLM' is not supported by vllm-xla" in text
    assert ", ".join(supported_architectures()) in text


def test_an_architecture_whose_flax_model_is_not_served_yet_is_refused_with_the_reason(tmp_path, monkeypatch):
    # A built-in Flax model the engine would not serve (none is listed today): Qwen3-Next stands in.
    from models import architectures
    from tests.models.tiny_qwen3_next import save_tiny_qwen3_next

    monkeypatch.setitem(architectures._NOT_SERVED, "Qwen3NextForCausalLM", "its layers are not wired yet")
    model = save_tiny_qwen3_next(str(tmp_path / "qwen3_next"))
    with pytest.raises(ValueError, match=r"not serve Qwen3NextForCausalLM yet: its layers are not wired"):
        _config(model)
