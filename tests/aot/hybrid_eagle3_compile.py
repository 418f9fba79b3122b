# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles a hybrid target's verification step handing an EAGLE-3 head its hidden states,
and the head's programs, for a compile-only chip.

`python -m tests.aot.hybrid_eagle3_compile TARGET K ROWS PAGES` (run by `toolchains.run_worker`):
Qwen3-Next-80B-A3B at full width cut to one Gated DeltaNet layer and one full-attention one, dense
MLPs (`hybrid_verify_compile.hybrid_config`), ROWS requests verifying k drafts each (1 + k state
blocks a request); the step program with the head's three layers as an output (index 0: the Gated
DeltaNet layer's input, 1: its output, 2: the attention layer's), then the head's pass over that
step's tokens, its block tables those of the target's groups, and its loop of k - 1 steps
(`planner.draft.compile_eagle3`, the runner's builders), over caches of PAGES block ids. Prints
one JSON line: each program's temp, aliased and cache bytes, and the step's instructions that make
an array as large as its smallest cache (`step_compile.large_buffers`). Weights are abstract.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from tests.aot.hybrid_verify_compile import MAX_MODEL_LEN, hybrid_config
from tests.aot.step_compile import large_buffers
from tpu_platform.planner.draft import compile_eagle3, eagle3_head_like
from tpu_platform.planner.plan import StepSetup, step_program, step_shape

AUX_LAYERS = (0, 1, 2)


def _facts(facts) -> dict:
    return {"temp_bytes": facts.temp_bytes, "alias_bytes": facts.alias_bytes}


def main(target: str, k: str, rows: str, pages: str) -> dict:
    k, rows, pages = int(k), int(rows), int(pages)
    setup = StepSetup(
        hybrid_config(2, "dense"), target, max_num_seqs=rows, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(rows * (1 + k), 16), speculative_tokens=k,
    )  # fmt: skip
    program = step_program(setup, pages, aux_layers=AUX_LAYERS)
    compiled = program.compile(step_shape(setup, rows * (1 + k), rows))
    memory = compiled.memory_analysis()
    caches = [int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in program.caches]
    out = {
        "state_columns": program.layout.state_columns,
        "step": {"temp_bytes": memory.temp_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes},
        "cache_bytes": sum(caches),
        "large_buffers": large_buffers(compiled.as_text(), min(caches)),
    }
    head = dataclasses.replace(eagle3_head_like(setup), aux_layer_ids=AUX_LAYERS)
    programs = compile_eagle3(setup, head, pages, rows * (1 + k), rows, k)
    out["head_pass"], out["head_loop"] = _facts(programs.head_pass), _facts(programs.loop)
    out["head_cache_bytes"] = programs.cache_bytes
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
