# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the runner's sharded forward step on a multi-host TPU slice, on the mesh the
hosts build at run time (`tpu_platform.hosts.per_host_devices`: a compile-only pod topology's
devices carry their host, as `jax.devices()` does on a pod), weights abstract: the planner's
`step_program`, which is the runner's own builder. Prints one JSON line: the mesh's hosts, the
compiled program's partitions, collectives and bytes per chip.

    python -m tests.aot.multihost_compile_worker TARGET MODEL TP BACKEND [NUM_LAYERS [ep]]

NUM_LAYERS (default: the model's) compiles the model cut to its first layers (`plan.first_layers`);
`ep` splits a mixture of experts' experts by index over the TP chips (`--enable-expert-parallel`).
Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import json
import re
import sys
import time

from tpu_platform.planner.plan import StepSetup, first_layers, model_config, step_program, step_shape

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64  # a decode step of 64 sequences, one token each
NUM_PAGES = 1024


def compile_step(
    target: str, model_name: str, tp: int, backend: str, num_layers: int = 0, *, expert_parallel: bool = False
) -> dict:
    config = first_layers(model_config(model_name), num_layers)
    setup = StepSetup(
        config, target, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_SEQS, tp_size=tp, expert_parallel=expert_parallel,
    )  # fmt: skip
    if setup.backend != backend:
        raise ValueError(f"{target} serves with {setup.backend}, not {backend}")
    program = step_program(setup, NUM_PAGES)
    mesh = setup.mesh()
    start = time.perf_counter()
    compiled = program.compile(step_shape(setup, MAX_NUM_SEQS, MAX_NUM_SEQS))
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    model = setup.abstract_model()
    weight_bytes = model.weight_bytes
    experts = config.num_experts or 0
    # each chip's share of the expert stacks (`[E, ...]`): whole experts, or each split inside
    expert_shares = sorted(
        {
            tuple(leaf.sharding.shard_shape(leaf.shape))
            for leaf in model.placed(mesh, None)
            if experts and leaf.ndim == 3 and leaf.shape[0] == experts
        }
    )
    return {
        "target": target, "model": model_name, "tp": tp, "backend": backend,
        "hosts": len({d.process_index for d in mesh.devices.flat}),
        "mesh_hosts": [d.process_index for d in mesh.devices.flat],
        "num_partitions": int(re.search(r"num_partitions=(\d+)", text).group(1)),
        "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
        "all_gathers": len(re.findall(r"= \S+ all-gather(?:-start)?\(", text)),
        "all_to_alls": len(re.findall(r"= \S+ (?:ragged-)?all-to-all(?:-start)?\(", text)),
        "num_layers": config.num_layers,
        "num_experts": experts,
        "expert_shares": expert_shares,
        "weight_bytes": weight_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "compile_seconds": seconds,
    }  # fmt: skip


if __name__ == "__main__":
    target, model, tp, backend, *rest = sys.argv[1:]
    layers = int(rest[0]) if rest else 0
    print(
        json.dumps(compile_step(target, model, int(tp), backend, layers, expert_parallel=rest[1:] == ["ep"]))
    )
