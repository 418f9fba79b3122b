# SPDX-License-Identifier: Apache-2.0
"""Run by `test_replica_step.py` in a process with 4 simulated CPU devices, for one tiny MoE model
directory: the step program over data-parallel replicas (`tpu_platform.replica_step`), each
replica with its own requests and KV cache, against each replica's batch run alone on one
device.

Different batches (sequence counts, tokens) padded to one shape run as 2 and 4 replicas with
the experts split by index over them (8 experts: 4 and 2 a device), as 2 replicas each
holding every expert, and as 2 replicas of 2 devices each (attention tensor-parallel inside a
replica, the experts split over all 4 devices: 2 a device). Two steps run, the second on the
caches the first wrote. Reports each form's largest differences (logits and hidden states of
both steps, the caches), the greedy tokens, each expert array's per-device shape and the
compiled step's collectives. Prints `REPORT {json}`."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from models import ModelConfig
from models.moe import use_expert_parallel
from models.sharding import DATA_AXIS, MODEL_AXIS
from pallas_kernels import allocate_kv_cache, kv_cache_partition_spec
from tpu_platform.inputs import exercise_inputs, pack_inputs
from tpu_platform.planner.hlo import hlo_collectives
from tpu_platform.replica_step import replica_mesh, replica_rows_spec
from tpu_platform.runner_state import weight_sharding
from tpu_platform.step import make_forward
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared

BACKEND, DTYPE, PAGE, PAGES = "xla", "float32", 16, 8
T_PAD, R_PAD, P_PAD = 16, 4, 2
SEQUENCES = (3, 2, 1, 3)  # replica r's batch: its sequence count, and its own random tokens


def batches(vocab: int, count: int) -> list[np.ndarray]:
    """`count` replicas' packed inputs, one padded shape, different sequences and tokens."""
    rng = np.random.default_rng(7)
    packed = []
    for num_seqs in SEQUENCES[:count]:
        inputs = exercise_inputs(T_PAD, R_PAD, P_PAD, 1, PAGES, page_size=PAGE, num_seqs=num_seqs)
        inputs = dataclasses.replace(inputs, token_ids=rng.integers(1, vocab, T_PAD).astype(np.int32))
        packed.append(pack_inputs(inputs))
    dims = {d for _, d in packed}
    assert len(dims) == 1, dims
    return [np.asarray(p) for p, _ in packed], dims.pop()


def load(model_dir: str, mesh, expert_parallel: bool) -> nnx.Module:
    tp = 1 if mesh is None else mesh.shape["model"]  # the fused projections: a block a device
    if mesh is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    else:
        sharding = functools.partial(weight_sharding, mesh, expert_parallel=expert_parallel)
    _, model = load_prepared(model_dir, Preparation(DTYPE, tp_size=tp), sharding)
    if mesh is not None and expert_parallel:
        assert use_expert_parallel(model) > 0
    return model


def run(model_dir: str, config: ModelConfig, mesh, replicas: int, expert_parallel: bool, packed, dims):
    """Two steps of `packed` (one per replica, side by side) on `mesh`; each output per replica."""
    model = load(model_dir, mesh, expert_parallel)
    graphdef, state = nnx.split(model)
    leaves, state_def = jax.tree.flatten(state)
    local = allocate_kv_cache(PAGES, PAGE, config.num_kv_heads, config.head_dim, jnp.float32, backend=BACKEND)
    if mesh is None:
        cache_sharding = SingleDeviceSharding(jax.devices()[0])
    else:  # the replicas' caches side by side (each split over its devices), as the runner holds them
        cache_sharding = NamedSharding(mesh, replica_rows_spec(kv_cache_partition_spec(BACKEND, MODEL_AXIS)))
    shape = (replicas * local.shape[0], *local.shape[1:])
    caches = [jax.device_put(np.zeros(shape, np.float32), cache_sharding) for _ in range(config.num_layers)]
    forward = make_forward(
        graphdef, state_def, BACKEND, mesh=mesh,
        cache_shardings=None if mesh is None else [cache_sharding] * config.num_layers,
        state_shardings=None if mesh is None else [leaf.sharding for leaf in leaves],
    )  # fmt: skip
    feed_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    inputs = jax.device_put(np.concatenate(packed), feed_sharding)
    fed = jax.device_put(np.zeros(replicas * R_PAD, np.int32), feed_sharding)
    steps = []
    for _ in range(2):
        logits, greedy, hidden, caches = forward(leaves, caches, inputs, fed, dims=dims)
        steps.append([np.split(np.asarray(out), replicas) for out in (logits, greedy, hidden)])
    cache_rows = np.split(np.asarray(caches[-1]), replicas)
    hlo = forward.lower(leaves, caches, inputs, fed, dims=dims).compile().as_text()
    collectives = [(c.kind, [list(dims) for _, dims in c.results]) for c in hlo_collectives(hlo)]
    experts = {
        name: [list(leaf.shape), list(leaf.addressable_shards[0].data.shape)]
        for name, leaf in _named_leaves(state).items()
        if ".experts." in name
    }
    return steps, cache_rows, collectives, experts


def _named_leaves(state) -> dict[str, jax.Array]:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def largest_difference(got, want) -> float:
    """The largest difference over both steps' logits and hidden states of every replica."""
    return max(
        float(np.abs(g[out][r] - w[out][r]).max())
        for g, w in zip(got, want, strict=True)
        for out in (0, 2)
        for r in range(len(w[out]))
    )


def main(model_dir: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    config = ModelConfig.from_pretrained(model_dir)
    packed, dims = batches(config.vocab_size, 4)
    alone = [run(model_dir, config, None, 1, False, [p], dims) for p in packed]
    report = {"scale": max(float(np.abs(a[0][0][0][0]).max()) for a in alone)}
    forms = (("dp2_ep", 2, 1, True), ("dp4_ep", 4, 1, True), ("dp2", 2, 1, False), ("dp2_tp2_ep", 2, 2, True))
    for name, replicas, tp, ep in forms:
        mesh = replica_mesh(replicas, devices_per_replica=tp)
        got = run(model_dir, config, mesh, replicas, ep, packed[:replicas], dims)
        want = [[[a[0][s][out][0] for a in alone[:replicas]] for out in range(3)] for s in range(2)]
        report[name] = {
            "max_diff": largest_difference(got[0], want),
            "greedy": [g.tolist() for g in got[0][1][1]],
            "greedy_alone": [a[0][1][1][0].tolist() for a in alone[:replicas]],
            # Split over a replica's devices, a cache is their local caches side by side
            # (`kv_cache_partition_spec`): not the one-device layout, so compared at N = 1 only.
            "cache_diff": max(float(np.abs(c - a[1][0]).max()) for c, a in zip(got[1], alone, strict=False))
            if tp == 1
            else None,
            "cache_scale": max(float(np.abs(c).max()) for c in got[1]),
            "collectives": got[2],
            "experts": got[3],
        }
    report["tokens_by_hidden"] = [T_PAD, config.hidden_size]
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
