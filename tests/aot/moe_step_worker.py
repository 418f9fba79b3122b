# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the runner's step of a real-size mixture of experts cut to its first layers,
each at full width, compiled for a target on its tensor-parallel mesh; prints one JSON line per
case: the compiled program's memory analysis, the bytes of the experts one chip holds for one
MoE layer (as served, and dequantized to the step's dtype) and the program's largest buffers.

    python -m tests.aot.moe_step_worker TARGET:MODEL:TP:LAYERS:TOKENS [...]

Weights are abstract: nothing is allocated. Run through `tests.aot.toolchains.run_worker`.
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax

from models.sharding import key_path_name
from tpu_platform.planner.hlo import shape_bytes
from tpu_platform.planner.plan import StepSetup, first_layers, model_config, step_program, step_shape

NUM_PAGES = 256  # a small cache: what the step makes beyond it is what is looked at
LARGEST = 8


def compile_case(case: str) -> dict:
    target_name, model, tp, layers, tokens = case.split(":")
    config = first_layers(model_config(model), int(layers))
    setup = StepSetup(
        config, target_name, max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=int(tokens),
        tp_size=int(tp),
    )  # fmt: skip
    start = time.perf_counter()
    compiled = step_program(setup, NUM_PAGES).compile(step_shape(setup, int(tokens)))
    memory = compiled.memory_analysis()
    return {
        "case": case, "seconds": time.perf_counter() - start,
        "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
        "moe_layers": sum(map(config.is_moe_layer, range(config.num_layers))),
        **_layer_experts(setup), "largest_buffers": _largest(compiled.as_text()),
    }  # fmt: skip


def _layer_experts(setup: StepSetup) -> dict:
    """Bytes of one MoE layer's routed experts on one chip, as held and as `[E, in, out]` kernels
    in the step's dtype (what a dequantized copy of the whole stack would take)."""
    model = setup.abstract_model()
    placed = model.placed(setup.mesh(), None)
    paths = [key_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(model.state)[0]]
    layer = next(p.split(".experts.")[0] for p in paths if ".experts." in p)
    held = dequantized = 0
    for path, leaf in zip(paths, placed, strict=True):
        if not path.startswith(layer + ".experts.") or path.endswith("bias"):
            continue
        shard = leaf.sharding.shard_shape(leaf.shape)
        held += math.prod(shard) * leaf.dtype.itemsize
        if path.endswith(("scales", "scale")):  # the kernels' scales: no values of their own
            continue
        # mxfp4 blocks `[E, out, in / 32, 16]` bytes hold 32 values a block, two a byte.
        values = math.prod(shard) * (2 if path.endswith("blocks") else 1)
        dequantized += values * jax.numpy.dtype(setup.dtype).itemsize
    return {"layer_expert_bytes": held, "layer_expert_dequantized_bytes": dequantized}


def _largest(hlo_text: str) -> list[list]:
    """The entry computation's largest results: [bytes, opcode, shape]."""
    entry, found = False, []
    for line in hlo_text.splitlines():
        entry = entry or line.startswith("ENTRY")
        if not entry or " = " not in line:
            continue
        result, _, rest = line.split(" = ", 1)[1].partition(" ")
        opcode = (
            rest.split("(", 1)[0] if not result.startswith("(") else line.split(") ", 1)[-1].split("(")[0]
        )
        if opcode not in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            found.append(
                [shape_bytes(line.split(" = ", 1)[1].split(" metadata")[0][:400]), opcode, result[:160]]
            )
    return sorted(found, reverse=True)[:LARGEST]


def main(argv: list[str]) -> None:
    print(json.dumps([compile_case(case) for case in argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
