# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the runner's forward for a compile-only target and reports what it holds.

`python -m tests.aot.step_compile TARGET BACKEND MODEL TOKENS:CACHE_MIB ...` (run by
`toolchains.run_worker`) prints one JSON line, a list with per bucket and cache size (MiB, all
layers' caches stacked in one array) the compiled program's memory analysis, XLA's
bytes accessed, the compile time, the cache arrays' bytes, and every optimized-HLO instruction
that makes a new array at least as large as the smallest cache array (a copy, convert, transpose
or fusion output of a cache-sized buffer: `large_buffers`), with its opcode and shape.

MODEL is `small` (a 2-layer Llama) or `llama8b` (Llama-3.1-8B's shape), with `+per_layer` for
one cache array per layer instead of all layers' in one.
Weights are abstract (`nnx.eval_shape`): nothing is allocated, only compiled.
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

import pallas_kernels.backend
from models import ModelConfig, build
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches
from tpu_platform.step import make_forward
from tpu_platform.targets import compile_only_devices, target

MIB = 1 << 20
MODELS = {
    "small": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
    ),
    "llama8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    ),
}  # fmt: skip
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
    model, _, arrays = model.partition("+")  # "small+per_layer": one cache array per layer
    config = MODELS[model]
    platform = target(target_name).platform
    device = compile_only_devices(target_name)[0]
    # Backend selection checks the device kind; here the device is the compile target.
    pallas_kernels.backend.default_platform = lambda: platform
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(config, jnp.bfloat16)))
    leaves, state_def = jax.tree.flatten(state)
    shape = (PAGE_SIZE, config.num_kv_heads, config.head_dim, "bfloat16", backend)
    page = jax.eval_shape(lambda: allocate_stacked_caches(1, 1, *shape))[0]
    num_pages = cache_mib * MIB // (page.size * page.dtype.itemsize * config.num_layers)
    if arrays == "per_layer":
        caches = jax.eval_shape(lambda: allocate_stacked_caches(1, num_pages, *shape) * config.num_layers)
    else:
        caches = jax.eval_shape(lambda: allocate_stacked_caches(config.num_layers, num_pages, *shape))
    num_seqs = min(num_tokens, MAX_SEQS)
    packed, dims = pack_inputs(padding_inputs(num_tokens, num_seqs, PAGES_PER_SEQ))
    fed_tokens = np.zeros(MAX_SEQS, np.int32)
    sharding = SingleDeviceSharding(device)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        (leaves, caches, packed, fed_tokens),
    )
    stacked_pages = 0 if arrays == "per_layer" else num_pages
    forward = make_forward(graphdef, state_def, backend, kv_dtype="bfloat16", cache_pages=stacked_pages)
    start = time.perf_counter()
    compiled = forward.trace(*abstract, dims=dims).lower().compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    cache_bytes = [int(np.prod(c.shape)) * c.dtype.itemsize for c in caches]
    text = compiled.as_text()
    return {
        "target": target_name,
        "backend": backend,
        "model": model + ("+" + arrays if arrays else ""),
        "num_tokens": num_tokens,
        "cache_arrays": len(caches),
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
