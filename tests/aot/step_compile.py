# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the runner's step program for a compile-only target and reports what it holds.

`python -m tests.aot.step_compile TARGET BACKEND MODEL TOKENS:CACHE_MIB ...` (run by
`toolchains.run_worker`) prints one JSON line, a list with per bucket and cache size (MiB, all
layers' caches stacked as the runner stacks them) the compiled program's memory analysis, XLA's
bytes accessed, the compile time, the cache arrays' bytes, and every optimized-HLO instruction
that makes a new array at least as large as the smallest cache array (a copy, convert, transpose
or fusion output of a cache-sized buffer: `large_buffers`), with its opcode and shape.

MODEL is `small` (a 2-layer Llama) or a known model of the planner (`plan.known_models`). The
program is the planner's `step_program`, which is the runner's own builder; weights are abstract:
nothing is allocated, only compiled.
"""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np

from models import ModelConfig
from tpu_platform.planner.plan import StepSetup, kv_page_bytes, model_config, step_program, step_shape

MIB = 1 << 20
SMALL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
)  # fmt: skip
PAGE_SIZE = 16
MAX_SEQS = 8
PAGES_PER_SEQ = 32
# An optimized-HLO instruction: `name = <shape> opcode(`; a tuple result lists its shapes in parens.
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f8e4m3fn": 8, "f8e5m2": 8}
# Instructions that make no new buffer of their result: views, tuples, control flow over its
# operands' buffers, and in-place updates (a fusion whose root updates its operand in place).
_VIEWS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call"}
_IN_PLACE_ROOTS = {"scatter", "dynamic-update-slice"}


def _array_bytes(dtype: str, dims: str) -> int:
    bits = _BITS.get(dtype) or int(dtype[1:])
    return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8


def _parse(hlo_text: str) -> tuple[list[tuple[str, str, str]], dict[str, str], set[str]]:
    """(computation, opcode, line) of every instruction, each computation's root opcode, and the
    computations fusions call (their bodies are not buffers of their own)."""
    instructions, roots, fused = [], {}, set()
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("(")[0]:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        opcode = match.group(3)
        instructions.append((computation, opcode, line))
        if match.group(1):
            roots[computation] = opcode
        if opcode == "fusion":
            fused.update(_CALLS.findall(line))
    return instructions, roots, fused


def large_buffers(hlo_text: str, min_bytes: int) -> list[str]:
    """`opcode dtype[dims]` of each instruction of `hlo_text` (optimized HLO) that produces a new
    array of at least `min_bytes`: copies, converts, transposes, fusion outputs... Views,
    in-place update fusions and custom calls aliasing their output to an operand make none."""
    instructions, roots, fused = _parse(hlo_text)
    found = []
    for computation, opcode, line in instructions:
        if computation in fused or opcode in _VIEWS:
            continue
        if opcode == "custom-call" and "output_to_operand_aliasing" in line:
            continue
        if opcode == "fusion" and any(roots.get(c) in _IN_PLACE_ROOTS for c in _CALLS.findall(line)):
            continue
        shape = _INSTRUCTION.match(line).group(2)
        for dtype, dims in _ARRAY.findall(shape):
            if _array_bytes(dtype, dims) >= min_bytes:
                found.append(f"{opcode} {dtype}[{dims}]")
    return found


def compile_step(target_name: str, backend: str, num_tokens: int, cache_mib: int, model: str) -> dict:
    config = SMALL if model == "small" else model_config(model)
    setup = StepSetup(
        config, target_name, max_num_seqs=MAX_SEQS, max_model_len=PAGES_PER_SEQ * PAGE_SIZE,
        max_num_batched_tokens=max(num_tokens, MAX_SEQS), page_size=PAGE_SIZE,
    )  # fmt: skip
    if setup.backend != backend:
        raise ValueError(f"{target_name} serves with {setup.backend}, not {backend}")
    num_pages = cache_mib * MIB // kv_page_bytes(setup)
    program = step_program(setup, num_pages)
    start = time.perf_counter()
    compiled = program.compile(step_shape(setup, num_tokens, min(num_tokens, MAX_SEQS)))
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    cache_bytes = [int(np.prod(c.shape)) * c.dtype.itemsize for c in program.caches]
    text = compiled.as_text()
    return {
        "target": target_name,
        "backend": backend,
        "model": model,
        "num_tokens": num_tokens,
        "cache_arrays": len(program.caches),
        "cache_bytes": sum(cache_bytes),
        "min_cache_array_bytes": min(cache_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "bytes_accessed": float(cost.get("bytes accessed", -1.0)),
        "compile_seconds": round(seconds, 2),
        "large_buffers": large_buffers(text, min(cache_bytes)),
        "copies": sum(1 for line in text.splitlines() if re.search(r"\scopy(-start)?\(", line)),
    }


def main(argv: list[str]) -> None:
    """`TARGET BACKEND MODEL TOKENS:CACHE_MIB ...`: one compile per bucket and cache size."""
    target_name, backend, model, *specs = argv
    results = []
    for spec in specs:
        num_tokens, cache_mib = (int(x) for x in spec.split(":"))
        results.append(compile_step(target_name, backend, num_tokens, cache_mib, model))
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
