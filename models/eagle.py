# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-1 draft head (vLLM's `EagleLlamaForCausalLM`, speculative method 'eagle'), in Flax NNX.

The head drafts from the target's final hidden states (after its norm, as every step returns
them): `fc` maps `concat(embed(token), hidden)` (`[T, 2D]`, D the target's width) to `[T, D]`,
then one Llama decoder layer runs on it with its own KV cache; that layer has no input norm (the
EAGLE paper's head drops it, and vLLM builds it as an identity). Its output, with no final norm,
is both what the LM head reads and the hidden state of its next draft step. The embedding and
the LM head are the head's own where the checkpoint holds them (`embed_tokens.weight`,
`lm_head.weight`), else the target's.

Checkpoint layouts read: a Llama `config.json` of one layer (SafeAILab's heads, vLLM's
`EagleLlamaForCausalLM`), or vLLM's `model_type: eagle` whose `model` entry holds it; tensors
`fc.weight` (and `fc.bias` where the head was trained with one), `layers.0.*` as a Llama layer's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoint_reads import checkpoint_names
from models.config import ModelConfig
from models.layers import ATTENTION_LINEARS, MLP_LINEARS, Embedding, GatedMLP, PagedAttention, RMSNorm
from models.linear import Linear
from models.loader import read_into
from models.metadata import AttentionMetadata
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import kv_heads_on_mesh

# What the head's config.json (or its `model` entry) may name: the Llama layout vLLM renames to
# `EagleLlamaForCausalLM` for method 'eagle', or that name itself.
ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
# The first layer's input norm, which a checkpoint may keep but the head does not apply.
_INPUT_NORM = "layers.0.input_layernorm.weight"


@dataclasses.dataclass(frozen=True, slots=True)
class EagleConfig:
    """The head's `config.json`: its decoder layer's hyper-parameters (`model`, one layer)."""

    model: ModelConfig

    @classmethod
    def from_pretrained(cls, path: str) -> EagleConfig:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        nested = hf.get("model")
        if isinstance(nested, dict):  # vLLM's `EAGLEConfig`: the layer's config inside, ours outside
            outer = {k: v for k, v in hf.items() if k not in ("model", "architectures", "model_type")}
            hf = {**nested, **outer}
        architecture = (hf.get("architectures") or [""])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"speculative method 'eagle' takes an EAGLE head of Llama's layout (architectures "
                f"{ARCHITECTURES[0]!r} or {ARCHITECTURES[1]!r}); {path} is {architecture!r}: for an "
                "EAGLE-3 head use method 'eagle3'"
            )
        if hf.get("num_hidden_layers") != 1:
            raise ValueError(
                f"the EAGLE head at {path} has num_hidden_layers={hf.get('num_hidden_layers')}; "
                "vllm-xla serves one-layer heads (the EAGLE papers' and vLLM's examples)"
            )
        return cls(model=ModelConfig.from_hf_dict({**hf, "architectures": ["EagleLlamaForCausalLM"]}))

    def check_target(self, target: ModelConfig) -> None:
        """Refuses by name a head made for a target of another width or vocabulary."""
        mc = self.model
        if mc.vocab_size != target.vocab_size or mc.hidden_size != target.hidden_size:
            raise ValueError(
                f"the EAGLE head was trained for a target of vocab_size={mc.vocab_size} and "
                f"hidden_size={mc.hidden_size}; this target ({target.architecture}) has "
                f"{target.vocab_size} and {target.hidden_size}: use the head made for this target"
            )


def _param_map() -> dict[str, str]:
    table = {
        "fc.weight": "fc.kernel",
        "fc.bias": "fc.bias",
        "lm_head.weight": "lm_head.kernel",
        "embed_tokens.weight": "embed_tokens.embedding",
        "layers.0.post_attention_layernorm.weight": "layer.post_attention_layernorm.weight",
    }
    for name in ATTENTION_LINEARS:
        table[f"layers.0.{name}.weight"] = f"layer.{name}.kernel"
        table[f"layers.0.{name}.bias"] = f"layer.{name}.bias"
    for name in MLP_LINEARS:
        table[f"layers.0.{name}.weight"] = f"layer.{name}.kernel"
    return table


class EagleLayer(nnx.Module):
    """A Llama decoder layer without its input norm: `x += attn(x); x += mlp(norm(x))`."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        self.self_attn = PagedAttention(config, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP.from_config(config, dtype=dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(x, positions, kv_cache, md)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), md), kv_cache


class EagleHead(nnx.Module):
    """The head (module docstring), with the EAGLE-3 head's interface: `combine` (nothing to
    combine), `head(tokens, hidden, positions, kv_cache, md) -> (hidden, kv_cache)`,
    `draft_logits(hidden)` and `target_ids`. Without an embedding or LM head of its own it needs
    `share_embedding` and `share_lm_head` before it runs."""

    hf_param_map = _param_map()

    def __init__(
        self, config: ModelConfig, *, dtype: jnp.dtype, own_embedding: bool, own_lm_head: bool, fc_bias: bool
    ):
        d = config.hidden_size
        self.config = config
        own = Embedding(config.vocab_size, d, dtype=dtype) if own_embedding else None
        self.embed_tokens: Embedding | None = nnx.data(own)
        self.fc = Linear(2 * d, d, bias=fc_bias, dtype=dtype)
        self.layer = EagleLayer(config, dtype=dtype)
        lm_head = Linear(d, config.vocab_size, bias=False, dtype=dtype) if own_lm_head else None
        self.lm_head: Linear | None = nnx.data(lm_head)
        # The target's embedding as its LM head, where the target ties the two (`share_lm_head`;
        # named so that a mesh splits it as the target's embedding: `models.sharding`).
        self.tied_embed_tokens: Embedding | None = nnx.data(None)

    def combine(self, hidden: jax.Array) -> jax.Array:
        """The target's `[T, D]` final hidden states, as they are."""
        return hidden

    def __call__(
        self,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        x = self.fc(jnp.concatenate([self.embed_tokens(tokens, md.mesh), hidden], axis=-1))
        return self.layer(x, positions, kv_cache, md)

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[R, V]` of the head's outputs (no norm before the LM head)."""
        if self.lm_head is None:
            return self.tied_embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head.product(hidden)

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The first layer's input norm, where a checkpoint keeps one: the head does not apply it."""
        return name == _INPUT_NORM

    def share_embedding(self, table: Any) -> None:
        """Uses `table` (the target's `[V, D]` embedding, where it lives) as the head's."""
        self.embed_tokens = Embedding(self.config.vocab_size, self.config.hidden_size, dtype=table.dtype)
        self.embed_tokens.embedding.set_value(table)

    def share_lm_head(self, target_model: nnx.Module) -> None:
        """Uses `target_model`'s LM head (its embedding where the target ties them)."""
        if target_model.lm_head is None:
            self.tied_embed_tokens = target_model.model.embed_tokens
        else:
            self.lm_head = target_model.lm_head


def load_eagle_head(path: str, dtype: jnp.dtype, tp_size: int = 1) -> tuple[EagleConfig, EagleHead]:
    """The head of checkpoint `path` with its weights as host arrays and its projections fused
    (for a mesh of `tp_size` as the target's: `loader.prepare_for_serving`); one without its own
    embedding or LM head needs `share_embedding` / `share_lm_head` before it runs. A checkpoint
    that is not an EAGLE head of Llama's layout is refused by name."""
    config = EagleConfig.from_pretrained(path)
    names = set(checkpoint_names(path))
    if "fc.weight" not in names:
        raise ValueError(
            f"the EAGLE head at {path} has no fc.weight: it is not an EAGLE head (a whole draft "
            "model is served by method 'draft_model')"
        )
    head = EagleHead(
        config.model, dtype=dtype, own_embedding="embed_tokens.weight" in names,
        own_lm_head="lm_head.weight" in names, fc_bias="fc.bias" in names,
    )  # fmt: skip
    read_into(head, path)
    mc = config.model
    repeat_kv_heads_for_mesh(head, kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, tp_size))
    fuse_projections(head, tp_size)
    return config, head
