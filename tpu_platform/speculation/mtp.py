# SPDX-License-Identifier: Apache-2.0
"""The MTP proposer: the multi-token-prediction layer of the target's own checkpoint
(`models.mtp`) drafts k tokens a step, as vLLM's proposer for method 'mtp' does.

It runs as the EAGLE-3 head does (`eagle3`: the same two programs, the pass over the step's
tokens shifted by one and the k - 1 single-token steps in one `jax.lax.scan`), reading the
target's final hidden states, which every step already returns, instead of three layers' inputs.
Its KV cache is one layer of the target's kind (DeepSeek's: the latent cache), as many pages as
the target's, inside the same memory budget. A hybrid target's (Qwen3-Next, Qwen3.5: its layer
is a full-attention one, `models.qwen3_next_mtp`) follows the block tables of the target's
full-attention layers' group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models import ModelConfig, attach_rope_tables
from models.mtp import MtpHead, load_mtp_head
from models.qwen3_next_mtp import ARCHITECTURES as QWEN_ARCHITECTURES
from models.qwen3_next_mtp import load_qwen_mtp_head
from tpu_platform.speculation.draft_model import target_cache_group
from tpu_platform.speculation.eagle3 import Eagle3Proposer


@dataclasses.dataclass(frozen=True, slots=True)
class MtpConfig:
    """What identifies the head's programs: the target's configuration and the checkpoint."""

    model: ModelConfig
    path: str


class MtpProposer(Eagle3Proposer):
    """The MTP layer's weights, KV cache and programs (see the module docstring)."""

    method = "mtp"

    def __init__(
        self, config: MtpConfig, head: MtpHead, k: int, device: jax.Device, mesh: Mesh | None = None
    ):
        super().__init__(config, head, (), k, device, mesh, target_cache_group(config.model))

    @classmethod
    def load(
        cls, path: str, *, k: int, target: ModelConfig, target_model: nnx.Module, dtype: jnp.dtype,
        max_model_len: int, device: jax.Device, mesh: Mesh | None = None,
    ) -> MtpProposer:  # fmt: skip
        """The MTP layer of the target's checkpoint `path`, sharing `target_model`'s embedding, on
        `device` or split on the target's `mesh` as its decoder layers are; a checkpoint without
        one is refused by name (`models.mtp.load_mtp_head`)."""
        head = _load_head(path, target, target_model, dtype, 1 if mesh is None else mesh.size)
        head.share_embedding(target_model.model.embed_tokens.embedding[...])
        attach_rope_tables(head, max_model_len)
        return cls(MtpConfig(target, path), head, k, device, mesh)

    def input_width(self) -> int:
        return self.model_config.hidden_size

    def head_input(self, hidden: jax.Array, aux: tuple[jax.Array, ...]) -> jax.Array:
        """The target's final hidden states (after its norm), as vLLM hands them to the layer."""
        return hidden


def _load_head(
    path: str, target: ModelConfig, target_model: nnx.Module, dtype: jnp.dtype, tp_size: int
) -> MtpHead:
    """The family's MTP layer: Qwen3-Next's and Qwen3.5's (`mtp.*`, reading the target's LM head)
    or DeepSeek-V3's and GLM-4.5's (`models.mtp`), for a mesh of `tp_size` as the target's."""
    if target.architecture not in QWEN_ARCHITECTURES:
        return load_mtp_head(path, target, dtype, tp_size)
    head = load_qwen_mtp_head(path, target, dtype, tp_size)
    head.share_lm_head(target_model)
    return head
