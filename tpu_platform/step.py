# SPDX-License-Identifier: Apache-2.0
"""The jitted device programs: one forward step and one sampling step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import AttentionMetadata, expert_load
from models.lora import set_lora_tokens
from models.sharding import MODEL_AXIS, vocab_parallel
from tpu_platform.inputs import unpack_inputs
from tpu_platform.replica_step import num_replicas, over_replicas_step
from tpu_platform.sampling import SamplerFlags, greedy_sample, sample


def forward_logits(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],
    kv_caches: list[jax.Array],
    packed: jax.Array,
    fed_tokens: jax.Array,
    dims: tuple[int, int, int, int],
    backend: str,
    layer_groups: tuple[int, ...] = (),
    layer_caches: tuple[int, ...] = (),
    kv_dtype: str | None = None,
    cache_pages: int = 0,
    caches_per_array: int = 0,
    mesh: Mesh | None = None,
    cache_def: jax.tree_util.PyTreeDef | None = None,
    aux_layers: tuple[int, ...] = (),
    count_expert_load: bool = False,
    state_columns: int = 1,
    verify_shapes: frozenset[tuple[int, int]] | None = None,
    replicas: int = 1,
) -> tuple:
    """Runs the model on all scheduled tokens (`packed` by `pack_inputs`, padded to `dims`).

    `fed_tokens` (`[F]` int32) are the previous step's sampled tokens, still on the device: a token
    whose `inputs.feed` index is not -1 is taken from there (async scheduling).

    Returns the `[R, V]` float32 logits of the rows to sample (rows past the real sequences hold
    nothing meaningful), their greedy tokens (an all-greedy step needs no sampler program)
    padded to `[F]` (the next step's `fed_tokens`), the `[T, D]` hidden states of every token
    (for prompt logprobs; zeros for padding tokens) and the new caches. With `verify_shapes`
    (speculative decoding's step shapes, `buckets.verify_shapes`; None: no speculation) one more
    output follows the caches: in a step of one of those `(T, R)` shapes the head runs on every
    token row and the output is the `[T, V]` logits and `[T]` greedy tokens of every row, which
    verify the step's drafts (`speculation.verdict`), the sampled rows' taken from them; in a
    step of any other shape it is `()`. With `aux_layers` (speculative method 'eagle3') also the
    `[T, A * D]` hidden states the EAGLE-3 head reads (`models.layers.DecoderModel`); with
    `count_expert_load` also the `[L, E]` int32 tokens each MoE layer routed to each expert
    (`models.expert_load`), last. `replicas`: this is one of that many data-parallel replicas'
    steps, run together (`tpu_platform.replica_step`).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
    inputs = unpack_inputs(packed, dims)
    fed = fed_tokens[jnp.maximum(inputs.feed, 0)]
    token_ids = jnp.where(inputs.feed >= 0, fed, inputs.token_ids)
    set_lora_tokens(model, inputs.lora_slots)  # a no-op for a model without adapter slots
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
        cache_pages=cache_pages,
        caches_per_array=caches_per_array,
        mesh=mesh,
        count_expert_load=count_expert_load,
        state_columns=state_columns,
        replicas=replicas,
    )
    if cache_def is not None:  # a hybrid's caches come flat; its state layers take pairs
        kv_caches = jax.tree.unflatten(cache_def, kv_caches)
    aux = {"aux_layers": aux_layers} if aux_layers else {}  # a model without the option is called as ever
    hidden, kv_caches, *extra = model(token_ids, inputs.positions, kv_caches, md, **aux)
    if cache_def is not None:
        kv_caches = jax.tree.leaves(kv_caches)
    if verify_shapes is not None and dims[:2] in verify_shapes:
        row_logits = head_logits(model, hidden, inputs.cu_q_lens[inputs.num_seqs[0]], mesh)
        row_greedy = greedy_sample(row_logits)
        logits, greedy = row_logits[inputs.logits_indices], row_greedy[inputs.logits_indices]
        extra.insert(0, (row_logits, row_greedy))
    else:
        logits = head_logits(model, hidden[inputs.logits_indices], inputs.num_seqs[0], mesh)
        greedy = greedy_sample(logits)
        if verify_shapes is not None:
            extra.insert(0, ())
    if count_expert_load:
        extra.append(expert_load.collect(model))
    return logits, pad_tokens(greedy, fed_tokens.shape[0]), hidden, kv_caches, *extra


def head_logits(model: nnx.Module, rows: jax.Array, num_real: jax.Array, mesh: Mesh | None) -> jax.Array:
    """The `[N, V]` float32 logits of hidden `rows`, whole on every device of a `mesh`.

    Rows from `num_real` on enter the head as zeros: the CPU's dense kernel then skips them,
    which would otherwise cost as much per row as a decode row's."""
    real_rows = jnp.arange(rows.shape[0]) < num_real
    logits = model.compute_logits(jnp.where(real_rows[:, None], rows, jnp.zeros((), rows.dtype)))
    return logits if mesh is None else gather_logits(logits, mesh)


def gather_logits(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """The `[R, V]` logits whole on every device of `mesh`, gathered once from the vocab-parallel
    head's slices: the greedy argmax and the sampler need the whole vocabulary. Left to itself,
    XLA either re-splits the slices for the argmax's blocks (collectives on top of the gather
    the replicated output needs anyway) or, told only the result, gathers the head's weight."""
    if vocab_parallel(logits.shape[1], mesh.shape[MODEL_AXIS]):
        logits = jax.lax.with_sharding_constraint(
            logits, NamedSharding(mesh, PartitionSpec(None, MODEL_AXIS))
        )
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec()))


def pad_tokens(tokens: jax.Array, width: int) -> jax.Array:
    """`[R]` sampled tokens zero-padded to `[width]` (a fixed width: the next step's feed)."""
    return jnp.zeros(width, tokens.dtype).at[: tokens.shape[0]].set(tokens)


def make_forward(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    backend: str,
    layer_groups: tuple[int, ...] = (),
    layer_caches: tuple[int, ...] = (),
    kv_dtype: str | None = None,
    *,
    cache_pages: int = 0,
    caches_per_array: int = 0,
    mesh: Mesh | None = None,
    cache_shardings: list[NamedSharding] | None = None,
    cache_def: jax.tree_util.PyTreeDef | None = None,
    aux_layers: tuple[int, ...] = (),
    count_expert_load: bool = False,
    state_columns: int = 1,
    verify_shapes: frozenset[tuple[int, int]] | None = None,
    state_shardings: list[NamedSharding] | None = None,
) -> Callable:
    """`forward(state_leaves, kv_caches, packed, fed_tokens, dims=...) -> (logits, greedy, hidden,
    kv_caches)`, jitted (and the EAGLE-3 head's hidden states last, with `aux_layers`).

    The model state comes as the flat leaves of `state_def` (`jax.tree.flatten(state)`, done
    once): flattening an NNX state of a few hundred variables on every call would cost
    milliseconds of host time per step. The caches are donated (updated in place); `dims` is static.

    `layer_groups`/`layer_caches` map each layer to its KV-cache group and cache array
    (see `models.AttentionMetadata`); empty means one group and one array per layer.
    `kv_dtype` names the cached values' dtype when it is not the model's (a float8 cache).
    `cache_pages > 0`: each of `kv_caches` holds `caches_per_array` caches (0: all),
    `cache_pages` pages each (`models.AttentionMetadata`).
    `mesh`: the tensor-parallel mesh; the state leaves and caches come placed on it, the caches
    leave with `cache_shardings`, the other outputs replicated (the logits gathered over the
    vocabulary: the sampler sees all of it).
    `cache_def`: the structure the model takes its (flat) caches in, when not a flat list (a
    hybrid model's state pools, `tpu_platform.state_cache`).
    `count_expert_load`: a MoE model's program also returns its load per expert, last
    (`forward_logits`). `state_columns`: a state layer's slots a sequence
    (`models.AttentionMetadata`). `verify_shapes`: speculative decoding's step shapes, whose
    programs also return every token row's logits and greedy tokens (`forward_logits`).
    A `mesh` of data-parallel replicas (`tpu_platform.replica_step`) runs each replica's step on
    its own rows of the inputs, caches and outputs; the weights come placed with
    `state_shardings`.
    """
    step = functools.partial(
        forward_logits,
        graphdef,
        state_def,
        backend=backend,
        layer_groups=layer_groups,
        layer_caches=layer_caches,
        kv_dtype=kv_dtype,
        cache_pages=cache_pages,
        caches_per_array=caches_per_array,
        mesh=mesh,
        cache_def=cache_def,
        aux_layers=aux_layers,
        count_expert_load=count_expert_load,
        state_columns=state_columns,
        verify_shapes=verify_shapes,
    )
    if mesh is None:
        return jax.jit(step, donate_argnums=(1,), static_argnames=("dims",))
    extra_outputs = (verify_shapes is not None) + bool(aux_layers) + count_expert_load
    if num_replicas(mesh) > 1:
        if state_shardings is None:
            raise ValueError("a step over data-parallel replicas needs its weights' state_shardings")
        return over_replicas_step(step, mesh, state_shardings, cache_shardings, extra_outputs)
    # The arguments come placed (the inputs replicated); the outputs are fixed here, so that
    # every program leaves the caches split as the next one takes them.
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        donate_argnums=(1,),
        static_argnames=("dims",),
        out_shardings=(whole, whole, whole, cache_shardings, *[whole] * extra_outputs),
    )


def make_sampler(feed_width: int, mesh: Mesh | None = None) -> Callable:
    """`sample(logits, tensors, flags=...) -> SamplerOutput`, jitted; flags are static. The
    sampled tokens are zero-padded to `[feed_width]`: the next step's `fed_tokens`. On a `mesh`
    every input and output is replicated (the logits arrive gathered)."""

    def sample_for_feed(logits: jax.Array, tensors, flags: SamplerFlags):
        out = sample(logits, tensors, flags=flags)
        return dataclasses.replace(out, sampled_token_ids=pad_tokens(out.sampled_token_ids, feed_width))

    if mesh is None:
        return jax.jit(sample_for_feed, static_argnames=("flags",))
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.jit(sample_for_feed, static_argnames=("flags",), out_shardings=whole)


__all__ = ["SamplerFlags", "make_forward", "make_sampler"]
