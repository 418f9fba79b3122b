# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-3 draft head (vLLM's `LlamaForCausalLMEagle3` checkpoints), in Flax NNX.

The head drafts from the target's own hidden states: `fc` maps the concatenated residual streams
of three chosen target layers (`[T, 3 * D_target]`) to its width D, and one decoder layer runs on
`concat(input_layernorm(embed(token)), hidden_norm(hidden))` (2D into q/k/v) with its own KV
cache, then `norm` and an LM head over a draft vocabulary whose ids map to the target's through
`d2t` (target id = draft id + d2t[draft id]) when the checkpoint has it. Its output before `norm`
is the hidden state of its next step. A checkpoint without `embed_tokens` shares the target's.

Checkpoint names: `midlayer.*` (or `layers.0.*`), `fc.weight`, `norm.weight`, `lm_head.weight`,
`d2t`, optionally `embed_tokens.weight`; `t2d` is not needed.
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
from models.linear import Linear, zeros_param
from models.loader import read_into
from models.metadata import AttentionMetadata
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import kv_heads_on_mesh

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Variants of the head vLLM also reads, not built here (each a config.json flag).
_UNBUILT_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "parallel_drafting")


@dataclasses.dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The head's `config.json`: its decoder's hyper-parameters (`model`: one layer), the draft
    vocabulary, the target's width and the target layers whose inputs it reads (None: vLLM's
    default choice for the target's depth, `default_aux_layers`)."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False

    @classmethod
    def from_pretrained(cls, path: str) -> Eagle3Config:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        architecture = (hf.get("architectures") or [""])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"speculative method 'eagle3' takes an EAGLE-3 head checkpoint (architectures "
                f"{ARCHITECTURES[0]!r}); {path} is {architecture!r}"
            )
        eagle = hf.get("eagle_config") or {}
        unbuilt = [flag for flag in _UNBUILT_FLAGS if eagle.get(flag, hf.get(flag))]
        if unbuilt or eagle.get("use_aux_hidden_state", True) is False or hf["num_hidden_layers"] != 1:
            raise ValueError(
                f"the EAGLE-3 head at {path} is a variant vllm-xla does not build ({unbuilt or ''} "
                f"use_aux_hidden_state={eagle.get('use_aux_hidden_state', True)}, "
                f"num_hidden_layers={hf['num_hidden_layers']}); use a one-layer head of vLLM's "
                "LlamaForCausalLMEagle3 layout"
            )
        ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        model = ModelConfig.from_hf_dict({**hf, "architectures": [architecture]})
        return cls(
            model=model,
            draft_vocab_size=hf.get("draft_vocab_size") or model.vocab_size,
            target_hidden_size=hf.get("target_hidden_size") or model.hidden_size,
            num_aux_hidden_states=hf.get("num_aux_hidden_states") or (len(ids) if ids else 3),
            aux_layer_ids=tuple(ids) if ids else None,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
        )

    def aux_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layers whose inputs the head reads, in layer order (index `num_layers`: the
        last layer's output); a head that does not fit `target` is refused by name."""
        if self.model.vocab_size != target.vocab_size or self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"the EAGLE-3 head was trained for a target of vocab_size={self.model.vocab_size} "
                f"and hidden_size={self.target_hidden_size}; this target ({target.architecture}) has "
                f"{target.vocab_size} and {target.hidden_size}: use the head made for this target"
            )
        ids = self.aux_layer_ids or default_aux_layers(target.num_layers)
        layers = tuple(sorted(set(ids)))
        if len(layers) != self.num_aux_hidden_states or not all(0 <= i <= target.num_layers for i in layers):
            raise ValueError(
                f"the EAGLE-3 head reads {self.num_aux_hidden_states} target layers; layers {ids} "
                f"of a {target.num_layers}-layer target give {len(layers)} distinct ones in range: "
                "set eagle_aux_hidden_state_layer_ids in the head's config.json"
            )
        return layers


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default choice (`SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`)."""
    return (2, num_layers // 2, num_layers - 3)


def _param_map() -> dict[str, str]:
    table = {
        "fc.weight": "fc.kernel",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.kernel",
        "embed_tokens.weight": "embed_tokens.embedding",
        "d2t": "d2t",
    }
    for prefix in ("midlayer", "layers.0"):
        for name in (*ATTENTION_LINEARS, *MLP_LINEARS):
            table[f"{prefix}.{name}.weight"] = f"layer.{name}.kernel"
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            table[f"{prefix}.{name}.weight"] = f"layer.{name}.weight"
    return table


class Eagle3Layer(nnx.Module):
    """The head's decoder layer: attention over `[embedding, hidden]` (2D wide), then the MLP."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, norm_before_residual: bool):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.self_attn = PagedAttention(dataclasses.replace(config, hidden_size=2 * d), dtype=dtype)
        self.self_attn.o_proj = Linear(config.num_heads * config.head_dim, d, bias=False, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = GatedMLP.from_config(config, dtype=dtype)
        self.norm_before_residual = norm_before_residual

    def __call__(
        self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, kv_cache: jax.Array, md
    ) -> tuple[jax.Array, jax.Array]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        attn, kv_cache = self.self_attn(x, positions, kv_cache, md)
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual), md), kv_cache


class Eagle3Head(nnx.Module):
    """The head (module docstring): `combine(aux)` once over the target's hidden states, then
    `head(tokens, hidden, positions, kv_cache, md) -> (hidden before norm, kv_cache)` per draft
    step, `draft_logits(hidden)` over the draft vocabulary and `target_ids(draft ids)`."""

    hf_param_map = _param_map()

    def __init__(self, config: Eagle3Config, *, dtype: jnp.dtype, own_embedding: bool, has_d2t: bool):
        mc = config.model
        self.config = mc
        # Without one of its own, the target's table is set after loading (`share_embedding`).
        own = Embedding(mc.vocab_size, mc.hidden_size, dtype=dtype) if own_embedding else None
        self.embed_tokens: Embedding | None = nnx.data(own)
        self.fc = Linear(config.num_aux_hidden_states * config.target_hidden_size, mc.hidden_size,
                         bias=False, dtype=dtype)  # fmt: skip
        self.layer = Eagle3Layer(mc, dtype=dtype, norm_before_residual=config.norm_before_residual)
        self.norm = RMSNorm(mc.hidden_size, eps=mc.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(mc.hidden_size, config.draft_vocab_size, bias=False, dtype=dtype)
        self.d2t = zeros_param((config.draft_vocab_size,), jnp.int32) if has_d2t else None

    def combine(self, aux: jax.Array) -> jax.Array:
        """`[T, A * D_target]` target hidden states to the head's `[T, D]`."""
        return self.fc(aux)

    def __call__(
        self,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        return self.layer(self.embed_tokens(tokens, md.mesh), hidden, positions, kv_cache, md)

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[R, draft V]` of the head's hidden states (before its norm)."""
        return self.lm_head.product(self.norm(hidden))

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[...][draft_ids]

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """`t2d` (which target ids the draft vocabulary holds) is not needed."""
        return name == "t2d"

    def share_embedding(self, table: Any) -> None:
        """Uses `table` (the target's `[V, D]` embedding, where it lives) as the head's."""
        mc = self.config
        self.embed_tokens = Embedding(mc.vocab_size, mc.hidden_size, dtype=table.dtype)
        self.embed_tokens.embedding.set_value(table)


def load_eagle3_head(path: str, dtype: jnp.dtype, tp_size: int = 1) -> tuple[Eagle3Config, Eagle3Head]:
    """The head of checkpoint `path` with its weights as host arrays and its projections fused
    (one block a device on a mesh of `tp_size`, its KV heads repeated up to `tp_size` when fewer,
    as the target's: `loader.prepare_for_serving`; heads the mesh does not split are refused by
    name); one without `embed_tokens` needs `share_embedding` before it runs."""
    config = Eagle3Config.from_pretrained(path)
    names = set(checkpoint_names(path))
    if "lm_head.weight" not in names:
        raise ValueError(
            f"the EAGLE-3 head at {path} has no lm_head.weight; vllm-xla serves heads with their own "
            "LM head (over their draft vocabulary)"
        )
    has_d2t = "d2t" in names
    if config.draft_vocab_size != config.model.vocab_size and not has_d2t:
        raise ValueError(
            f"the EAGLE-3 head at {path} drafts over {config.draft_vocab_size} ids of a "
            f"{config.model.vocab_size}-token vocabulary but has no d2t mapping them to the target's"
        )
    head = Eagle3Head(config, dtype=dtype, own_embedding="embed_tokens.weight" in names, has_d2t=has_d2t)
    read_into(head, path)
    mc = config.model
    repeat_kv_heads_for_mesh(head, kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, tp_size))
    fuse_projections(head, tp_size)
    return config, head
