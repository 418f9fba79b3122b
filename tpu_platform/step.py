# SPDX-License-Identifier: Apache-2.0
"""The jitted device programs: one forward step and one sampling step."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from models import AttentionMetadata
from tpu_platform.inputs import unpack_inputs
from tpu_platform.sampling import SamplerFlags, greedy_sample, sample


def forward_logits(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],
    kv_caches: list[jax.Array],
    packed: jax.Array,
    dims: tuple[int, int, int, int],
    backend: str,
    layer_groups: tuple[int, ...] = (),
    layer_caches: tuple[int, ...] = (),
    kv_dtype: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, list[jax.Array]]:
    """Runs the model on all scheduled tokens (`packed` by `pack_inputs`, padded to `dims`).

    Returns the `[R, V]` float32 logits of the rows to sample, their `[R]` greedy tokens (an
    all-greedy step needs no sampler program), the `[T, D]` hidden states of every token (for
    prompt logprobs) and the new caches.
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
    inputs = unpack_inputs(packed, dims)
    md = AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        kv_lens=inputs.kv_lens,
        page_indices=inputs.page_indices,
        cu_q_lens=inputs.cu_q_lens,
        num_seqs=inputs.num_seqs,
        backend=backend,
        layer_groups=layer_groups,
        layer_caches=layer_caches,
        kv_dtype=kv_dtype,
    )
    hidden, kv_caches = model(inputs.token_ids, inputs.positions, kv_caches, md)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    return logits, greedy_sample(logits), hidden, kv_caches


def make_forward(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    backend: str,
    layer_groups: tuple[int, ...] = (),
    layer_caches: tuple[int, ...] = (),
    kv_dtype: str | None = None,
) -> Callable:
    """`forward(state_leaves, kv_caches, packed, dims=...) -> (logits, greedy, hidden, kv_caches)`, jitted.

    The model state comes as the flat leaves of `state_def` (`jax.tree.flatten(state)`, done
    once): flattening an NNX state of a few hundred variables on every call would cost
    milliseconds of host time per step. The caches are donated (updated in place); `dims` is static.

    `layer_groups`/`layer_caches` map each layer to its KV-cache group and cache array
    (see `models.AttentionMetadata`); empty means one group and one array per layer.
    `kv_dtype` names the cached values' dtype when it is not the model's (a float8 cache).
    """
    step = functools.partial(
        forward_logits,
        graphdef,
        state_def,
        backend=backend,
        layer_groups=layer_groups,
        layer_caches=layer_caches,
        kv_dtype=kv_dtype,
    )
    return jax.jit(step, donate_argnums=(1,), static_argnames=("dims",))


def make_sampler() -> Callable:
    """`sample(logits, tensors, flags=...) -> SamplerOutput`, jitted; flags are static."""
    return jax.jit(sample, static_argnames=("flags",))


__all__ = ["SamplerFlags", "make_forward", "make_sampler"]
