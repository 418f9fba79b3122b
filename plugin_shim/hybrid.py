# SPDX-License-Identifier: Apache-2.0
"""Hybrid models (Gated DeltaNet beside full attention: Qwen3-Next, Qwen3.5) through vLLM's
hybrid KV-cache manager: the config steps and the Mamba-style state specs of the state layers
(`tpu_platform.state_cache` holds the pools).

vLLM's own config step for hybrids (`HybridAttentionMambaModelConfig`) turns prefix caching into
`mamba_cache_mode="align"`, which keeps a state a block of tokens so that a cached prefix can
resume from it. The runner keeps one state a request (`mamba_cache_mode="none"`, vLLM's mode
without prefix caching), so prefix caching is turned off for these models, with a warning, as
vLLM turns it off for other models it cannot serve it for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from vllm.logger import init_logger
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from models.config import ModelConfig
from models.sharding import kv_heads_on_mesh
from plugin_shim.cache_dtype import runner_kv_cache_dtype, spec_dtype
from plugin_shim.parallel import mesh_tensor_parallel_size
from tpu_platform.envs import read_env
from tpu_platform.state_cache import page_size_holding_a_state, state_shapes_and_dtypes, state_slot_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.xla.hybrid")


def state_layer_name(index: int) -> str:
    return f"model.layers.{index}.linear_attn"


def is_hybrid(vllm_config: VllmConfig) -> bool:
    model = vllm_config.model_config
    return model is not None and bool(model.is_hybrid)


def configure_hybrid(vllm_config: VllmConfig) -> None:
    """A hybrid model's config: one state a request (`mamba_cache_mode="none"`, its block the
    whole sequence), so prefix caching off (module docstring). Safe to call twice."""
    if not is_hybrid(vllm_config):
        return
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if cache.enable_prefix_caching:
        logger.warning(
            "prefix caching is turned off for %s: vllm-xla keeps one Gated DeltaNet state a request "
            "(mamba_cache_mode='none'), not the per-block states a cached prefix resumes from "
            "('align'); pass --no-enable-prefix-caching to start without it",
            model.architecture,
        )
        cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len
    _pages_hold_a_state(vllm_config)


def _pages_hold_a_state(vllm_config: VllmConfig) -> None:
    """Raises the block size to the smallest multiple of it whose KV page holds a request's
    state in one layer, as vLLM does for hybrids on its own platforms (the engine wants one page
    size for every group: `state_specs`); the user's block size too, as vLLM overrides it."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    config = ModelConfig.from_hf_dict(model.hf_config.to_dict())
    if not config.state_layers:
        return
    kv_dtype = jnp.dtype(runner_kv_cache_dtype(cache) or _model_dtype(model))
    tp_size = mesh_tensor_parallel_size(vllm_config)  # pages and states are counted per device
    kv_heads = kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp_size) // tp_size
    conv_dtype = jnp.dtype(_model_dtype(model))
    block_size = page_size_holding_a_state(  # pages counted at least, in any layout
        config, cache.block_size, kv_heads, kv_dtype, conv_dtype, tp_size,
        power_of_two=read_env().platform == "gpu",  # the Pallas GPU kernels' tiles
    )  # fmt: skip
    if block_size == cache.block_size:
        return
    logger.info(
        "block size %d -> %d for %s: a KV page must hold a Gated DeltaNet state (%d B)",
        cache.block_size, block_size, model.architecture, state_slot_bytes(config, conv_dtype, tp_size),
    )  # fmt: skip
    cache.block_size = block_size


def _model_dtype(model) -> str:
    return str(model.dtype).removeprefix("torch.")


def with_state_specs(
    attention_specs: dict[str, KVCacheSpec], states: dict[str, KVCacheSpec], num_layers: int
) -> dict[str, KVCacheSpec]:
    """Every layer's spec in layer order: a state layer's from `states`, the others' from
    `attention_specs` (whose entries for state layers are dropped). vLLM numbers the groups by
    the order in which it meets each kind, which `KVLayout.for_model` follows."""
    from plugin_shim.worker import layer_name  # the worker imports this module

    ordered = {}
    for i in range(num_layers):
        name = state_layer_name(i)
        if name in states:
            ordered[name] = states[name]
        elif layer_name(i) in attention_specs:
            ordered[layer_name(i)] = attention_specs[layer_name(i)]
    return ordered


def state_specs(
    config: ModelConfig, vllm_config: VllmConfig, conv_dtype: jnp.dtype, page_bytes: int, tp_size: int = 1
) -> dict[str, KVCacheSpec]:
    """vLLM's Mamba-style spec of each state layer: its conv and recurrent state shapes as the
    pools hold them on one device of a mesh of `tp_size` (pages are per device), one block a
    request (`mamba_cache_mode="none"`; 1 + k under speculative decoding with k drafts), padded
    to `page_bytes` (the
    attention layers' page: the engine wants one page size; the pools hold the state unpadded).
    A state larger than a page is refused, naming the block size that fits it."""
    shapes, dtypes = state_shapes_and_dtypes(config, conv_dtype, tp_size)
    cache = vllm_config.cache_config
    spec = MambaSpec(
        block_size=cache.mamba_block_size or vllm_config.model_config.max_model_len,
        shapes=shapes,
        dtypes=tuple(spec_dtype(jnp.dtype(d).name) for d in dtypes),
        page_size_padded=page_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cache.mamba_cache_mode,
        # Under speculative decoding, k more blocks: a state after each verified row, as vLLM's
        # own layers ask (`tpu_platform.state_cache`).
        num_speculative_blocks=vllm_config.num_speculative_tokens,
    )
    state_bytes = spec.state_content_size_bytes
    if state_bytes > page_bytes:
        per_token = page_bytes // cache.block_size
        fits = -(-state_bytes // per_token)
        raise ValueError(
            f"a Gated DeltaNet state takes {state_bytes} B a request, more than a {cache.block_size}-"
            f"token KV page ({page_bytes} B): the engine needs pages at least as large; pass "
            f"--block-size {-(-fits // 16) * 16} or more"
        )
    return {state_layer_name(i): spec for i in config.state_layers}
