# SPDX-License-Identifier: Apache-2.0
"""Compile worker: sizes the KV cache of real-size models split over the chips of a target with
the real compiler (`tpu_platform.plan_kv.fit_kv_cache` on the runner's mesh: the sharded
prefill and decode programs and the sampler, weights abstract and placed by the rules table),
reads the compiled steps' collectives against what the rules table implies
(`tpu_platform.plan.expected_collectives`) and prints one JSON line: each case's fit, its
weight bytes (whole, per chip, replicated) and the collectives that should not be there.

    python -m tests.aot.tensor_parallel_worker TARGET:MODEL:TP[:LAYERS] [...]

LAYERS keeps the model's first layers only: its real shapes at a fraction of the compile time.

Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from tests.aot.model_step_worker import DECODE_TOKENS, MAX_MODEL_LEN, PREFILL_TOKENS
from tpu_platform.plan import StepSetup, abstract_model, expected_collectives, model_config
from tpu_platform.plan_hlo import unexpected_collectives
from tpu_platform.plan_kv import fit_kv_cache


def fit_case(case: str) -> dict:
    target_name, model, tp, *layers = case.split(":")
    config = model_config(model)
    if layers:
        kept = int(layers[0])
        # Every per-layer field is cut to the kept layers (Llama 4's RoPE flags beside the windows).
        per_layer = {
            name: getattr(config, name)[:kept]
            for name in ("layer_sliding_windows", "rope_layers")
            if hasattr(config, name)
        }
        config = dataclasses.replace(config, num_layers=kept, **per_layer)
    setup = StepSetup(
        config, target_name, max_num_seqs=DECODE_TOKENS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=PREFILL_TOKENS, tp_size=int(tp),
    )  # fmt: skip
    start = time.perf_counter()
    fit = fit_kv_cache(setup, DECODE_TOKENS, PREFILL_TOKENS)
    abstract = abstract_model(setup.config, setup.dtype, setup.max_model_len, setup.tp_size)
    placed = abstract.placed(setup.mesh(), None)
    replicated = sum(leaf.size * leaf.dtype.itemsize for leaf in placed if not leaf.sharding.spec)
    problems = {}
    for step, tokens in (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS)):
        program = getattr(fit, step)
        if program is not None:
            problems[step] = unexpected_collectives(
                list(program.collectives), expected_collectives(setup, tokens)
            )
    return {
        "case": case, "tp_size": setup.tp_size, "hbm_bytes": setup.compile_target.hbm_bytes,
        "backend": setup.backend, "seconds": time.perf_counter() - start,
        "total_weight_bytes": abstract.weight_bytes, "replicated_weight_bytes": replicated,
        "unexpected_collectives": problems, **fit.as_dict(),
    }  # fmt: skip


def main(cases: list[str]) -> None:
    print(json.dumps([fit_case(case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
