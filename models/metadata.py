# SPDX-License-Identifier: Apache-2.0
"""Per-step attention metadata: a registered pytree passed explicitly through the model."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache.

    Data fields are device arrays (int32); `backend` is static and chooses the attention kernel.
    """

    # [T] cache slot (page * page_size + offset) of each token; negative for padding
    slot_mapping: jax.Array
    # [R] tokens in the cache per sequence after this step
    kv_lens: jax.Array
    # [R, P] block table
    page_indices: jax.Array
    # [R + 1] cumulative query lengths
    cu_q_lens: jax.Array
    # [1] number of real sequences
    num_seqs: jax.Array
    backend: str = dataclasses.field(default="xla", metadata={"static": True})
