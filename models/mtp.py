# SPDX-License-Identifier: Apache-2.0
"""The multi-token-prediction (MTP) layer DeepSeek-V3 and GLM-4.5 checkpoints carry after their
last decoder layer (`num_nextn_predict_layers`), served as the draft head of speculative method
'mtp' (vLLM's `DeepSeekMTP` and `Glm4MoeMTP`).

At position p the layer reads the token at p + 1 and the target's final (normed) hidden state
at p, and predicts the token at p + 2:

    h' = block(eh_proj(concat(enorm(embed(token)), hnorm(hidden))))
    draft = argmax(shared_head.head(shared_head.norm(h')))

`block` is a full decoder layer of the target's kind (DeepSeek: latent attention and MoE) with a
KV cache of its own. The embedding is the target's (shared, as DeepSeek-V3's report says; a
copy in the checkpoint is not read); the token at position 0 enters as zeros, as in vLLM's layer.
For k > 1 drafts the one layer runs again on its own output, as vLLM runs it: DeepSeek's after
`shared_head.norm`, GLM's before it.

Checkpoint names, under `model.layers.{num_hidden_layers}.`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, and the block's tensors as the target's layers name them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoint_reads import checkpoint_names
from models.config import ModelConfig
from models.deepseek import HF_PARAM_MAP as DEEPSEEK_HF_PARAM_MAP
from models.deepseek import deepseek_decoder_layer
from models.glm4_moe import HF_PARAM_MAP as GLM4_MOE_HF_PARAM_MAP
from models.glm4_moe import glm4_moe_decoder_layer
from models.layers import Embedding, RMSNorm
from models.linear import Linear
from models.loader import read_into
from models.metadata import AttentionMetadata
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import kv_heads_on_mesh

# Target architecture -> (its decoder layer's builder, whether a step's output re-enters normed).
BLOCKS: dict[str, tuple[Callable[..., nnx.Module], bool]] = {
    "DeepseekV3ForCausalLM": (deepseek_decoder_layer, True),
    "Glm4MoeForCausalLM": (glm4_moe_decoder_layer, False),
}
_LAYER = "model.layers.{i}."


def _param_map() -> dict[str, str]:
    """HF name -> ours: the layer's own tensors, and its block's as the target's layers spell
    them (`{i}`: the MTP layer's index; `iter_parameters(only=...)` reads no other layer)."""
    table = {
        f"{_LAYER}enorm.weight": "enorm.weight",
        f"{_LAYER}hnorm.weight": "hnorm.weight",
        f"{_LAYER}eh_proj.weight": "eh_proj.kernel",
        f"{_LAYER}shared_head.norm.weight": "shared_norm.weight",
        f"{_LAYER}shared_head.head.weight": "shared_head.kernel",
    }
    for target_map in (DEEPSEEK_HF_PARAM_MAP, GLM4_MOE_HF_PARAM_MAP):
        for hf, ours in target_map.items():
            if hf.startswith(_LAYER):
                table[hf] = "block." + ours.removeprefix(_LAYER)
    return table


def mtp_layer_count(path: str) -> int:
    """`num_nextn_predict_layers` of the checkpoint at `path` (0 when it says none)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    return int(hf.get("num_nextn_predict_layers") or 0)


class MtpHead(nnx.Module):
    """The MTP layer as a draft head (module docstring), with the EAGLE-3 head's interface:
    `combine` (nothing to combine), `head(tokens, hidden, positions, kv_cache, md) -> (the
    hidden state its next step reads, kv_cache)`, `draft_logits(hidden)` and `target_ids`."""

    hf_param_map = _param_map()

    def __init__(self, config: ModelConfig, block: nnx.Module, *, dtype: jnp.dtype, recycle_normed: bool):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        # The target's table, set after loading (`share_embedding`).
        self.embed_tokens: Embedding | None = nnx.data(None)
        self.enorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.hnorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, bias=False, dtype=dtype)
        self.block = block
        self.shared_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.shared_head = Linear(d, config.vocab_size, bias=False, dtype=dtype)
        self.recycle_normed = recycle_normed

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
        embeds = self.embed_tokens(tokens, md.mesh)  # [T, D]
        embeds = jnp.where((positions == 0)[:, None], jnp.zeros((), embeds.dtype), embeds)
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        x, kv_cache = self.block(x, positions, kv_cache, md)
        return (self.shared_norm(x) if self.recycle_normed else x), kv_cache

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[R, V]` of the head's outputs (`__call__`'s)."""
        return self.shared_head.product(hidden if self.recycle_normed else self.shared_norm(hidden))

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids

    def share_embedding(self, table: Any) -> None:
        """Uses `table` (the target's `[V, D]` embedding, where it lives) as the head's."""
        self.embed_tokens = Embedding(self.config.vocab_size, self.config.hidden_size, dtype=table.dtype)
        self.embed_tokens.embedding.set_value(table)


def load_mtp_head(path: str, config: ModelConfig, dtype: jnp.dtype, tp_size: int = 1) -> MtpHead:
    """The first MTP layer of the checkpoint at `path` (whose target's config is `config`) with
    its weights as host arrays and its projections fused (for a mesh of `tp_size` as the
    target's: `loader.prepare_for_serving`); it needs `share_embedding` before it runs. A
    checkpoint without one, or of an architecture without MTP, is refused by name."""
    if config.architecture not in BLOCKS:
        raise ValueError(
            f"speculative method 'mtp' is not supported by vllm-xla for {config.architecture}; it "
            f"serves the MTP layers of {', '.join(BLOCKS)}: use method 'ngram' or 'draft_model'"
        )
    count = mtp_layer_count(path)
    if count != 1:
        raise ValueError(
            f"speculative method 'mtp' needs a checkpoint with one multi-token-prediction layer "
            f"(num_nextn_predict_layers=1, as DeepSeek-V3's and GLM-4.5's); {path} has {count}: "
            "use method 'ngram' or 'draft_model'"
        )
    index = config.num_layers
    prefix = f"model.layers.{index}."
    wanted = lambda name: name.startswith(prefix) and not name.startswith(f"{prefix}embed_tokens.")  # noqa: E731
    if f"{prefix}eh_proj.weight" not in checkpoint_names(path, wanted):
        raise ValueError(
            f"the checkpoint at {path} says num_nextn_predict_layers=1 but holds no {prefix}eh_proj "
            "tensor: its multi-token-prediction layer was left out (transformers' save_pretrained "
            "drops it); use a checkpoint with its MTP tensors, or method 'ngram'"
        )
    build_block, recycle_normed = BLOCKS[config.architecture]
    head = MtpHead(
        config, build_block(config, index, dtype=dtype), dtype=dtype, recycle_normed=recycle_normed
    )
    read_into(head, path, only=wanted)
    repeat_kv_heads_for_mesh(head, kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp_size))
    fuse_projections(head, tp_size)
    return head
