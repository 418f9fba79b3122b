# SPDX-License-Identifier: Apache-2.0
"""State caches beside KV pages: a hybrid model's linear-attention layers (Gated DeltaNet,
`models.gated_deltanet`) keep a fixed-size state per request (causal-conv inputs and a recurrent
state) where attention layers keep KV pages.

vLLM's hybrid KV-cache manager gives each state layer's group one block a request (Mamba-style
specs, `mamba_cache_mode="none"`): that block's id is the request's state slot in the layer's
pools (`GatedDeltaNet` reads it as the first entry of its group's block table row). Block ids run
over the same `num_pages` as the KV pages, so each state layer gets pools of `num_pages` slots
and each attention layer a KV cache of `num_pages` pages, one cache a layer: the engine hands a
block to one group at a time, but a state slot and a KV page have different shapes and dtypes, so
no array is shared. The engine sizes its block pool as if they were (one page's bytes a block
for each of the layers of its largest group); `kv_budget_share` is the share of the memory
budget to declare so that what is allocated here stays within the budget.

A step's fresh request (no tokens before it) starts from zero states, whatever its slot held;
a chunked prompt's next chunk continues from the state the last one left; a preempted request
is scheduled again from its first token, so it recomputes its state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from pallas_kernels import allocate_kv_cache, allocate_state_pools, state_bytes_per_slot
from tpu_platform.step_program import KVLayout

# A recurrent state is kept in float32 (transformers' and vLLM's default for Gated DeltaNet).
STATE_DTYPE = jnp.float32


def state_slot_bytes(config: ModelConfig, conv_dtype: jnp.dtype) -> int:
    """Bytes one request's state takes in one state layer (conv inputs of `conv_dtype`, the
    recurrent state in float32)."""
    return state_bytes_per_slot(**config.state_shapes, dtype=conv_dtype, state_dtype=STATE_DTYPE)


def state_shapes_and_dtypes(
    config: ModelConfig, conv_dtype: jnp.dtype
) -> tuple[tuple[tuple[int, ...], ...], tuple[jnp.dtype, ...]]:
    """One request's `((conv shape, recurrent shape), (their dtypes))` in one state layer, as
    the pools hold them (`[W - 1, conv channels]`, `[value heads, key dim, value dim]`)."""
    s = config.state_shapes
    shapes = ((s["conv_width"] - 1, s["conv_dim"]), (s["num_heads"], s["key_dim"], s["value_dim"]))
    return shapes, (jnp.dtype(conv_dtype), jnp.dtype(STATE_DTYPE))


def kv_budget_share(config: ModelConfig, page_bytes: int, conv_dtype: jnp.dtype) -> float:
    """The share of the cache memory budget to declare to the engine for a hybrid model (1 for
    any other): the engine counts `page_bytes` a block for each layer of its largest group
    (`KVLayout.for_model`), and each block id costs here a KV page in every attention layer and
    a state slot in every state layer (module docstring)."""
    if not config.state_layers:
        return 1.0
    layout = KVLayout.for_model(config)
    largest_group = max(layout.layer_groups.count(group) for group in range(layout.num_groups))
    engine_bytes = largest_group * page_bytes
    states = len(config.state_layers)
    allocated = (config.num_layers - states) * page_bytes + states * state_slot_bytes(config, conv_dtype)
    return min(1.0, engine_bytes / allocated)


def allocate_layer_caches(
    config: ModelConfig,
    layout: KVLayout,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    kv_dtype: jnp.dtype,
    conv_dtype: jnp.dtype,
    backend: str,
) -> list[jax.Array]:
    """The caches of a hybrid `layout`, flat (`KVLayout.caches_def`): zeroed state pools of
    `num_pages` slots for each state layer, a KV cache of `num_pages` pages in `backend`'s layout
    for each other layer."""
    states = set(layout.state_layers)
    caches = [
        allocate_state_pools(num_pages, **config.state_shapes, dtype=conv_dtype, state_dtype=STATE_DTYPE)
        if i in states
        else allocate_kv_cache(num_pages, page_size, num_kv_heads, config.head_dim, kv_dtype, backend=backend)
        for i in range(config.num_layers)
    ]
    return jax.tree.leaves(caches)
