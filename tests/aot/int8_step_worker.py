# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the runner's decode step (64 sequences, one token each) or a prefill step
(one sequence's 512-token chunk) with bfloat16 and with int8 weights (the served layout: fused
projections, `Preparation(quantization="int8")`, as the planner's `StepSetup(quantization=...)`
builds it; `int8-g32`: scales per group of 32 inputs, a GGUF's Q8_0 layout; `fp8` and
`fp8-g128`: fp8 weights per channel or per 128 inputs; `int4`, `int4-g128`: a 4-bit checkpoint's
int4 weights, two a byte) for one chip of a compile-only target,
weights abstract. Prints one JSON line: per case, the weights' bytes, the
compiled program's memory analysis and the optimized-HLO buffers at least as large as the
largest int8 or fp8 kernel, or as large as the largest int4 kernel's values at a byte each (a
bfloat16 or int8 copy of a weight would show there).

    python -m tests.aot.int8_step_worker NUM_LAYERS \
        TARGET:MODEL:{bfloat16,int8,int8-g32,fp8,fp8-g128,int4,int4-g128}[:prefill] ...

NUM_LAYERS > 0 compiles the model's first layers at full width (`plan.first_layers`: a bfloat16
copy of a weight would be made in each layer); the weights' bytes are reported for the whole
model (`weight_bytes`) and for the compiled one (`compiled_weight_bytes`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from models import fp8, int4
from tests.aot.step_compile import large_buffers
from tpu_platform.planner.compiled import program_facts
from tpu_platform.planner.plan import (
    StepSetup,
    first_layers,
    model_config,
    step_program,
    step_shape,
)

DECODE_TOKENS = 64
PREFILL_TOKENS = 512
NUM_PAGES = 256


def _bytes(leaves) -> int:  # int4: two values a byte, as TPU and GPU hold them
    return int(
        sum(
            -(-leaf.size // 2) if int4.is_int4(leaf.dtype) else leaf.size * leaf.dtype.itemsize
            for leaf in leaves
        )
    )


def compile_case(case: str, num_layers: int) -> dict:
    target_name, model, variant, *phase = case.split(":")
    whole = StepSetup(
        model_config(model), target_name, max_num_seqs=DECODE_TOKENS, max_model_len=2048,
        quantization="none" if variant == "bfloat16" else variant,
    )  # fmt: skip
    setup = dataclasses.replace(whole, config=first_layers(whole.config, num_layers))
    tokens, seqs = (PREFILL_TOKENS, 1) if phase == ["prefill"] else (DECODE_TOKENS, DECODE_TOKENS)
    program = step_program(setup, NUM_PAGES)
    start = time.perf_counter()
    compiled = program.compile(step_shape(setup, tokens, seqs))
    facts = program_facts(compiled, time.perf_counter() - start)
    leaves = setup.abstract_model().leaves
    int8_kernels = [leaf for leaf in leaves if leaf.dtype == np.int8]
    fp8_kernels = [leaf for leaf in leaves if fp8.is_fp8(leaf.dtype)]
    int4_kernels = [leaf for leaf in leaves if int4.is_int4(leaf.dtype)]
    largest = max((leaf.size for leaf in int8_kernels + fp8_kernels + int4_kernels), default=0)
    return {
        "case": case,
        "tokens": setup.buckets.shape_for(tokens, seqs)[0],
        "num_layers": setup.config.num_layers,
        "weight_bytes": _bytes(whole.abstract_model().leaves),
        "compiled_weight_bytes": _bytes(leaves),
        "int8_leaves": len(int8_kernels),
        "fp8_leaves": len(fp8_kernels),
        "int4_leaves": len(int4_kernels),
        "large_buffers": large_buffers(compiled.as_text(), largest) if largest else [],
        **facts.as_dict(),
    }


def main(argv: list[str]) -> None:
    num_layers, *cases = argv
    print(json.dumps([compile_case(case, int(num_layers)) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
