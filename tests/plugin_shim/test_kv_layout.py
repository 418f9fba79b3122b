# SPDX-License-Identifier: Apache-2.0
"""The KV layout the worker builds from vLLM's KV-cache groups is the one the planner derives from
the model, for every served architecture.

vLLM's own grouping (`get_kv_cache_groups`, what the engine core runs on the worker's specs)
groups the layers of each architecture's tiny test configuration and of the planner's real model
configurations (Gemma 2's alternating windows at 42 layers, Gemma 3's five sliding layers to one
full one at 26); `plugin_shim.worker.kv_layout` turns the groups into our `KVLayout`, which must
equal `KVLayout.for_model` of the same configuration (what the planner and the compile-only
tests compile)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import KVCacheConfig

from models import ModelConfig
from models.registry import SUPPORTED_ARCHITECTURES
from plugin_shim.worker import kv_layout, layer_kv_specs
from tests.models.tiny_checkpoints import _COMMON, TINY
from tpu_platform.plan import known_models, model_config
from tpu_platform.step_program import KVLayout

# Architectures whose layers' windows the tiny Llama's configuration gives (all full attention).
_LIKE_LLAMA = {"LlamaForCausalLM", "LlamaForSequenceClassification", "Qwen3ForSequenceClassification"}


def _tiny_config(architecture: str) -> ModelConfig:
    overrides = TINY[architecture][1] if architecture in TINY else {}
    return ModelConfig.from_hf_dict({**_COMMON, **overrides, "architectures": [architecture]})


def _gemma3_26_layers() -> ModelConfig:
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    return dataclasses.replace(
        _tiny_config("Gemma3ForCausalLM"), num_layers=26, layer_sliding_windows=windows
    )


def _vllm_groups(config: ModelConfig) -> KVCacheConfig:
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # what the engine resolves for our worker
    specs = layer_kv_specs(
        config.layer_sliding_windows, block_size=16, num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=get_kv_cache_groups(vllm_config, specs)
    )


CONFIGS = {
    **{arch: _tiny_config(arch) for arch in SUPPORTED_ARCHITECTURES},
    **{name: model_config(name) for name in known_models()},
    "gemma-3 (26 layers)": _gemma3_26_layers(),
    # 12 sliding and 13 full layers: nearly as many of each kind, one group of each.
    "12 sliding, 13 full": dataclasses.replace(
        _tiny_config("Gemma2ForCausalLM"), num_layers=25, layer_sliding_windows=(10,) * 12 + (None,) * 13
    ),
}


def test_every_served_architecture_has_a_configuration_here():
    assert set(SUPPORTED_ARCHITECTURES) <= set(TINY) | _LIKE_LLAMA


@pytest.mark.parametrize("name", CONFIGS)
def test_the_engine_groups_the_layers_as_the_planner_does(name):
    config = CONFIGS[name]
    from_vllm = kv_layout(_vllm_groups(config), config.num_layers)
    assert from_vllm == KVLayout.for_model(config)


def test_mixed_windows_make_groups_sharing_caches():
    layout = KVLayout.for_model(CONFIGS["gemma-2-9b"])
    assert (layout.num_groups, layout.num_caches) == (2, 21)
    gemma3 = KVLayout.for_model(CONFIGS["gemma-3 (26 layers)"])
    assert gemma3.num_groups > 2 and gemma3.num_caches < 26
