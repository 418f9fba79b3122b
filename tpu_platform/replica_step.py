# SPDX-License-Identifier: Apache-2.0
"""Data-parallel replicas in one step program: a mesh of D x N devices (`DATA_AXIS` of D
replicas, a model axis of N devices each), each replica running its step on its own requests.

This is the form expert parallelism across replicas takes (vLLM's expert-parallel group of
D x N devices, attention data-parallel, as DeepSeek-V3 and Qwen3-MoE are served at scale): a
replica's step under a `shard_map` manual over the replicas only, so each replica sees its own
packed inputs, fed tokens and KV cache, and attention, the KV write and the logits never leave
its devices; inside, the model axis stays automatic and the replica's step is the N-device
tensor-parallel one (its per-device `shard_map`s nested in this one: their bodies take every
weight they use as an argument, since a weight closed over would be typed on the outer mesh).
The only exchange between replicas is the experts' (`models.moe.experts_by_index`:
a gather of the replicas' tokens and a scatter of their sums). Every other weight is whole in
each replica (split over its N devices as tensor parallelism splits it); the experts are split by
index over all D x N devices (`models.sharding.parameter_sharding`).

Every per-replica array of the program (inputs, caches, outputs) is the replicas' arrays side by
side on its first axis: replica r's is rows `r * n .. (r + 1) * n` of the global array, held by
replica r's devices (`side_by_side`). Every replica's step has the same padded shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.sharding import DATA_AXIS, MODEL_AXIS
from tpu_platform.mesh import check_devices

_BY_REPLICA = PartitionSpec(DATA_AXIS)


def replica_mesh(
    num_replicas: int, devices: Sequence[jax.Device] | None = None, devices_per_replica: int = 1
) -> Mesh:
    """A `[num_replicas, devices_per_replica]` mesh over the first of `devices` (this host's
    `jax.local_devices()` by default), replica r on devices `r * N .. (r + 1) * N`."""
    devices = list(jax.local_devices() if devices is None else devices)
    if num_replicas < 1 or devices_per_replica < 1:
        raise ValueError(
            f"data_parallel_size and tensor_parallel_size must be >= 1, got {num_replicas} and "
            f"{devices_per_replica}"
        )
    count = num_replicas * devices_per_replica
    check_devices(count, devices)
    grid = np.array(devices[:count]).reshape(num_replicas, devices_per_replica)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def num_replicas(mesh: Mesh | None) -> int:
    """The data-parallel replicas of `mesh` (1: none, or no mesh)."""
    return 1 if mesh is None else dict(mesh.shape).get(DATA_AXIS, 1)


def replica_rows_spec(replica_spec: PartitionSpec) -> PartitionSpec:
    """How the replicas' arrays side by side split: by replica on the first axis, and inside a
    replica as `replica_spec` splits one replica's over its devices (a cache on its KV heads)."""
    spec = list(replica_spec) or [None]
    spec[0] = DATA_AXIS if spec[0] is None else (DATA_AXIS, spec[0])
    return PartitionSpec(*spec)


def over_replicas_step(
    step: Callable,
    mesh: Mesh,
    state_shardings: Sequence[NamedSharding],
    cache_shardings: Sequence[NamedSharding],
    extra_outputs: int,
) -> Callable:
    """`step(state_leaves, kv_caches, packed, fed_tokens, dims=..., mesh=..., replicas=...)` (one
    replica's, `tpu_platform.step.forward_logits`) run by every replica of `mesh` on its own rows
    of the inputs, caches and outputs, jitted with the caches donated; the weights come placed
    with `state_shardings`, the caches with `cache_shardings` (`side_by_side`)."""
    replicas, devices = num_replicas(mesh), mesh.shape[MODEL_AXIS]
    # The outer `shard_map` is manual over the replicas alone: each replica's arrays arrive as
    # its own rows, still split over its devices (the model axis stays automatic inside).
    state_specs = [_over_replicas(sharding.spec) for sharding in state_shardings]
    cache_specs = [_over_replicas(sharding.spec) for sharding in cache_shardings]

    def replicas_step(state_leaves, kv_caches, packed, fed_tokens, dims):
        def replica(state_leaves, kv_caches, packed, fed_tokens):
            # Its tensor-parallel mesh: the context's, the replicas' axis manual there already.
            inner = jax.sharding.get_abstract_mesh() if devices > 1 else None
            return step(state_leaves, kv_caches, packed, fed_tokens, dims=dims, mesh=inner, replicas=replicas)

        return jax.shard_map(
            replica,
            mesh=mesh,
            in_specs=(state_specs, cache_specs, _BY_REPLICA, _BY_REPLICA),
            out_specs=(_BY_REPLICA, _BY_REPLICA, _BY_REPLICA, cache_specs, *[_BY_REPLICA] * extra_outputs),
            # A device a replica: manual over every axis (the model axis is 1), so that a kernel
            # (Mosaic's) runs as it is, which no compiler partitions on its own.
            axis_names={DATA_AXIS} if devices > 1 else {DATA_AXIS, MODEL_AXIS},
            check_vma=False,
        )(list(state_leaves), list(kv_caches), packed, fed_tokens)

    rows = NamedSharding(mesh, _BY_REPLICA)
    return jax.jit(
        replicas_step,
        donate_argnums=(1,),
        static_argnames=("dims",),
        out_shardings=(rows, rows, rows, list(cache_shardings), *[rows] * extra_outputs),
    )


def _over_replicas(spec: PartitionSpec) -> PartitionSpec:
    """`spec` with only its replicas' axis: what the replicas' `shard_map` splits by hand."""

    def replicas_only(entry):
        axes = entry if isinstance(entry, tuple) else (entry,)
        return DATA_AXIS if DATA_AXIS in axes else None

    return PartitionSpec(*(replicas_only(entry) for entry in spec))


def replica_devices(devices_per_replica: int = 1) -> list[jax.Device]:
    """The first `devices_per_replica` devices of each process of this JAX job, in process order:
    the replicas' devices when each data-parallel rank's process drives one replica (`Runner`
    with `data_parallel_size`)."""
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    return [d for index in sorted(by_process) for d in by_process[index][:devices_per_replica]]


def side_by_side(local: jax.Array, mesh: Mesh) -> jax.Array:
    """This process's replica array `local` (on its device, or split over its devices as their
    tensor-parallel mesh splits it) as its rows of the replicas' global array (the replicas'
    arrays side by side on the first axis), without a copy of what its devices hold (an array on
    one device is copied to the replica's others); a global array is returned as it is."""
    if len(local.sharding.device_set) == mesh.size:
        return local
    spec = local.sharding.spec if isinstance(local.sharding, NamedSharding) else PartitionSpec()
    held = {shard.device: shard.data for shard in local.addressable_shards}
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    parts = [held[d] if d in held else jax.device_put(local, d) for d in mine]
    shape = (num_replicas(mesh) * local.shape[0], *local.shape[1:])
    rows = NamedSharding(mesh, replica_rows_spec(spec))
    return jax.make_array_from_single_device_arrays(shape, rows, parts)


def own_part(array: jax.Array, local_mesh: Mesh | None = None) -> jax.Array:
    """This process's replica's part of a global array of the replicas' program (its rows of a
    per-replica one, its experts of a stack split over every device, a whole weight), without a
    copy: on its device, or (`local_mesh`: the replica's devices) split over them as the array
    is split over the replica's devices."""
    if local_mesh is None:
        return array.addressable_data(0)
    spec = array.sharding.spec
    replicas = num_replicas(array.sharding.mesh)
    shape = list(array.shape)
    local_spec = []
    for axis, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple) else (entry,)
        if DATA_AXIS in axes:
            shape[axis] //= replicas
        kept = tuple(a for a in axes if a not in (None, DATA_AXIS))
        local_spec.append(kept[0] if len(kept) == 1 else (kept or None))
    parts = [shard.data for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(
        tuple(shape), NamedSharding(local_mesh, PartitionSpec(*local_spec)), parts
    )


def agreed_tokens(own: int) -> int:
    """The most tokens any replica's step has: every replica pads its step to the bucket of that
    many (one program, one shape). Every replica calls it once a step, in the same order."""
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(own))))


def fewest(own: int) -> int:
    """The smallest of every replica's `own` (the KV pages each can hold: the caches are one
    global array, the same size a replica)."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(own))))
