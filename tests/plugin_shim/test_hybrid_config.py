# SPDX-License-Identifier: Apache-2.0
"""vLLM's configuration of a hybrid model on this platform (plugin_shim/hybrid.py): one state a
request (`mamba_cache_mode='none'`, prefix caching off, which vLLM turns on by default), pages
raised until one holds a Gated DeltaNet state, the state specs the worker reports, and Qwen3.5
resolved by vLLM although its own model module cannot be imported here; under speculation, a
state block a draft more."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import MambaSpec

from models import ModelConfig
from plugin_shim.hybrid import state_specs
from tests.models.tiny_qwen3_next import ARCHITECTURES, save_tiny_qwen3_next
from tpu_platform.state_cache import state_slot_bytes


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    return save_tiny_qwen3_next(str(tmp_path_factory.mktemp("hybrid_config") / "qwen3_next"))


def _engine_config(model: str, **kwargs):
    return EngineArgs(model=model, max_model_len=128, **kwargs).create_engine_config()


# Qwen3.5-MoE's placeholder is registered as Qwen3.5's is: the slow tier checks it.
@pytest.mark.parametrize(
    "architecture",
    [a if a != "Qwen3_5MoeForCausalLM" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES],
)
def test_one_state_a_request_and_no_prefix_caching(tmp_path, architecture):
    model = save_tiny_qwen3_next(str(tmp_path / architecture), architecture=architecture)
    config = _engine_config(model, block_size=16)
    cache = config.cache_config
    assert config.model_config.is_hybrid
    assert not cache.enable_prefix_caching  # vLLM's default turned it on, in 'align' mode
    assert (cache.mamba_cache_mode, cache.mamba_block_size, cache.block_size) == ("none", 128, 16)


def test_pages_grow_until_one_holds_a_state(qwen3_next, tmp_path):
    # 8 value heads of 64 (a 32 KiB float32 state a layer) over 2 KV heads of 16 (256 B a token).
    hf = json.loads((pathlib.Path(qwen3_next) / "config.json").read_text())
    hf.update(linear_num_value_heads=8, linear_value_head_dim=64)
    model = tmp_path / "wide_state"
    model.mkdir()
    for f in pathlib.Path(qwen3_next).iterdir():
        if f.name != "model.safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(json.dumps(hf))
    state = state_slot_bytes(ModelConfig.from_hf_dict(hf), jnp.float32)
    block_size = _engine_config(str(model), block_size=16).cache_config.block_size
    assert block_size % 16 == 0 and (block_size - 16) * 256 < state <= block_size * 256


def test_state_specs_as_the_pools_hold_them(qwen3_next):
    vllm_config = _engine_config(qwen3_next, block_size=16)
    config = ModelConfig.from_pretrained(qwen3_next)
    specs = state_specs(config, vllm_config, jnp.float32, 4096)
    assert list(specs) == [f"model.layers.{i}.linear_attn" for i in (0, 1, 2)]
    spec = specs["model.layers.0.linear_attn"]
    assert isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "none"
    assert spec.shapes == ((3, 96), (4, 16, 8)) and spec.page_size_bytes == 4096
    assert spec.state_content_size_bytes == state_slot_bytes(config, jnp.float32)
    with pytest.raises(ValueError, match="pass --block-size 32 or more"):
        state_specs(config, vllm_config, jnp.float32, 2048)


def test_speculation_asks_for_a_state_block_a_draft(qwen3_next):
    """With k = 3 n-gram drafts the engine gives each state layer 1 + 3 blocks a request: the
    state after each verified row (`tpu_platform.state_cache`)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    vllm_config = _engine_config(qwen3_next, block_size=16, speculative_config=spec)
    config = ModelConfig.from_pretrained(qwen3_next)
    spec = state_specs(config, vllm_config, jnp.float32, 4096)["model.layers.0.linear_attn"]
    assert spec.num_speculative_blocks == 3
    assert spec.max_num_blocks_per_req(vllm_config, 128) == 1 + 3
