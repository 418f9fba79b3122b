# SPDX-License-Identifier: Apache-2.0
"""Compile worker: sizes the KV cache of real-size models on one chip of a target with the real
compiler and prints one JSON line: each case's fit and compiled programs.

    python -m tests.aot.model_step_worker MODE TARGET:MODEL[:int8] [TARGET:MODEL[:int8] ...]

MODE `full`: every layer compiled (`tpu_platform.planner.kv.fit_kv_cache`: the runner's prefill and
decode programs and its sampler). MODE `depth`: the model's first 2 and 4 layers compiled and the
memory extrapolated (`tpu_platform.planner.depth.fit_by_depth`); `depth+full` also compiles the
prefill and decode steps of every layer with the cache the extrapolation sized, to check it, and
`depth+full-decode` only the decode step's (on TPU the whole prefill takes several times as long).
`depth-one-prefill` (and `depth-one-prefill+full-decode`) compiles the prefill at the shallower
depth only, its memory bounded from above (`fit_by_depth(one_prefill=True)`): on TPU a 2k-token
prefill compiles for minutes at any depth.
A case ending in `:int8` plans the model with int8 weights (`StepSetup(quantization="int8")`).
Weights are abstract: nothing is allocated.

Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import json
import sys
import time

from tpu_platform.planner.depth import fit_by_depth
from tpu_platform.planner.kv import fit_kv_cache
from tpu_platform.planner.plan import StepSetup, compile_forward, model_config

DECODE_TOKENS = 64  # a decode batch of 64 sequences, one token each
PREFILL_TOKENS = 2048  # one 2k-token prefill chunk
MAX_MODEL_LEN = 2048
# Per mode, the steps compiled with every layer beside the short programs.
WHOLE_STEPS = {
    "depth": (), "depth+full": ("decode", "prefill"), "depth+full-decode": ("decode",),
    "depth-one-prefill": (), "depth-one-prefill+full-decode": ("decode",),
}  # fmt: skip
MODES = ("full", *WHOLE_STEPS)
STEP_TOKENS = {"decode": DECODE_TOKENS, "prefill": PREFILL_TOKENS}


def setup_for(case: str, tp_size: int = 1) -> StepSetup:
    target_name, model, *quantization = case.split(":")
    return StepSetup(
        model_config(model), target_name, max_num_seqs=DECODE_TOKENS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=PREFILL_TOKENS, quantization=quantization[0] if quantization else "none",
        tp_size=tp_size,
    )  # fmt: skip


def fit_case(mode: str, case: str) -> dict:
    setup = setup_for(case)
    start = time.perf_counter()
    if mode == "full":
        fit = fit_kv_cache(setup, DECODE_TOKENS, PREFILL_TOKENS)
    else:
        one_prefill = mode.startswith("depth-one-prefill")
        fit = fit_by_depth(setup, DECODE_TOKENS, PREFILL_TOKENS, one_prefill=one_prefill)
    row = {
        "case": case, "mode": mode, "hbm_bytes": setup.compile_target.hbm_bytes, "backend": setup.backend,
        "num_layers": setup.config.num_layers, **fit.as_dict(),
    }  # fmt: skip
    for step in WHOLE_STEPS.get(mode, ()) if fit.fits else ():  # the extrapolated cache, every layer
        row[f"full_{step}"] = compile_forward(setup, fit.num_pages, STEP_TOKENS[step]).as_dict()
    row["seconds"] = time.perf_counter() - start
    return row


def main(argv: list[str]) -> None:
    mode, *cases = argv
    if mode not in MODES:
        raise SystemExit(f"MODE must be one of {MODES}, not {mode!r}")
    print(json.dumps([fit_case(mode, case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
