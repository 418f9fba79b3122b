# SPDX-License-Identifier: Apache-2.0
"""The public Gated DeltaNet API (Qwen3-Next, Qwen3.5 linear-attention layers): the state pools,
the causal conv1d with its carried inputs and the gated delta rule, with the ragged semantics of
`ragged_paged_attention` (prefill chunks and decodes mixed, `cu_q_lens`, `num_seqs`), each
sequence reading and writing its own slot of a state pool (`state_indices`).

Every backend runs the pure-jnp form of `gated_delta_reference.py` (the chunkwise WY/UT form,
recurrent for decode steps), which XLA compiles for every device; the backend name is still
checked, so that a Pallas kernel can take over one backend without changing callers. The form's
temporaries are per chunk of the step's rows (`[chunks, heads, C, C]` scores, `[chunks, heads,
C, K|V]` keys and values) and one state per sequence of the step, never a pool-sized one.

Pools: a layer's conv state `[slots, W - 1, D]` (the last inputs of the conv's D channels) and
recurrent state `[slots, H, K, V]`. Under speculative decoding a sequence has P slots
(`state_indices [R, P]`): it starts from column 0's, and a sequence of at most P rows (a
verification: its last token and its drafts) leaves the state after its row j in column j, so
that the next step can start after the last accepted draft (`gated_delta_reference`). Under
tensor parallelism both split on their channel / head axis (`state_partition_specs`), as the
heads do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels.backend import resolve_backend
from pallas_kernels.gated_delta_reference import causal_conv1d_reference, gated_delta_rule_reference


def allocate_state_pools(
    num_slots: int,
    *,
    conv_width: int,
    conv_dim: int,
    num_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: jnp.dtype,
    state_dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Zeroed `(conv state [num_slots, conv_width - 1, conv_dim] of dtype, recurrent state
    [num_slots, num_heads, key_dim, value_dim] of state_dtype)` for one layer."""
    if conv_width < 2:
        raise ValueError(f"conv_width must be >= 2 (a conv that carries inputs), got {conv_width}")
    conv = jnp.zeros((num_slots, conv_width - 1, conv_dim), dtype)
    return conv, jnp.zeros((num_slots, num_heads, key_dim, value_dim), state_dtype)


def state_partition_specs(axis_name: str) -> tuple[PartitionSpec, PartitionSpec]:
    """How a layer's conv and recurrent pools split over mesh axis `axis_name`: on the conv's
    channels and on the heads."""
    return PartitionSpec(None, None, axis_name), PartitionSpec(None, axis_name)


def state_bytes_per_slot(
    *, conv_width: int, conv_dim: int, num_heads: int, key_dim: int, value_dim: int,
    dtype: jnp.dtype, state_dtype: jnp.dtype = jnp.float32,
) -> int:  # fmt: skip
    """Bytes one request's state takes in one layer: its conv inputs and its recurrent state."""
    conv = (conv_width - 1) * conv_dim * jnp.dtype(dtype).itemsize
    return conv + num_heads * key_dim * value_dim * jnp.dtype(state_dtype).itemsize


def _check_batch(state_indices: jax.Array, has_initial_state: jax.Array, cu_q_lens: jax.Array) -> None:
    r = has_initial_state.shape[0] if has_initial_state.ndim == 1 else -1
    if state_indices.ndim not in (1, 2) or state_indices.shape[0] != r or cu_q_lens.shape != (r + 1,):
        raise ValueError(
            f"state_indices {state_indices.shape} must be [R] (or [R, P]: a slot for each of a "
            f"sequence's first P rows), has_initial_state {has_initial_state.shape} [R] and "
            f"cu_q_lens {cu_q_lens.shape} [R + 1]"
        )


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    conv_state: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: bool = True,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d of ragged rows `x [T, D]` with weight `[W, D]`, each sequence
    continuing from the last `W - 1` inputs in its slot of `conv_state [S, W - 1, D]` (zeros
    where `has_initial_state[i]` is false) and leaving its own last inputs there; silu after it
    unless `activation` is false. `state_indices [R, P]`: P slots a sequence (module docstring).
    Returns `([T, D], conv_state)`: donate the pool."""
    resolve_backend(backend, interpret=True)
    _check_batch(state_indices, has_initial_state, cu_q_lens)
    if conv_state.shape[1:] != (weight.shape[0] - 1, x.shape[1]):
        raise ValueError(
            f"conv_state {conv_state.shape} does not hold {weight.shape[0] - 1} inputs of "
            f"{x.shape[1]} channels for a conv of width {weight.shape[0]}"
        )
    return causal_conv1d_reference(
        x, weight, conv_state, state_indices, has_initial_state, cu_q_lens, num_seqs,
        bias=bias, activation=activation,
    )  # fmt: skip


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    chunk_size: int = 64,
    qk_l2norm: bool = True,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over ragged rows (`gated_delta_reference`'s docstring has the
    algebra): q, k `[T, G, K]` (each key head serving `H / G` value heads), v `[T, H, V]`, g (log
    decay, <= 0) and beta `[T, H]`; sequence i owns rows `cu_q_lens[i]:cu_q_lens[i+1]` and
    starts from slot `state_indices[i]` of `state [S, H, K, V]` (zeros where
    `has_initial_state[i]` is false); `state_indices [R, P]`: P slots a sequence (module
    docstring). Returns `o [T, H, V]` and the pool with each live sequence's final state in its
    slot: donate it."""
    resolve_backend(backend, interpret=True)
    _check_batch(state_indices, has_initial_state, cu_q_lens)
    num_heads = v.shape[1]
    if q.shape != k.shape or num_heads % k.shape[1]:
        raise ValueError(f"q {q.shape} and k {k.shape} must match, with heads dividing v's {v.shape}")
    if state.shape[1:] != (num_heads, k.shape[2], v.shape[2]):
        raise ValueError(f"state {state.shape} is not [slots, {num_heads}, {k.shape[2]}, {v.shape[2]}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return gated_delta_rule_reference(
        q, k, v, g, beta, state, state_indices, has_initial_state, cu_q_lens, num_seqs,
        chunk_size=chunk_size, qk_l2norm=qk_l2norm,
    )  # fmt: skip
