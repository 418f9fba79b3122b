# SPDX-License-Identifier: Apache-2.0
"""The step program, built once: the runner serves it, the planner and the compile-only proofs
compile it.

`build_step_program` makes the runner's jitted forward (`step.make_forward`) for a model (its
graph definition and state leaves), its KV caches and their `KVLayout`, and records beside it the
abstract arguments it takes (`ShapeDtypeStruct`s with their shardings) and the context that names
its cached executables. The runner builds it from its loaded weights and allocated caches; the
planner (`tpu_platform.planner.plan`) from abstract weights and caches on compile-only devices. Whatever
the runner's program takes (LoRA slots, a new input) is therefore what the compile tests compile.

`KVLayout` says how the layers share KV-cache groups and cache arrays: `plugin_shim` builds it
from vLLM's `KVCacheConfig`, the planner derives it from the model (`KVLayout.for_model`), and a
test checks that the two agree for every served architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from models import ModelConfig
from models.registry import architecture_fingerprint
from models.sharding import DATA_AXIS
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import caches_per_array
from tpu_platform.mesh import replicated
from tpu_platform.programs import structure_text
from tpu_platform.replica_step import num_replicas
from tpu_platform.step import make_forward


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """How the layers share KV-cache groups and cache arrays.

    One group: `layer_groups` and `layer_caches` are empty and each layer has a cache of its own.
    Several (sliding-window and full layers mixed): layer i is in group `layer_groups[i]` and uses
    cache `layer_caches[i]`; the engine hands each page to one group at a time, so the k-th layer
    of every group shares cache k.

    A hybrid model's `state_layers` (linear attention: a fixed-size state per request,
    `tpu_platform.state_cache`) have groups of their own, one block a request (its state slot);
    then every layer has a cache of its own (`layer_caches[i] == i`): state pools and KV pages
    have different shapes, so no array is shared. Under speculative decoding with k drafts a
    request has 1 + k blocks in those groups (`state_columns`): a state after each verified row."""

    layer_groups: tuple[int, ...]
    layer_caches: tuple[int, ...]
    num_caches: int
    num_groups: int
    state_layers: tuple[int, ...] = ()
    state_columns: int = 1

    @property
    def state_groups(self) -> tuple[int, ...]:
        """The groups of the state layers (none without)."""
        return tuple(sorted({self.layer_groups[i] for i in self.state_layers}))

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[Sequence[int]],
        num_layers: int,
        sources: Sequence[int] = (),
        state_layers: Sequence[int] = (),
    ) -> KVLayout:
        """The layout of `groups` (each group's layer indices, in the group's order, as vLLM's
        `KVCacheConfig.kv_cache_groups` lists them). `sources[i]` is the layer whose cache layer i
        reads (default: its own); every layer that reads its own must be in exactly one group,
        and a layer reading another's (KV sharing) in none: it takes its source's group and cache.
        `state_layers`: the layers that keep a state per request (class docstring)."""
        sources = tuple(sources) or tuple(range(num_layers))
        owners = [i for i in range(num_layers) if sources[i] == i]
        listed = sorted(layer for group in groups for layer in group)
        if listed != owners:
            missing = sorted(set(owners) - set(listed))
            raise ValueError(
                f"the KV-cache groups must hold each of the {len(owners)} layers once; missing "
                f"{missing[:3]}, listed {len(listed)} times in all (a layer reading another's cache "
                "is in none)"
            )
        if len(groups) == 1 and len(owners) == num_layers:
            return cls((), (), num_layers, 1)
        layer_groups, layer_caches = [0] * num_layers, [0] * num_layers
        for g, group in enumerate(groups):
            for k, layer in enumerate(group):
                layer_groups[layer], layer_caches[layer] = g, k
        for i, source in enumerate(sources):
            layer_groups[i], layer_caches[i] = layer_groups[source], layer_caches[source]
        if state_layers:
            layer_caches, num_caches = list(range(num_layers)), num_layers  # one cache a layer
            return cls(tuple(layer_groups), tuple(layer_caches), num_caches, len(groups), tuple(state_layers))
        return cls(tuple(layer_groups), tuple(layer_caches), max(map(len, groups)), len(groups))

    @property
    def caches_def(self) -> jax.tree_util.PyTreeDef | None:
        """The structure a hybrid model takes its caches in, one a layer (a state layer's
        `(conv pool, recurrent pool)` pair, an attention layer's KV array), which the runner
        holds and donates flat (`tpu_platform.state_cache`); None: a flat list."""
        if not self.state_layers:
            return None
        states = set(self.state_layers)
        return jax.tree.structure([(0, 0) if i in states else 0 for i in range(len(self.layer_caches))])

    @classmethod
    def for_model(cls, config: ModelConfig) -> KVLayout:
        """The layout vLLM's engine gives `config`'s layers (its hybrid KV-cache manager's
        grouping, `kv_cache_utils._get_kv_cache_groups_uniform_page_size`): one group when every
        layer has the same kind of attention (window, chunk); else the layers of each kind, in
        order of first appearance, split into groups of the smallest kind's count (the largest's
        when no kind has half as many again), each group taking every n-th layer of its kind.
        Layers that read another layer's cache (KV sharing) are in no group; a hybrid model's
        state layers (linear attention) are a kind of their own."""
        sources = tuple(config.kv_source(i) for i in range(config.num_layers))
        states = set(config.state_layers)
        kind_of = {
            i: (window, chunk, i in states)
            for i, (window, chunk) in enumerate(
                zip(config.layer_sliding_windows, config.layer_attention_chunks, strict=True)
            )
            if sources[i] == i
        }
        kinds = [[i for i, k in kind_of.items() if k == kind] for kind in dict.fromkeys(kind_of.values())]
        smallest, largest = min(map(len, kinds)), max(map(len, kinds))
        group_size = largest if largest < 1.5 * smallest else smallest
        groups = []
        for layers in kinds:
            num_groups = -(-len(layers) // group_size)
            groups += [layers[i::num_groups] for i in range(num_groups)]
        return cls.from_groups(groups, config.num_layers, sources, config.state_layers)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The runner's forward: `forward(state_leaves, kv_caches, packed, fed_tokens, dims=...) ->
    (logits, greedy, hidden, kv_caches)`, jitted, with the caches donated.

    `state` and `caches` are its first two arguments as `ShapeDtypeStruct`s with the shardings
    they have (or will have) where it runs. The step's packed inputs come replicated on a mesh
    (`inputs_sharding`; on a mesh of data-parallel replicas, each replica's inputs its own rows,
    `tpu_platform.replica_step`), else as host arrays (None: committed to no device, as the runner passes
    them). `context` is everything the program closes over, for naming its cached
    executables."""

    forward: Callable
    device: jax.Device  # the (first) device it runs on: the one the Pallas kernels lower for
    state: tuple[jax.ShapeDtypeStruct, ...]
    caches: tuple[jax.ShapeDtypeStruct, ...]
    inputs_sharding: jax.sharding.Sharding | None
    feed_width: int
    layout: KVLayout
    num_pages: int
    context: str
    # The forward's last output is the step's `[L, E]` load per expert (`step.forward_logits`).
    counts_expert_load: bool = False
    # Speculative decoding's step shapes: their programs return every row's logits, after the
    # caches (`step.forward_logits`); None: no speculation, no such output.
    verify_shapes: frozenset[tuple[int, int]] | None = None

    def abstract_args(self, shape: tuple[int, int, int]) -> tuple[tuple[Any, ...], tuple[int, int, int, int]]:
        """The program's abstract arguments for a step padded to `shape` (T, R, P), and its static
        `dims`: the state, the caches, the packed inputs of a step that holds no sequence, the fed
        tokens."""
        packed, dims = pack_inputs(padding_inputs(*shape, self.layout.num_groups))
        replicas = num_replicas(getattr(self.inputs_sharding, "mesh", None))  # side by side
        packed = jax.ShapeDtypeStruct(
            (replicas * packed.shape[0],), packed.dtype, sharding=self.inputs_sharding
        )
        # The feed (the previous step's tokens) is a device array where the inputs are.
        fed = jax.ShapeDtypeStruct((replicas * self.feed_width,), np.int32, sharding=self.feed_sharding)
        return (list(self.state), list(self.caches), packed, fed), dims

    @property
    def feed_sharding(self) -> jax.sharding.Sharding:
        return self.inputs_sharding or SingleDeviceSharding(self.device)

    def lower(self, shape: tuple[int, int, int]) -> jax.stages.Lowered:
        """The program lowered for a step padded to `shape`, for its devices."""
        args, dims = self.abstract_args(shape)
        with jax.default_device(self.device):  # the Pallas backends lower for the device's platform
            return self.forward.trace(*args, dims=dims).lower()

    def compile(self, shape: tuple[int, int, int]) -> jax.stages.Compiled:
        return self.lower(shape).compile()


def build_step_program(
    model_config: ModelConfig,
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: Sequence[Any],
    caches: Sequence[Any],
    *,
    backend: str,
    layout: KVLayout,
    kv_dtype: str,
    num_pages: int,
    page_size: int,
    feed_width: int,
    device: jax.Device,
    mesh: Mesh | None = None,
    aux_layers: tuple[int, ...] = (),
    count_expert_load: bool = False,
    verify_shapes: tuple[tuple[int, int], ...] | None = None,
) -> StepProgram:
    """The step program of the model (`graphdef`, `state_def`) over `state_leaves` and `caches`,
    each a `jax.Array` or a `ShapeDtypeStruct` with its sharding (the runner's placed weights and
    allocated caches, or the planner's abstract ones), each cache `num_pages` pages of
    `page_size` tokens (`kv_cache.allocate_stacked_caches`); `device`: where everything lives without a
    `mesh`; on a tensor-parallel `mesh` the caches leave the program split as they came.
    `aux_layers`: the target layers an EAGLE-3 head reads, an output of the program (none: the
    program has no such output). `count_expert_load`: the program also returns the step's load
    per expert of a MoE model, last. `verify_shapes`: speculative decoding's `(T, R)` step shapes
    (`StepBuckets.verify`; None without speculation), whose programs also return every token
    row's logits (`step.forward_logits`)."""
    state = tuple(_abstract(leaf) for leaf in state_leaves)
    abstract_caches = tuple(_abstract(cache) for cache in caches)
    per_array = caches_per_array(layout.num_caches, num_pages, page_size)
    stacked_pages = 0 if layout.state_layers else num_pages  # a hybrid's caches: one per layer
    verify = None if verify_shapes is None else frozenset(verify_shapes)
    forward = make_forward(
        graphdef, state_def, backend, layout.layer_groups, layout.layer_caches, kv_dtype,
        cache_pages=stacked_pages, caches_per_array=per_array, mesh=mesh,
        cache_shardings=None if mesh is None else [cache.sharding for cache in abstract_caches],
        cache_def=layout.caches_def, aux_layers=aux_layers, count_expert_load=count_expert_load,
        state_columns=layout.state_columns, verify_shapes=verify,
        state_shardings=None if mesh is None else [leaf.sharding for leaf in state],
    )  # fmt: skip
    replicas = num_replicas(mesh)
    tp_size = 1 if mesh is None else mesh.size // replicas
    context = repr(
        (model_config, backend, layout.layer_groups, layout.layer_caches, kv_dtype, num_pages, per_array,
         structure_text(graphdef), tp_size, architecture_fingerprint(model_config.architecture),
         *([aux_layers] if aux_layers else []), *(["expert load"] if count_expert_load else []),
         *([f"state columns {layout.state_columns}"] if layout.state_columns > 1 else []),
         *([f"verify shapes {sorted(verify)}"] if verify is not None else []),
         *([f"replicas {replicas}"] if replicas > 1 else []))
    )  # fmt: skip
    whole = None if mesh is None else replicated(mesh)
    if replicas > 1:  # each replica's inputs its own rows (`replica_step`)
        whole = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    return StepProgram(
        forward, device, state, abstract_caches, whole, feed_width, layout, num_pages, context,
        counts_expert_load=count_expert_load, verify_shapes=verify,
    )  # fmt: skip


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
