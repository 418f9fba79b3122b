# SPDX-License-Identifier: Apache-2.0
"""Compile worker: sizes the KV cache of real-size models on one chip of a target with the real
compiler (`tpu_platform.plan_kv.fit_kv_cache`: the runner's prefill and decode programs and its
sampler, weights abstract) and prints one JSON line: each case's fit and compiled programs.

    python -m tests.aot.model_step_worker TARGET:MODEL[:int8] [TARGET:MODEL[:int8] ...]

A case ending in `:int8` plans the model with int8 weights (`StepSetup(quantization="int8")`).

Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import json
import sys
import time

from tpu_platform.plan import StepSetup, model_config
from tpu_platform.plan_kv import fit_kv_cache

DECODE_TOKENS = 64  # a decode batch of 64 sequences, one token each
PREFILL_TOKENS = 2048  # one 2k-token prefill chunk
MAX_MODEL_LEN = 2048


def fit_case(case: str) -> dict:
    target_name, model, *quantization = case.split(":")
    setup = StepSetup(
        model_config(model), target_name, max_num_seqs=DECODE_TOKENS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=PREFILL_TOKENS, quantization=quantization[0] if quantization else "none",
    )  # fmt: skip
    start = time.perf_counter()
    fit = fit_kv_cache(setup, DECODE_TOKENS, PREFILL_TOKENS)
    return {
        "case": case, "hbm_bytes": setup.compile_target.hbm_bytes, "backend": setup.backend,
        "seconds": time.perf_counter() - start, **fit.as_dict(),
    }  # fmt: skip


def main(cases: list[str]) -> None:
    print(json.dumps([fit_case(case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
