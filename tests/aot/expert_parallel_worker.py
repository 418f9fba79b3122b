# SPDX-License-Identifier: Apache-2.0
"""Compile worker: a mixture of experts' step under expert parallelism, its first layers at full
width, on a target's chips; prints one JSON line, per case and step: the collectives the rules
table does not imply (`plan.expected_collectives`), every buffer as large as one whole expert
stack of a layer (what a gathered expert weight would take), the temporaries, the bytes the
program and its experts' tiles move (`planner.hlo`), and the chip's
weight bytes as the mesh places them beside `tpu_platform.planner.replicas.chip_weights`.

    python -m tests.aot.expert_parallel_worker STEPS TARGET:MODEL:EP:LAYERS[:tp|:dp|:dpN] [...]

A case ending in `:tp` keeps the experts split inside each over the same mesh (no expert
parallelism), the sibling the decode step's expert traffic is compared with; one ending in `:dp`
compiles EP data-parallel replicas of one chip each instead (`tpu_platform.replica_step`: each
chip attends to its own requests), whose collectives are the experts' gathers and scatters
alone (listed, none of them "unexpected": the rules table's expectations are tensor parallelism's);
one ending in `:dpN`, EP / N replicas of N chips each (attention tensor-parallel inside each).

STEPS: `decode` (64 sequences), `prefill` (a 2k-token chunk) or both, comma-separated.

Weights are abstract: nothing is allocated. Run through `tests.aot.toolchains.run_worker`.
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax

from models.sharding import key_path_name
from tests.aot.step_compile import large_buffers
from tpu_platform.planner.compiled import program_facts
from tpu_platform.planner.hlo import hlo_traffic, summarize_collectives, unexpected_collectives
from tpu_platform.planner.plan import (
    StepSetup,
    expected_collectives,
    first_layers,
    model_config,
    step_program,
    step_shape,
)
from tpu_platform.planner.replicas import chip_weights

NUM_PAGES = 1024
STEP_TOKENS = {"decode": 64, "prefill": 2048}
TILE_EINSUMS = ("nbd,ndf->nbf", "nbf,nfd->nbd", "etf,efd->td")  # `models.moe.experts_routed`'s tile matmuls


def compile_case(case: str, steps_wanted: list[str]) -> dict:
    target_name, model, ep, layers, *placement = case.split(":")
    replicas = bool(placement) and placement[0].startswith("dp")
    per_replica = int(placement[0][2:] or 1) if replicas else int(ep)  # chips a replica
    setup = StepSetup(
        first_layers(model_config(model), int(layers)), target_name, max_num_seqs=64, max_model_len=2048,
        max_num_batched_tokens=2048, tp_size=per_replica, expert_parallel=placement != ["tp"],
        dp_size=int(ep) // per_replica if replicas else 1,
    )  # fmt: skip
    stack = _smallest_expert_stack(setup)
    program = step_program(setup, NUM_PAGES)
    steps = {}
    for step in steps_wanted:
        tokens = STEP_TOKENS[step]
        start = time.perf_counter()
        compiled = program.compile(step_shape(setup, tokens))
        facts = program_facts(compiled, time.perf_counter() - start)
        text = compiled.as_text()
        steps[step] = {
            "unexpected_collectives": [] if replicas else unexpected_collectives(
                list(facts.collectives), expected_collectives(setup, tokens)
            ),
            "collectives": summarize_collectives(facts.collectives),
            "expert_sized_buffers": large_buffers(text, stack),
            "temp_bytes": facts.temp_bytes, "compile_seconds": facts.compile_seconds,
            "traffic_bytes": facts.traffic.total_bytes, "expert_traffic_bytes": _expert_traffic(text),
        }  # fmt: skip
    model_state = setup.abstract_model()
    return {
        "case": case, "smallest_expert_stack_bytes": stack, "steps": steps,
        "placed_weight_bytes": model_state.chip_weight_bytes(setup.mesh()),
        "planned_weight_bytes": chip_weights(setup, int(ep) if replicas else 0).total_bytes,
        "chip_expert_bytes": chip_weights(setup, int(ep) if replicas else 0).expert_bytes,
    }  # fmt: skip


def _expert_traffic(hlo_text: str) -> int:
    """Bytes the experts' tiles move (`planner.hlo.hlo_traffic`): their matmuls (fused with the
    kernels they gather, when the compiler fuses them) and the gathers of their rows and kernels
    inside the experts' `shard_map`. A loop's body counts once."""
    return sum(
        moved
        for _, op_name, moved in hlo_traffic(hlo_text, top=1 << 30).largest
        if "/shard_map/" in op_name
        and (any(s in op_name for s in TILE_EINSUMS) or op_name.endswith("/gather"))
    )


def _smallest_expert_stack(setup: StepSetup) -> int:
    """Bytes of the smallest whole `[E, in, out]` expert kernel of a layer (as served)."""
    model = setup.abstract_model()
    paths = [key_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(model.state)[0]]
    return min(
        math.prod(leaf.shape) * leaf.dtype.itemsize
        for path, leaf in zip(paths, model.leaves, strict=True)
        if ".experts." in path and path.endswith("kernel")
    )


def main(argv: list[str]) -> None:
    steps, *cases = argv
    print(json.dumps([compile_case(case, steps.split(",")) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
