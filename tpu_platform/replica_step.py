# SPDX-License-Identifier: Apache-2.0
"""Data-parallel replicas in one step program: a mesh of D devices (`DATA_AXIS`, and a model
axis of 1), each running one replica's step on its own requests.

This is the form expert parallelism across replicas takes (vLLM's expert-parallel group of D
devices, attention data-parallel, as DeepSeek-V3 and Qwen3-MoE are served at scale): the
one-device step of a replica under a `shard_map` manual over the replicas, so each replica sees
its own packed inputs, fed tokens and KV cache, and attention, the KV write and the logits never
leave its device; the only exchange between replicas is the experts'
(`models.moe.experts_by_index_over_replicas`: a gather of the replicas' tokens and a scatter of
their sums). Every other weight is whole on each device; the experts are split by index over
the D devices (`models.sharding.parameter_sharding`). Replicas of several devices each
(attention tensor-parallel inside a replica) are not built: the replica's own step would then
be a `shard_map` inside this one, and its per-device code closes over weights the nested form
does not take.

Every per-replica array of the program (inputs, caches, outputs) is the replicas' arrays side by
side on its first axis: replica r's is rows `r * n .. (r + 1) * n` of the global array, held by
replica r's device (`side_by_side`). Every replica's step has the same padded shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.sharding import DATA_AXIS, MODEL_AXIS
from tpu_platform.mesh import check_devices

_BY_REPLICA = PartitionSpec(DATA_AXIS)


def replica_mesh(num_replicas: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `[num_replicas, 1]` mesh over the first `num_replicas` devices (of this host:
    `jax.local_devices()` by default), replica r on device r."""
    devices = list(jax.local_devices() if devices is None else devices)
    if num_replicas < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
    check_devices(num_replicas, devices)
    return Mesh(np.array(devices[:num_replicas]).reshape(num_replicas, 1), (DATA_AXIS, MODEL_AXIS))


def num_replicas(mesh: Mesh | None) -> int:
    """The data-parallel replicas of `mesh` (1: none, or no mesh)."""
    return 1 if mesh is None else dict(mesh.shape).get(DATA_AXIS, 1)


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
    if devices != 1:
        raise ValueError(
            f"data-parallel replicas of {devices} devices each in one step program (attention "
            "tensor-parallel inside each) are not built; use one device a replica"
        )
    state_specs = [sharding.spec for sharding in state_shardings]
    cache_specs = [sharding.spec for sharding in cache_shardings]

    def replicas_step(state_leaves, kv_caches, packed, fed_tokens, dims):
        def replica(state_leaves, kv_caches, packed, fed_tokens):
            return step(state_leaves, kv_caches, packed, fed_tokens, dims=dims, mesh=None, replicas=replicas)

        return jax.shard_map(
            replica,
            mesh=mesh,
            in_specs=(state_specs, cache_specs, _BY_REPLICA, _BY_REPLICA),
            out_specs=(_BY_REPLICA, _BY_REPLICA, _BY_REPLICA, cache_specs, *[_BY_REPLICA] * extra_outputs),
            check_vma=False,
        )(list(state_leaves), list(kv_caches), packed, fed_tokens)

    rows = NamedSharding(mesh, _BY_REPLICA)
    return jax.jit(
        replicas_step,
        donate_argnums=(1,),
        static_argnames=("dims",),
        out_shardings=(rows, rows, rows, list(cache_shardings), *[rows] * extra_outputs),
    )


def replica_devices() -> list[jax.Device]:
    """The first device of each process of this JAX job, in process order: the replicas' devices
    when each data-parallel rank's process drives one (`Runner` with `data_parallel_size`)."""
    firsts: dict[int, jax.Device] = {}
    for device in jax.devices():
        firsts.setdefault(device.process_index, device)
    return [firsts[index] for index in sorted(firsts)]


def side_by_side(local: jax.Array, mesh: Mesh) -> jax.Array:
    """This process's replica array `local` (on its device) as its rows of the replicas' global
    array (the replicas' arrays side by side on the first axis), without a copy; a global array
    is returned as it is."""
    if len(local.sharding.device_set) == mesh.size:
        return local
    shape = (num_replicas(mesh) * local.shape[0], *local.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, _BY_REPLICA), [local])


def own_rows(array: jax.Array) -> jax.Array:
    """This process's replica's rows of a global per-replica array, on its device, without a copy."""
    return array.addressable_data(0)


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
