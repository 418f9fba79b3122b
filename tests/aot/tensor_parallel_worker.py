# SPDX-License-Identifier: Apache-2.0
"""Compile worker: sizes the KV cache of real-size models split over the chips of a target with
the real compiler on the runner's mesh (the sharded prefill and decode programs and the sampler,
weights abstract and placed by the rules table), reads the compiled steps' collectives against
what the rules table implies (`tpu_platform.planner.plan.expected_collectives`) and prints one JSON
line: each case's fit, its weight bytes (whole, per chip, replicated) and the collectives that
should not be there.

    python -m tests.aot.tensor_parallel_worker MODE TARGET:MODEL:TP[:ep][:QUANTIZATION] [...]

`:ep`: under expert parallelism (the experts split by index); each case then also reports the
experts' bytes, whole and per chip, and each short program's collective bytes. `:QUANTIZATION`:
the weights as a checkpoint so quantized is served (one of `plan.QUANTIZATIONS`, e.g. `fp8-g128`
for a 128x128 block fp8 checkpoint); bfloat16 without.

MODE `full`: every layer compiled (`tpu_platform.planner.kv.fit_kv_cache`); `depth`: the model's
first 2 and 4 layers (`tpu_platform.planner.depth.fit_by_depth`: the memory extrapolated, the
collectives of each short program checked against what its own depth implies);
`depth-one-prefill`: the same, the prefill step at 2 layers only, its memory bounded from above
(`fit_by_depth(one_prefill=True)`: on TPU a prefill program compiles for minutes at any depth).

Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import jax

from models.sharding import key_path_name
from tests.aot.model_step_worker import DECODE_TOKENS, PREFILL_TOKENS, setup_for
from tpu_platform.planner.depth import at_depth, fit_by_depth
from tpu_platform.planner.hlo import unexpected_collectives
from tpu_platform.planner.kv import fit_kv_cache
from tpu_platform.planner.plan import QUANTIZATIONS, expected_collectives

STEPS = (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS))


def fit_case(mode: str, case: str) -> dict:
    target_name, model, tp, *flags = case.split(":")
    quantization = [flag for flag in flags if flag in QUANTIZATIONS]
    setup = setup_for(":".join([target_name, model, *quantization]), tp_size=int(tp))
    if "ep" in flags:
        setup = dataclasses.replace(setup, expert_parallel=True)
    start = time.perf_counter()
    problems = {}
    if mode == "full":
        fit = fit_kv_cache(setup, DECODE_TOKENS, PREFILL_TOKENS)
        for step, tokens in STEPS:
            program = getattr(fit, step)
            if program is not None:
                problems[step] = unexpected_collectives(
                    list(program.collectives), expected_collectives(setup, tokens)
                )
    else:
        fit = fit_by_depth(setup, DECODE_TOKENS, PREFILL_TOKENS, one_prefill=mode == "depth-one-prefill")
        for step, tokens in STEPS:
            problems[step] = [
                f"{depth} layers: {problem}"
                for depth, program in zip(
                    fit.compiled_depths.get(step, ()), fit.short.get(step, ()), strict=True
                )
                for problem in unexpected_collectives(
                    list(program.collectives), expected_collectives(at_depth(setup, depth), tokens)
                )
            ]
    abstract = setup.abstract_model()
    placed = abstract.placed(setup.mesh(), None)
    replicated = sum(leaf.size * leaf.dtype.itemsize for leaf in placed if not leaf.sharding.spec)
    return {
        "case": case, "mode": mode, "tp_size": setup.tp_size, "hbm_bytes": setup.compile_target.hbm_bytes,
        "backend": setup.backend, "quantization": setup.quantization, "seconds": time.perf_counter() - start,
        "total_weight_bytes": abstract.weight_bytes, "replicated_weight_bytes": replicated,
        "unexpected_collectives": problems, **_experts(setup, abstract, placed), **fit.as_dict(),
    }  # fmt: skip


def _experts(setup, abstract, placed) -> dict:
    """The experts' bytes, whole and on one chip (`.experts.` arrays: the rules table's paths), and
    each distinct expert array's shape beside a chip's shard of it."""
    paths = [key_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(abstract.state)[0]]
    experts = [leaf for path, leaf in zip(paths, placed, strict=True) if ".experts." in path]
    return {
        "expert_parallel": setup.expert_parallel,
        "expert_bytes": sum(leaf.size * leaf.dtype.itemsize for leaf in experts),
        "chip_expert_bytes": sum(
            math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in experts
        ),
        "expert_shards": sorted(
            {(tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape))) for leaf in experts}
        ),
    }


def main(argv: list[str]) -> None:
    mode, *cases = argv
    print(json.dumps([fit_case(mode, case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
