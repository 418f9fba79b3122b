# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles a hybrid model's verification step under speculative decoding for a
compile-only chip: Qwen3-Next-80B-A3B at full width, cut to a few layers alternating Gated DeltaNet
and gated full attention, its requests holding 1 + k state blocks (`tpu_platform.state_cache`:
the verification of k drafts leaves the state after each of its 1 + k rows in its own block).

`python -m tests.aot.hybrid_verify_compile TARGET LAYERS MLP K ROWS:PAGES ...` (run by
`toolchains.run_worker`): LAYERS layers (an even number: one of each kind a pair), MLP `dense`
(every layer's MLP dense, `mlp_only_layers`: the cheap point) or `moe` (512 routed experts and a
shared one, as the model has), k drafts; for each `ROWS:PAGES` the planner's step program
(`planner.plan.step_program` with `speculative_tokens=k`, the runner's own builder) compiled for a
step of ROWS requests of 1 + k rows each over caches of PAGES block ids. Prints one JSON line: per
case the program's layout, the compiled memory analysis, the caches' and the largest state pool's
bytes, and every optimized-HLO instruction that makes a new array at least as large as the
smallest cache array (`step_compile.large_buffers`). Weights are abstract: nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from models import ModelConfig
from models.qwen3_next import FULL_ATTENTION, LINEAR_ATTENTION
from tests.aot.step_compile import large_buffers
from tpu_platform.planner.plan import StepSetup, first_layers, model_config, step_program, step_shape

MAX_MODEL_LEN = 4096


def hybrid_config(num_layers: int, mlp: str) -> ModelConfig:
    """Qwen3-Next-80B-A3B's widths, `num_layers` layers alternating linear and full attention."""
    if num_layers < 2 or num_layers % 2 or mlp not in ("dense", "moe"):
        raise ValueError(f"LAYERS must be even and >= 2 and MLP dense or moe, not {num_layers} {mlp}")
    config = first_layers(model_config("qwen3-next-80b-a3b"), num_layers)
    kinds = (LINEAR_ATTENTION, FULL_ATTENTION) * (num_layers // 2)
    dense = tuple(range(num_layers)) if mlp == "dense" else ()
    return dataclasses.replace(config, layer_types=kinds, mlp_only_layers=dense)


def _bytes(array) -> int:
    return int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize


def compile_case(config: ModelConfig, target: str, k: int, rows: int, num_pages: int) -> dict:
    setup = StepSetup(
        config, target, max_num_seqs=rows, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(rows * (1 + k), 16), speculative_tokens=k,
    )  # fmt: skip
    program = step_program(setup, num_pages)
    shape = step_shape(setup, rows * (1 + k), rows)
    start = time.perf_counter()
    compiled = program.compile(shape)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    caches = [_bytes(c) for c in program.caches]
    states = set(config.state_layers)
    layers = _layer_of_each_cache(config)
    pools = [_bytes(c) for c, layer in zip(program.caches, layers, strict=True) if layer in states]
    return {
        "case": f"{target} k{k} r{rows} p{num_pages}",
        "shape": list(shape),
        "state_columns": program.layout.state_columns,
        "state_groups": len(program.layout.state_groups),
        "compile_seconds": round(seconds, 2),
        "cache_bytes": sum(caches),
        "largest_pool_bytes": max(pools),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "large_buffers": large_buffers(compiled.as_text(), min(caches)),
    }


def _layer_of_each_cache(config: ModelConfig) -> list[int]:
    """The layer of each flat cache array: a state layer has two pools, the others one KV cache."""
    states = set(config.state_layers)
    return [i for i in range(config.num_layers) for _ in range(2 if i in states else 1)]


def main(argv: list[str]) -> None:
    target, layers, mlp, k, *cases = argv
    config = hybrid_config(int(layers), mlp)
    out = []
    for case in cases:
        rows, pages = (int(x) for x in case.split(":"))
        out.append(compile_case(config, target, int(k), rows, pages))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
