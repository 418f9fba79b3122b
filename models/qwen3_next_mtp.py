# SPDX-License-Identifier: Apache-2.0
"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 checkpoints (`mtp.*`,
`mtp_num_hidden_layers`), served as the draft head of speculative method 'mtp' (vLLM's
`Qwen3NextMTP`, `Qwen3_5MTP` and `Qwen3_5MoeMTP`).

At position p the layer reads the token at p + 1 and the target's final (normed) hidden state
at p, and predicts the token at p + 2:

    h' = norm(block(fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))))
    draft = argmax(lm_head(h'))

Every norm is the trunk's `(1 + w)` RMSNorm. `block` is a gated full-attention decoder layer of
the target's kind (its MLP routed to experts where the target's layer 0 would be, as vLLM builds
it) with a KV cache of its own: the layer keeps no linear-attention state. The embedding and the
LM head are the target's (vLLM reads neither from `mtp.*`); unlike DeepSeek's layer, position 0's
embedding enters as it is. For k > 1 drafts the one layer runs again on its own normed output.

Checkpoint names: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`,
and the block's tensors under `mtp.layers.0.` as the target's layers name them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoint_reads import checkpoint_names
from models.layers import RMSNorm
from models.linear import Linear
from models.loader import read_into
from models.metadata import AttentionMetadata
from models.mtp import MtpHead
from models.qwen3_next import FULL_ATTENTION, HF_PARAM_MAP, Qwen3NextConfig, Qwen3NextDecoderLayer
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import kv_heads_on_mesh

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
_LAYER = "model.layers.{i}"


def _param_map() -> dict[str, str]:
    """HF name -> ours: the layer's own tensors, and its block's as the target's layers spell them."""
    table = {
        "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
        "mtp.fc.weight": "eh_proj.kernel",
        "mtp.norm.weight": "shared_norm.weight",
    }
    for hf, ours in HF_PARAM_MAP.items():
        if hf.startswith(_LAYER):
            table["mtp.layers.{i}" + hf.removeprefix(_LAYER)] = "block" + ours.removeprefix(_LAYER)
    return table


def mtp_hidden_layer_count(path: str) -> int:
    """`mtp_num_hidden_layers` of the checkpoint at `path` (Qwen3.5's text config may sit under
    `text_config`; 0 when it says none)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    for config in (hf, hf.get("text_config") or {}):
        count = config.get("mtp_num_hidden_layers", config.get("num_nextn_predict_layers"))
        if count is not None:
            return int(count)
    return 0


class QwenMtpHead(MtpHead):
    """Qwen3-Next's MTP layer with `MtpHead`'s interface (module docstring). Its `shared_head`
    is the target's LM head (`share_lm_head`), None where the target ties it to the embedding."""

    hf_param_map = _param_map()

    def __init__(self, config: Qwen3NextConfig, block: nnx.Module, *, dtype: jnp.dtype):
        d, eps = config.hidden_size, config.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(d, eps=eps, dtype=dtype, unit_offset=True)

        self.config = config
        self.embed_tokens = nnx.data(None)  # the target's (`share_embedding`)
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = Linear(2 * d, d, bias=False, dtype=dtype)
        self.block = block
        self.shared_norm = norm()
        self.shared_head: Linear | None = nnx.data(None)  # the target's (`share_lm_head`)
        self.recycle_normed = True

    def __call__(
        self,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        x = self.eh_proj(
            jnp.concatenate([self.enorm(self.embed_tokens(tokens)), self.hnorm(hidden)], axis=-1)
        )
        x, kv_cache = self.block(x, positions, kv_cache, md)
        return self.shared_norm(x), kv_cache

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[R, V]` of the head's (normed) outputs, by the target's LM head."""
        if self.shared_head is None:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.shared_head.product(hidden)

    def share_lm_head(self, target_model: nnx.Module) -> None:
        """Uses `target_model`'s LM head (its embedding's table where the target ties them)."""
        self.shared_head = target_model.lm_head


def load_qwen_mtp_head(path: str, config: Qwen3NextConfig, dtype: jnp.dtype, tp_size: int = 1) -> QwenMtpHead:
    """The MTP layer of the Qwen3-Next or Qwen3.5 checkpoint at `path` (whose target's config is
    `config`) with its weights as host arrays and its projections fused (for a mesh of `tp_size`
    as the target's: `loader.prepare_for_serving`); it needs
    `share_embedding` and `share_lm_head` before it runs. A checkpoint without exactly one such
    layer, or whose layer's tensors were left out, is refused by name."""
    count = mtp_hidden_layer_count(path)
    if count != 1:
        raise ValueError(
            f"speculative method 'mtp' needs a checkpoint with one multi-token-prediction layer "
            f"(mtp_num_hidden_layers=1, as Qwen3-Next's and Qwen3.5's); {path} has {count}: use "
            "method 'ngram' or 'draft_model'"
        )
    # A dedicated embedding (`mtp.embed_tokens`) is not read: vLLM's layer uses the target's.
    wanted = lambda name: name.startswith("mtp.") and not name.startswith("mtp.embed_tokens.")  # noqa: E731
    if "mtp.fc.weight" not in checkpoint_names(path, wanted):
        raise ValueError(
            f"the checkpoint at {path} says mtp_num_hidden_layers=1 but holds no mtp.fc tensor: its "
            "multi-token-prediction layer was left out (transformers' save_pretrained drops it); "
            "use a checkpoint with its MTP tensors, or method 'ngram'"
        )
    # vLLM builds the layer as layer 0 of the target's kind, with full attention.
    block_config = dataclasses.replace(config, layer_types=(FULL_ATTENTION, *config.layer_types[1:]))
    head = QwenMtpHead(config, Qwen3NextDecoderLayer(block_config, 0, dtype=dtype), dtype=dtype)
    read_into(head, path, only=wanted)
    repeat_kv_heads_for_mesh(head, kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp_size))
    fuse_projections(head, tp_size)
    return head
