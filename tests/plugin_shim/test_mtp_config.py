# SPDX-License-Identifier: Apache-2.0
"""Speculative method 'mtp' through vLLM's own configuration path: a DeepSeek-V3 checkpoint with
one MTP layer is served (vLLM's async-scheduling default turned off, the runner pointed at the
target's own checkpoint); refused by name at start: `num_speculative_tokens` out of range, tensor
parallelism, and (vLLM refusing them first) a target without one MTP layer or of another
architecture. A checkpoint whose config says one layer but holds no tensors of it is refused by
name when the runner loads it (tests/models/test_mtp.py)."""

import json
import pathlib
import shutil
import types

import pytest
from vllm.engine.arg_utils import EngineArgs

from plugin_shim import feature_check
from plugin_shim.speculative import runner_speculation, unsupported_speculation
from tests.models.tiny_deepseek import _COMMON, VARIANTS
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Config-only directories (vLLM's configuration reads config.json and the tokenizer): a tiny
    Llama, and DeepSeek-V3 configs with one MTP layer and with none."""
    from transformers import DeepseekV3Config

    root = tmp_path_factory.mktemp("mtp_config")
    llama = save_tiny_llama(str(root / "llama"))
    architecture, _, overrides = VARIANTS["v3_noaux_yarn"]
    v3 = {**DeepseekV3Config(**{**_COMMON, **overrides}).to_dict(), "architectures": [architecture]}
    dirs = {"llama": llama}
    for name, layers in (("v3_mtp", 1), ("v3_no_mtp", 0)):
        path = root / name
        shutil.copytree(llama, path, ignore=shutil.ignore_patterns("*.safetensors"))
        (path / "config.json").write_text(json.dumps({**v3, "num_nextn_predict_layers": layers}))
        dirs[name] = str(path)
    return dirs


def _config(model: str, k: int = 2, **kwargs):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    return EngineArgs(
        model=model, max_model_len=128, speculative_config=spec, **kwargs
    ).create_engine_config()


def test_a_deepseek_v3_checkpoint_with_its_mtp_layer_is_served(models):
    config = _config(models["v3_mtp"], k=3)
    assert feature_check.refusals(config) == []
    assert config.scheduler_config.async_scheduling is False  # vLLM's default turns it on
    speculation = runner_speculation(config)
    assert (speculation.method, speculation.num_tokens) == ("mtp", 3)
    assert pathlib.Path(speculation.draft_model) == pathlib.Path(models["v3_mtp"])  # the target's own


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(k=9), "num_speculative_tokens=9"),
    ],
)
def test_refused_by_name(models, kwargs, named):
    with pytest.raises(ValueError, match="not supported by vllm-xla") as raised:
        _config(models["v3_mtp"], **kwargs)
    assert named in str(raised.value)


def test_the_layer_is_served_split_as_its_target(models):
    config = _config(models["v3_mtp"], tensor_parallel_size=2)
    assert feature_check.refusals(config) == []
    assert config.speculative_config.draft_tensor_parallel_size == 2


def test_vllm_refuses_mtp_without_a_layer_first(models):
    with pytest.raises(NotImplementedError, match="Unsupported speculative method: 'mtp'"):
        _config(models["llama"])
    with pytest.raises(ZeroDivisionError):  # vLLM's divisibility check, of num_nextn_predict_layers=0
        _config(models["v3_no_mtp"])


@pytest.mark.parametrize(
    ("architecture", "layers", "named"),
    [
        ("DeepseekV3ForCausalLM", 0, "method='mtp' on a checkpoint with num_nextn_predict_layers=0"),
        ("DeepseekV3ForCausalLM", 2, "method='mtp' on a checkpoint with num_nextn_predict_layers=2"),
        (
            "LlamaForCausalLM",
            1,
            "method='mtp' with LlamaForCausalLM (no multi-token-prediction layer served)",
        ),
    ],
)
def test_our_check_names_a_target_without_one_mtp_layer(architecture, layers, named):
    """Ours backs vLLM's: the same config check, on what vLLM would hand it."""
    hf = types.SimpleNamespace(architectures=[architecture], num_nextn_predict_layers=layers)
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(method="mtp", num_speculative_tokens=2),
        scheduler_config=types.SimpleNamespace(async_scheduling=False),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        model_config=types.SimpleNamespace(hf_config=hf),
    )
    assert unsupported_speculation(config) == named


@pytest.mark.parametrize(
    ("layers", "named"), [(1, None), (2, "method='mtp' on a checkpoint with mtp_num_hidden_layers=2")]
)
def test_qwen3_next_counts_its_mtp_layers_by_its_own_field(layers, named):
    """Qwen3-Next and Qwen3.5 name their MTP layers `mtp_num_hidden_layers` (and have no
    `num_nextn_predict_layers`)."""
    hf = types.SimpleNamespace(architectures=["Qwen3NextForCausalLM"], mtp_num_hidden_layers=layers)
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(method="mtp", num_speculative_tokens=2),
        scheduler_config=types.SimpleNamespace(async_scheduling=False),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        model_config=types.SimpleNamespace(hf_config=hf),
    )
    assert unsupported_speculation(config) == named
