# SPDX-License-Identifier: Apache-2.0
"""A hybrid model's caches in the planner (Qwen3-Next, Qwen3.5: Gated DeltaNet layers beside full
attention), as the runner allocates them (`tpu_platform.state_cache.allocate_layer_caches`): one
cache a layer, a state layer's the pair of its state pools of `num_pages` slots, an attention
layer's a KV cache of `num_pages` pages. A block id costs a KV page in every attention layer and
a request's state in every state layer, so a page's bytes (what `kv.fit_kv_cache` divides the
budget by) count both: `HybridPageBytes`. Of the block ids, each request holds its state blocks
in every state group (1 + k under speculative decoding with k drafts), the rest hold tokens in
the attention groups: `cache_tokens`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.sharding import MODEL_AXIS
from pallas_kernels import kv_cache_partition_spec, state_partition_specs
from tpu_platform.state_cache import allocate_layer_caches, state_slot_bytes
from tpu_platform.step_program import KVLayout


@dataclasses.dataclass(frozen=True, slots=True)
class HybridPageBytes:
    """One chip's bytes a block id costs in a hybrid model: `kv_bytes_per_page` (its tokens' K
    and V in every attention layer, the layout's padding counted) plus `state_bytes_per_request`
    (the conv inputs and the recurrent state in every state layer: the request owning the
    block's slot)."""

    kv_bytes_per_page: int
    tokens_per_page: int
    state_bytes_per_request: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_page // self.tokens_per_page

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_page + self.state_bytes_per_request


def abstract_hybrid_caches(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    kv_dtype: jnp.dtype,
    conv_dtype: jnp.dtype,
    backend: str,
    mesh: Mesh | None = None,
) -> list[jax.ShapeDtypeStruct]:
    """`allocate_layer_caches`' caches, flat, as `ShapeDtypeStruct`s (`num_kv_heads`: all of
    them on a mesh), with the shardings it gives them on `mesh`: state pools split on their
    channels and heads, KV caches on their heads."""
    layout = KVLayout.for_model(config)
    args = (config, layout, num_pages, page_size, num_kv_heads, kv_dtype, conv_dtype, backend)
    caches = jax.eval_shape(lambda: allocate_layer_caches(*args))
    if mesh is None:
        return caches
    pools = [NamedSharding(mesh, spec) for spec in state_partition_specs(MODEL_AXIS)]
    kv = NamedSharding(mesh, kv_cache_partition_spec(backend, MODEL_AXIS))
    states = set(config.state_layers)
    shardings = [s for i in range(config.num_layers) for s in (pools if i in states else [kv])]
    return [
        jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=s) for c, s in zip(caches, shardings, strict=True)
    ]


def hybrid_page_bytes(
    config: ModelConfig,
    page_size: int,
    kv_heads_per_chip: int,
    kv_dtype: jnp.dtype,
    conv_dtype: jnp.dtype,
    backend: str,
    tp_size: int = 1,
) -> HybridPageBytes:
    """One chip's `HybridPageBytes` of `config` in `backend`'s KV layout (its padding counted)."""
    one_chip = abstract_hybrid_caches(config, 2, page_size, kv_heads_per_chip, kv_dtype, conv_dtype, backend)
    states = set(config.state_layers)
    kv_caches = [c for i, c in _by_layer(config, one_chip) if i not in states]
    kv_page = sum(int(np.prod(c.shape)) * jnp.dtype(c.dtype).itemsize for c in kv_caches) // 2
    state = len(states) * state_slot_bytes(config, conv_dtype, tp_size)
    return HybridPageBytes(kv_page, page_size, state)


def _by_layer(config: ModelConfig, flat: list) -> list[tuple[int, jax.ShapeDtypeStruct]]:
    """(layer, array) for each of the flat caches: a state layer has two, the others one."""
    states, out, i = set(config.state_layers), [], 0
    for layer in range(config.num_layers):
        for _ in range(2 if layer in states else 1):
            out.append((layer, flat[i]))
            i += 1
    return out


def request_state_blocks(layout: KVLayout) -> int:
    """Block ids one request holds in a hybrid's state groups: `layout.state_columns` in each (its
    state; 1 + k under speculative decoding with k drafts); 0 for a model without state layers."""
    return len(layout.state_groups) * layout.state_columns


def cache_tokens(layout: KVLayout, num_pages: int, tokens_per_page: int, num_seqs: int) -> int:
    """Tokens a cache of `num_pages` block ids holds for `num_seqs` requests in each of
    `layout`'s token groups: the engine hands each block id to one group, so every group takes
    a page each `tokens_per_page` tokens; a hybrid's requests first take their state blocks
    (`request_state_blocks`) and its state groups take none by the token."""
    token_groups = layout.num_groups - len(layout.state_groups)
    left = max(0, num_pages - num_seqs * request_state_blocks(layout))
    return left * tokens_per_page // token_groups
