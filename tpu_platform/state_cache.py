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

Under speculative decoding with k drafts the engine gives each state group 1 + k blocks a request
(`MambaSpec.num_speculative_blocks`, as vLLM's own runners take them): the step starts from the
first, and a verification's rows leave the state after each of them in the blocks in turn
(`pallas_kernels.gated_delta`). Once the step is recorded, `keep_accepted_states` swaps the
block holding the state after the last row kept (the last accepted draft's) into the first
place of the request's row, where the next step starts: the blocks are the request's own, so
their order in our table is ours to choose. A rejected draft's state is then never read.

On a tensor-parallel mesh of N devices the pools split on their channels and heads
(`pallas_kernels.state_partition_specs`) as the KV caches split on their heads: each device
holds 1/N of every slot, and the shapes and bytes given to the engine are one device's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.sharding import MODEL_AXIS
from pallas_kernels import (
    allocate_kv_cache,
    allocate_state_pools,
    kv_cache_partition_spec,
    state_bytes_per_slot,
    state_partition_specs,
)
from tpu_platform.inputs import StepPlan
from tpu_platform.request_table import RequestTable
from tpu_platform.step_program import KVLayout

if TYPE_CHECKING:
    from tpu_platform.speculation.config import SpeculationConfig

# A recurrent state is kept in float32 (transformers' and vLLM's default for Gated DeltaNet).
STATE_DTYPE = jnp.float32


def device_state_shapes(config: ModelConfig, tp_size: int = 1) -> dict[str, int]:
    """`config.state_shapes` as one device of a mesh of `tp_size` holds them: its share of the
    conv channels and of the value heads (`tp_size` divides the key heads: `models.sharding`)."""
    s = dict(config.state_shapes)
    s["conv_dim"] //= tp_size
    s["num_heads"] //= tp_size
    return s


def state_slot_bytes(config: ModelConfig, conv_dtype: jnp.dtype, tp_size: int = 1) -> int:
    """Bytes one request's state takes in one state layer on one device of a mesh of `tp_size`
    (conv inputs of `conv_dtype`, the recurrent state in float32)."""
    shapes = device_state_shapes(config, tp_size)
    return state_bytes_per_slot(**shapes, dtype=conv_dtype, state_dtype=STATE_DTYPE)


def page_size_holding_a_state(
    config: ModelConfig, base: int, kv_heads_per_chip: int, kv_dtype: jnp.dtype, conv_dtype: jnp.dtype,
    tp_size: int = 1, *, power_of_two: bool = False,
) -> int:  # fmt: skip
    """The page size a hybrid is served with: the smallest multiple of `base` tokens whose KV
    page in one layer (`kv_heads_per_chip` heads) holds a request's state in one layer on one
    device of a mesh of `tp_size` (vLLM wants one page size for every group);
    `power_of_two`: the smallest such power of two (the Pallas GPU kernels' tiles want one)."""
    per_token = 2 * kv_heads_per_chip * config.head_dim * jnp.dtype(kv_dtype).itemsize
    state = state_slot_bytes(config, conv_dtype, tp_size)
    pages = -(-state // (base * per_token))
    return base * (1 << (pages - 1).bit_length() if power_of_two else pages)


def state_shapes_and_dtypes(
    config: ModelConfig, conv_dtype: jnp.dtype, tp_size: int = 1
) -> tuple[tuple[tuple[int, ...], ...], tuple[jnp.dtype, ...]]:
    """One request's `((conv shape, recurrent shape), (their dtypes))` in one state layer, as
    the pools hold them on one device of a mesh of `tp_size` (`[W - 1, conv channels]`, `[value
    heads, key dim, value dim]`)."""
    s = device_state_shapes(config, tp_size)
    shapes = ((s["conv_width"] - 1, s["conv_dim"]), (s["num_heads"], s["key_dim"], s["value_dim"]))
    return shapes, (jnp.dtype(conv_dtype), jnp.dtype(STATE_DTYPE))


def block_bytes(config: ModelConfig, page_bytes: int, conv_dtype: jnp.dtype, tp_size: int = 1) -> int:
    """Bytes one block id takes on one device of a mesh of `tp_size`: a KV page of `page_bytes`
    in each layer with a cache of its own, a state slot instead in a hybrid's state layers."""
    owners = sum(config.kv_source(i) == i for i in range(config.num_layers))
    states = len(config.state_layers)
    state = state_slot_bytes(config, conv_dtype, tp_size) if states else 0
    return (owners - states) * page_bytes + states * state


def kv_budget_share(config: ModelConfig, page_bytes: int, conv_dtype: jnp.dtype, tp_size: int = 1) -> float:
    """The share of the cache memory budget to declare to the engine for a hybrid model (1 for
    any other): the engine counts `page_bytes` (one device's) a block for each layer of its
    largest group (`KVLayout.for_model`), and each block id costs here a KV page in every
    attention layer and a state slot in every state layer (module docstring)."""
    if not config.state_layers:
        return 1.0
    layout = KVLayout.for_model(config)
    largest_group = max(layout.layer_groups.count(group) for group in range(layout.num_groups))
    engine_bytes = largest_group * page_bytes
    return min(1.0, engine_bytes / block_bytes(config, page_bytes, conv_dtype, tp_size))


def allocate_layer_caches(
    config: ModelConfig,
    layout: KVLayout,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    kv_dtype: jnp.dtype,
    conv_dtype: jnp.dtype,
    backend: str,
    mesh: Mesh | None = None,
) -> list[jax.Array]:
    """The caches of a hybrid `layout`, flat (`KVLayout.caches_def`): zeroed state pools of
    `num_pages` slots for each state layer, a KV cache of `num_pages` pages in `backend`'s layout
    for each other layer. On a tensor-parallel `mesh` (`num_kv_heads` all the heads) each array
    is made on the devices already split (module docstring): each allocates only its share."""
    states = set(layout.state_layers)

    def allocate() -> list:
        pools = dict(**config.state_shapes, dtype=conv_dtype, state_dtype=STATE_DTYPE)
        pages = (num_pages, page_size, num_kv_heads, config.head_dim, kv_dtype)
        return [
            allocate_state_pools(num_pages, **pools)
            if i in states
            else allocate_kv_cache(*pages, backend=backend)
            for i in range(config.num_layers)
        ]

    if mesh is None:
        return jax.tree.leaves(allocate())
    pools = tuple(NamedSharding(mesh, spec) for spec in state_partition_specs(MODEL_AXIS))
    kv = NamedSharding(mesh, kv_cache_partition_spec(backend, MODEL_AXIS))
    shardings = [pools if i in states else kv for i in range(config.num_layers)]
    return jax.tree.leaves(jax.jit(allocate, out_shardings=shardings)())


def state_columns(speculation: SpeculationConfig | None) -> int:
    """A request's blocks in each state group: one, its state; under speculative decoding with k
    drafts 1 + k, a state after each verified row (module docstring)."""
    return 1 if speculation is None else 1 + speculation.num_tokens


def keep_accepted_states(table: RequestTable, plan: StepPlan, layout: KVLayout) -> None:
    """After a recorded step of `plan`: in each state group's block table row of each of its
    requests, swaps the block holding the state after the request's last row kept into the first
    place (module docstring). A request of at most `layout.state_columns` rows (a verification,
    a decode, a short prompt chunk) left the state after its row j in its block j and kept its
    rows up to its newest known token (no draft past the first rejected one); a longer one left
    its final state in its first block."""
    rows = plan.rows
    q_lens = np.diff(plan.inputs().cu_q_lens[: rows.size + 1])
    kept = np.minimum(q_lens, table.num_tokens[rows] - table.num_computed[rows] - 1)
    column = np.where(q_lens <= layout.state_columns, kept - 1, 0)
    moved = np.flatnonzero(column > 0)
    if not moved.size:
        return
    rows, column = rows[moved], column[moved]
    for group in layout.state_groups:
        blocks = table.block_table[group]
        first = blocks[rows, 0].copy()
        blocks[rows, 0] = blocks[rows, column]
        blocks[rows, column] = first
