# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-1 proposer (speculative method 'eagle'): a one-layer head (`models.eagle`) drafts k
tokens a step from the target's final hidden states, as vLLM's EAGLE proposer does.

It runs as the EAGLE-3 head does (`eagle3`: the same two programs, the pass over the step's
tokens shifted by one and the k - 1 single-token steps in one `jax.lax.scan`), reading what the
MTP layer reads (`mtp`): the target's final hidden states after its norm, which every step
already returns, so any served target whose width and vocabulary the head was made for can use
it. Its KV cache is one Llama layer's, as many pages as the target's, inside the same memory
budget; on a mesh it is split as a decoder layer of the target is, `fc` (`[2D, D]`) whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models import ModelConfig, attach_rope_tables
from models.eagle import EagleConfig, EagleHead, load_eagle_head
from tpu_platform.speculation.draft_model import target_cache_group
from tpu_platform.speculation.eagle3 import Eagle3Proposer


class EagleProposer(Eagle3Proposer):
    """The EAGLE-1 head's weights, KV cache and programs (see the module docstring)."""

    method = "eagle"

    def __init__(
        self,
        config: EagleConfig,
        head: EagleHead,
        k: int,
        device: jax.Device,
        mesh: Mesh | None = None,
        target_groups: tuple[int, int] = (0, 1),
    ):
        super().__init__(config, head, (), k, device, mesh, target_groups)

    @classmethod
    def load(
        cls, path: str, *, k: int, target: ModelConfig, target_model: nnx.Module, dtype: jnp.dtype,
        max_model_len: int, device: jax.Device, mesh: Mesh | None = None,
    ) -> EagleProposer:  # fmt: skip
        """The head of checkpoint `path` for `target`, sharing `target_model`'s embedding and LM
        head where it has none of its own, on `device` or split on the target's `mesh`; a head
        of another width or vocabulary is refused by name (`models.eagle`)."""
        EagleConfig.from_pretrained(path).check_target(target)
        config, head = load_eagle_head(path, dtype, 1 if mesh is None else mesh.size)
        if head.embed_tokens is None:
            head.share_embedding(target_model.model.embed_tokens.embedding[...])
        if head.lm_head is None:
            head.share_lm_head(target_model)
        attach_rope_tables(head, max_model_len)
        return cls(config, head, k, device, mesh, target_cache_group(target))

    def input_width(self) -> int:
        return self.model_config.hidden_size

    def head_input(self, hidden: jax.Array, aux: tuple[jax.Array, ...]) -> jax.Array:
        """The target's final hidden states (after its norm), as vLLM hands them to the head."""
        return hidden
