# SPDX-License-Identifier: Apache-2.0
"""Per-step attention metadata: a registered pytree passed explicitly through the model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache.

    Data fields are device arrays (int32); the rest is static. A model whose layers fall in
    several KV-cache groups (e.g. sliding-window and full-attention layers) gets one slot
    mapping and block table per group, `layer_groups[i]` naming layer i's group, and
    `layer_caches[i]` naming the cache array layer i uses (layers of different groups may share
    an array: the engine hands a page to one group at a time). Empty tuples mean one group and
    one cache array per layer.

    `cache_pages > 0` says the caches are stacked: each array of the model's list holds
    `caches_per_array` caches (0: all of them, in one array) one after another along its page
    axis, `cache_pages` pages each (`pallas_kernels.api`), so cache c is in array
    `c // caches_per_array` from page `(c % caches_per_array) * cache_pages`. 0: one array a cache.
    """

    # [T] or [G, T] cache slot (page * page_size + offset) of each token; negative for padding
    slot_mapping: jax.Array
    # [R] tokens in the cache per sequence after this step
    kv_lens: jax.Array
    # [R, P] or [G, R, P] block table
    page_indices: jax.Array
    # [R + 1] cumulative query lengths
    cu_q_lens: jax.Array
    # [1] number of real sequences
    num_seqs: jax.Array
    backend: str = dataclasses.field(default="xla", metadata={"static": True})
    # The cached values' dtype by name when the cache array holds their bits (float8 in a uint8
    # array); None: the array's own dtype (see pallas_kernels.api).
    kv_dtype: str | None = dataclasses.field(default=None, metadata={"static": True})
    layer_groups: tuple[int, ...] = dataclasses.field(default=(), metadata={"static": True})
    layer_caches: tuple[int, ...] = dataclasses.field(default=(), metadata={"static": True})
    cache_pages: int = dataclasses.field(default=0, metadata={"static": True})
    caches_per_array: int = dataclasses.field(default=0, metadata={"static": True})
    # Where the layer's pages start in its cache array (set by `for_layer` for stacked caches).
    first_page: int = dataclasses.field(default=0, metadata={"static": True})
    # The tensor-parallel mesh the step runs on (`models.sharding.MODEL_AXIS`), None: one device.
    mesh: Mesh | None = dataclasses.field(default=None, metadata={"static": True})
    # Data-parallel replicas of one device each the step runs as, under a `shard_map` manual over
    # `models.sharding.DATA_AXIS` (`tpu_platform.replica_step`): only experts split by index over
    # them exchange tokens (`models.moe.experts_by_index`). 1: none.
    replicas: int = dataclasses.field(default=1, metadata={"static": True})
    # Every mixture-of-experts layer counts the tokens it routes to each expert (`models.expert_load`).
    count_expert_load: bool = dataclasses.field(default=False, metadata={"static": True})
    # A state layer's slots a sequence (its block table row's first entries): 1, or 1 + k under
    # speculative decoding with k drafts, a state after each verified row (`models.gated_deltanet`).
    state_columns: int = dataclasses.field(default=1, metadata={"static": True})

    @property
    def tp_size(self) -> int:
        """Devices the model is split over (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape["model"]

    def real_tokens(self, num_tokens: int) -> jax.Array:
        """`[num_tokens]` bool: the step's real tokens (the rest is padding up to its bucket)."""
        return jnp.arange(num_tokens) < self.cu_q_lens[self.num_seqs[0]]

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """`(index in the list of cache arrays, single-group metadata)` for decoder layer `layer`."""
        cache = self.layer_caches[layer] if self.layer_caches else layer
        array, first_page = cache, 0
        if self.cache_pages:
            array, index = divmod(cache, self.caches_per_array) if self.caches_per_array else (0, cache)
            first_page = index * self.cache_pages
        group = self.layer_groups[layer] if self.layer_groups else 0
        grouped = self.slot_mapping.ndim == 2
        return array, dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping[group] if grouped else self.slot_mapping,
            page_indices=self.page_indices[group] if grouped else self.page_indices,
            layer_groups=(),
            layer_caches=(),
            cache_pages=0,
            caches_per_array=0,
            first_page=first_page,
        )
