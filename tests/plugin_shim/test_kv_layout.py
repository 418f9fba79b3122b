# SPDX-License-Identifier: Apache-2.0
"""The KV layout the worker builds from vLLM's KV-cache groups is the one the planner derives from
the model, for every served architecture.

vLLM's own grouping (`get_kv_cache_groups`, what the engine core runs on the worker's specs)
groups the layers of each architecture's tiny test configuration and of the planner's real model
configurations (Gemma 2's alternating windows at 42 layers, Gemma 3's five sliding layers to one
full one at 26, GPT-OSS's sliding and full layers in turn, DeepSeek V2/V3's latent caches under
vLLM's MLA spec), from the specs the worker gives the engine; `plugin_shim.worker.kv_layout`
turns the groups into our `KVLayout`, which must equal `KVLayout.for_model` of the same
configuration (what the planner and the compile-only tests compile). Hybrid models (Gated
DeltaNet beside full attention) give the engine a Mamba-style spec for each state layer
(`plugin_shim.hybrid`): the tiny Qwen3-Next and Qwen3.5, and a Qwen3-Next-80B-shaped 48 layers
(36 linear, 12 full)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import KVCacheConfig

from models import ModelConfig
from models.registry import SUPPORTED_ARCHITECTURES
from plugin_shim.hybrid import state_specs, with_state_specs
from plugin_shim.worker import kv_layout, latent_kv_specs, layer_kv_specs
from tests.models import tiny_deepseek, tiny_glm4_moe, tiny_qwen3_next
from tests.models.tiny_checkpoints import _COMMON, TINY
from tpu_platform.planner.plan import known_models, model_config
from tpu_platform.state_cache import state_slot_bytes
from tpu_platform.step_program import KVLayout

# Architectures whose layers' windows the tiny Llama's configuration gives (all full attention).
_LIKE_LLAMA = {"LlamaForCausalLM", "LlamaForSequenceClassification", "Qwen3ForSequenceClassification"}
_DEEPSEEK_ARCHITECTURES = {architecture for architecture, _, _ in tiny_deepseek.VARIANTS.values()}


def _tiny_config(architecture: str) -> ModelConfig:
    overrides = TINY[architecture][1] if architecture in TINY else {}
    return ModelConfig.from_hf_dict({**_COMMON, **overrides, "architectures": [architecture]})


def _tiny_glm4_moe() -> ModelConfig:
    overrides = tiny_glm4_moe.VARIANTS["qk_norm"]
    architecture = "Glm4MoeForCausalLM"
    return ModelConfig.from_hf_dict({**tiny_glm4_moe._COMMON, **overrides, "architectures": [architecture]})


def _tiny_deepseek(variant: str) -> ModelConfig:
    architecture, _, overrides = tiny_deepseek.VARIANTS[variant]
    return ModelConfig.from_hf_dict({**tiny_deepseek._COMMON, **overrides, "architectures": [architecture]})


def _gemma3_26_layers() -> ModelConfig:
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    return dataclasses.replace(
        _tiny_config("Gemma3ForCausalLM"), num_layers=26, layer_sliding_windows=windows
    )


def _tiny_hybrid(architecture: str, **overrides) -> ModelConfig:
    fields = tiny_qwen3_next.ARCHITECTURES[architecture][1]
    return ModelConfig.from_hf_dict({**fields, **overrides, "architectures": [architecture]})


def _vllm_groups(config: ModelConfig) -> KVCacheConfig:
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # what the engine resolves for our worker
    if config.state_layers:
        return _vllm_hybrid_groups(config, vllm_config)
    if config.latent_cache_width:  # as the worker describes a latent cache
        specs = latent_kv_specs(
            config.num_layers, block_size=16, head_size=config.latent_cache_width, dtype=torch.bfloat16,
            cache_dtype_str="auto",
        )  # fmt: skip
    else:
        specs = layer_kv_specs(
            config.layer_sliding_windows, config.layer_attention_chunks, _sources(config), block_size=16,
            num_kv_heads=config.num_kv_heads, head_size=config.head_dim, dtype=torch.bfloat16,
        )  # fmt: skip
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=get_kv_cache_groups(vllm_config, specs)
    )


def _vllm_hybrid_groups(config: ModelConfig, vllm_config: VllmConfig) -> KVCacheConfig:
    """The engine's groups of a hybrid's specs as the worker gives them: pages large enough for a
    state (the worker refuses smaller ones), the state specs padded to a page."""
    vllm_config.cache_config.mamba_block_size = 4096
    per_token = 2 * config.num_kv_heads * config.head_dim * 2  # bfloat16 K and V
    block_size = -(-state_slot_bytes(config, jnp.float32) // per_token // 16) * 16
    specs = layer_kv_specs(
        config.layer_sliding_windows, config.layer_attention_chunks, block_size=block_size,
        num_kv_heads=config.num_kv_heads, head_size=config.head_dim, dtype=torch.bfloat16,
    )  # fmt: skip
    states = state_specs(config, vllm_config, jnp.float32, block_size * per_token)
    specs = with_state_specs(specs, states, config.num_layers)
    groups = get_kv_cache_groups(vllm_config, specs)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _sources(config: ModelConfig) -> tuple[int, ...]:
    """The layer whose cache each layer reads (Gemma 4's KV-shared layers read an earlier one's)."""
    return tuple(config.kv_source(i) for i in range(config.num_layers))


_DEEPSEEK = {variant: _tiny_deepseek(variant) for variant in tiny_deepseek.VARIANTS}
_OWN_TINY = {
    "Glm4MoeForCausalLM": _tiny_glm4_moe,
    # Served as its text model: the text model's layers.
    "Llama4ForConditionalGeneration": lambda: _tiny_config("Llama4ForCausalLM"),
    "Gemma4ForConditionalGeneration": lambda: _tiny_config("Gemma4ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": lambda: _tiny_hybrid("Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": lambda: _tiny_hybrid("Qwen3_5MoeForCausalLM"),
    **{arch: lambda arch=arch: _tiny_hybrid(arch) for arch in tiny_qwen3_next.ARCHITECTURES},
}
CONFIGS = {
    **{
        arch: _OWN_TINY[arch]() if arch in _OWN_TINY else _tiny_config(arch)
        for arch in SUPPORTED_ARCHITECTURES
        if arch not in _DEEPSEEK_ARCHITECTURES
    },
    **{f"tiny deepseek {variant}": config for variant, config in _DEEPSEEK.items()},
    **{name: model_config(name) for name in known_models()},
    "gemma-3 (26 layers)": _gemma3_26_layers(),
    # 12 sliding and 13 full layers: nearly as many of each kind, one group of each.
    # Qwen3-Next-80B's pattern: 36 Gated DeltaNet layers, every 4th of 48 full attention.
    "qwen3-next 48 layers": _tiny_hybrid("Qwen3NextForCausalLM", num_hidden_layers=48),
    "12 sliding, 13 full": dataclasses.replace(
        _tiny_config("Gemma2ForCausalLM"), num_layers=25, layer_sliding_windows=(10,) * 12 + (None,) * 13
    ),
}


def test_every_served_architecture_has_a_configuration_here():
    assert set(SUPPORTED_ARCHITECTURES) <= set(TINY) | _LIKE_LLAMA | _DEEPSEEK_ARCHITECTURES | set(_OWN_TINY)
    # The planner's real configurations of the newest kinds of cache are among them too.
    assert {"deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_engine_groups_the_layers_as_the_planner_does(name):
    config = CONFIGS[name]
    from_vllm = kv_layout(_vllm_groups(config), config.num_layers, _sources(config), config.state_layers)
    assert from_vllm == KVLayout.for_model(config)


def test_a_hybrid_has_state_groups_and_a_cache_a_layer():
    layout = KVLayout.for_model(CONFIGS["qwen3-next 48 layers"])
    assert layout.state_layers == tuple(i for i in range(48) if (i + 1) % 4)
    # The 12 full-attention layers make one group; the 36 state layers three of 12.
    assert layout.num_groups == 4 and layout.num_caches == 48 and layout.layer_caches == tuple(range(48))
    assert {layout.layer_groups[i] for i in range(3, 48, 4)} == {layout.layer_groups[3]}


def test_mixed_windows_make_groups_sharing_caches():
    layout = KVLayout.for_model(CONFIGS["gemma-2-9b"])
    assert (layout.num_groups, layout.num_caches) == (2, 21)
    gemma3 = KVLayout.for_model(CONFIGS["gemma-3 (26 layers)"])
    assert gemma3.num_groups > 2 and gemma3.num_caches < 26


def test_latent_and_alternating_caches_have_the_engines_layout():
    # DeepSeek: one group, one latent cache a layer; GPT-OSS: sliding and full layers in turn,
    # one group of each kind, the k-th layer of each sharing cache k.
    deepseek = KVLayout.for_model(CONFIGS["deepseek-v3"])
    assert (deepseek.num_groups, deepseek.num_caches) == (1, CONFIGS["deepseek-v3"].num_layers)
    gpt_oss = CONFIGS["gpt-oss-20b"]
    layout = KVLayout.for_model(gpt_oss)
    assert (layout.num_groups, layout.num_caches) == (2, gpt_oss.num_layers // 2)
    assert layout.layer_groups[:4] == (0, 1, 0, 1) and layout.layer_caches[:4] == (0, 0, 1, 1)
