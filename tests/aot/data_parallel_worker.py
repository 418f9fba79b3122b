# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the step a data-parallel replica of one chip compiles, on chips of a target
of several and on a target of one; prints one JSON line, per chip and step: the optimized HLO
with its module's name taken out, the memory analysis and the collectives.

    python -m tests.aot.data_parallel_worker STEPS TARGET:MODEL:LAYERS:CHIP [...]

STEPS: `decode` (64 sequences), `prefill` (a 2k-token chunk) or both, comma-separated.

A replica (`--data-parallel-size D`, TP=1) is its own process seeing only its chip
(`plugin_shim/data_parallel.py`), which builds the runner's one-chip program; the planner's
`step_program` (the runner's own builder) builds it here for the target's chip CHIP, the model
cut to its first LAYERS layers at full width. Weights are abstract: nothing is allocated.
Run through `tests.aot.toolchains.run_worker`.
"""

from __future__ import annotations

import json
import re
import sys

from tpu_platform.planner.hlo import hlo_collectives
from tpu_platform.planner.plan import StepSetup, first_layers, model_config, step_program, step_shape
from tpu_platform.planner.targets import compile_only_devices

NUM_PAGES = 512
STEP_TOKENS = {"decode": 64, "prefill": 2048}
_MODULE_NAME = re.compile(r"^HloModule \S+")


def compile_replica(case: str, steps_wanted: list[str]) -> dict:
    target_name, model, layers, chip = case.split(":")
    setup = StepSetup(
        first_layers(model_config(model), int(layers)), target_name, max_num_seqs=64, max_model_len=2048,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    device = compile_only_devices(target_name)[int(chip)]
    program = step_program(setup, NUM_PAGES, device=device)
    steps = {}
    for step in steps_wanted:
        compiled = program.compile(step_shape(setup, STEP_TOKENS[step]))
        memory = compiled.memory_analysis()
        text = compiled.as_text()
        steps[step] = {
            "hlo": _MODULE_NAME.sub("HloModule step", text, count=1),
            "num_partitions": int(m.group(1)) if (m := re.search(r"num_partitions=(\d+)", text)) else 1,
            "collectives": len(hlo_collectives(text)),
            "memory": [
                int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes),
            ],
        }  # fmt: skip
    return {"case": case, "device_id": device.id, "steps": steps}


def main(argv: list[str]) -> None:
    steps, *cases = argv
    print(json.dumps([compile_replica(case, steps.split(",")) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
