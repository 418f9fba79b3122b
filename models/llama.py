# SPDX-License-Identifier: Apache-2.0
"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import Embedding, GatedMLP, Linear, PagedAttention, RMSNorm
from models.metadata import AttentionMetadata

# HF checkpoint name -> our parameter path ("{i}" is the layer index). Linear weights are
# stored [out, in] by HF and transposed on load.
HF_PARAM_MAP = {
    "model.embed_tokens.weight": "model.embed_tokens.embedding",
    "model.norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.kernel",
    "model.layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{
        f"model.layers.{{i}}.self_attn.{p}.{kind}": f"model.layers.{{i}}.self_attn.{p}.{ours}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        for kind, ours in (("weight", "kernel"), ("bias", "bias"))
    },
    **{
        f"model.layers.{{i}}.mlp.{p}.{kind}": f"model.layers.{{i}}.mlp.{p}.{ours}"
        for p in ("gate_proj", "up_proj", "down_proj")
        for kind, ours in (("weight", "kernel"), ("bias", "bias"))
    },
}


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = PagedAttention(config, dtype=dtype, sliding_window=config.sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nnx.List([LlamaDecoderLayer(config, dtype=dtype) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(
        self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[jax.Array], md: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        x = self.embed_tokens(input_ids)  # [T, D]
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, kv_cache = layer(x, positions, kv_cache, md)
            new_caches.append(kv_cache)
        return self.norm(x), new_caches


class LlamaForCausalLM(nnx.Module):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        self.config = config
        self.model = LlamaModel(config, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head = (
            None if tied else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )

    def __call__(
        self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[jax.Array], md: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        return self.model(input_ids, positions, kv_caches, md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[R, D]` hidden states to float32 logits `[R, V]`."""
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden)
        return jnp.einsum("td,dv->tv", hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
