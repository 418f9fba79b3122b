# SPDX-License-Identifier: Apache-2.0
"""Whether the weights of identical layers can be passed as one `[L, ...]` array per kind (fewer
arguments to the step program) without copying a layer's weights out of it at each step.

    .venv/bin/python benchmarks/stacked_weights.py [--dense xla|native] [--layers 30] [--rows 64]
    PYTHONPATH=.aot/tpu:. .venv/bin/python benchmarks/stacked_weights.py --target v6e-1

A chain of `--layers` decoder-layer-shaped blocks at the embedded SmolLM2-135M's sizes (RMS norm,
the fused QKV projection, the output projection, the fused gate/up projection, SwiGLU, the down
projection; no attention) is compiled three ways:
- `per layer`: every weight its own argument, as the runner passes them today;
- `static slices`: one `[L, ...]` argument per kind of weight, layer i reading `stacked[i]`;
- `scan`: the same stacked arguments, the layers a `lax.scan` (one layer's program in a loop);
- `stack + index` (`--dense native` only): the same stacked arguments, each layer's native dense
  calls given the whole stack and the layer's index (`layer=`: the kernel reads layer i in
  place), the small norm weights sliced by XLA.

For each: the program's argument count, compile seconds, temp bytes, and the weight-sized arrays
its optimized HLO materializes (a slice, dynamic slice or copy of weight size outside a fusion, or
a fusion of weight-sized output that multiplies nothing: a weight copied out of the stack; a
TPU's staging of weights into its on-chip memory, as it prefetches separate weights too, is
not counted). On the local CPU also the run time of a step of `--rows` rows and the calling
thread's CPU time of the call (`dispatch.FlatCall`, as the runner calls its forward), with
XLA's dots (`--dense xla`) or the native dense kernel (`--dense native`, bfloat16 where the CPU
runs it, else float32: `--native-dtype`). With
`--target` the program is compiled for that compile-only target (bfloat16, abstract weights);
the target's compiler must be importable (`make aot-toolchains`, then its `.aot/` folder on
PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

HIDDEN, INTERMEDIATE, KV_WIDTH = 576, 1536, 192  # SmolLM2-135M: 9 heads of 64, 3 KV heads
KERNELS = {
    "qkv": (HIDDEN, HIDDEN + 2 * KV_WIDTH),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}
MATMULS = ("dot", "convolution", "custom-call")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"=\s+(\w+)\[([\d,]*)\](\{[^}]*\})?\s+([\w\-]+)\((.*)$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--dense", choices=("xla", "native"), default="xla", help="local CPU only")
    parser.add_argument("--target", help="a compile-only target (tpu_platform.planner.targets)")
    parser.add_argument("--reps", type=int, default=200, help="timed calls (local CPU)")
    parser.add_argument("--native-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return parser.parse_args(argv)


def materialized_weights(hlo_text: str, min_elements: int) -> int:
    """How many arrays of at least `min_elements` the optimized HLO makes by slicing or copying
    (module docstring): slices and copies outside fusions, and fusions that multiply nothing.
    A loop's body is not a fusion: a layer copied out of the stack at each iteration counts once."""
    bodies: dict[str, list[tuple[str, int, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = bodies.setdefault(head.group(1), [])
            continue
        found = _INSTRUCTION.search(line)
        if found and current is not None:
            _, dims, layout, opcode, rest = found.groups()
            elements = 1
            for d in filter(None, dims.split(",")):
                elements *= int(d)
            on_chip = bool(layout) and "S(1)" in layout
            current.append((opcode, 0 if on_chip else elements, rest, line))
    called = set(_calls(hlo_text))  # fused computations (of any fusion, multi-output ones too)
    count = 0
    for name, ops in bodies.items():
        if name in called:
            continue
        for opcode, elements, rest, _ in ops:
            if elements < min_elements:
                continue
            if opcode in ("copy", "slice", "dynamic-slice"):
                count += 1
            elif opcode == "fusion":
                fused = [op[0] for callee in _calls(rest) for op in bodies.get(callee, ())]
                count += not any(op in MATMULS for op in fused)
    return count


def _calls(rest: str) -> list[str]:
    return re.findall(r"calls=%?([\w.\-]+)", rest)


def _programs(layers: int, dense):
    import jax
    import jax.numpy as jnp

    def layer(x, w):
        h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5)
        qkv = dense((h * w["norm"]).astype(x.dtype), w["qkv"])
        x = x + dense(qkv[:, :HIDDEN], w["o"]).astype(x.dtype)
        gate_up = dense(x, w["gate_up"])
        mixed = jax.nn.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]
        return x + dense(mixed.astype(x.dtype), w["down"]).astype(x.dtype)

    def per_layer(x, weights):
        for w in weights:
            x = layer(x, w)
        return (x,)

    def static_slices(x, stacked):
        for i in range(layers):
            x = layer(x, {kind: array[i] for kind, array in stacked.items()})
        return (x,)

    def scan(x, stacked):
        return (jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0],)

    programs = {"per layer": per_layer, "static slices": static_slices, "scan": scan}
    if getattr(dense, "takes_layer", False):

        def stack_and_index(x, stacked):
            for i in range(layers):
                kernels = {k: _Layer(a, i) for k, a in stacked.items() if k != "norm"}
                x = layer(x, kernels | {"norm": stacked["norm"][i]})
            return (x,)

        programs["stack + index"] = stack_and_index
    return programs


class _Layer:
    """Layer `index` of a stack of packed kernels, as the native dense call takes it."""

    def __init__(self, stack, index: int):
        self.stack, self.index = stack, index


def _weights(args: argparse.Namespace):
    """(x, per-layer weights, stacked weights, the dense op, elements of the smallest weight)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    if args.target:
        from jax.sharding import SingleDeviceSharding

        from tpu_platform.planner.targets import compile_only_devices

        place = SingleDeviceSharding(compile_only_devices(args.target)[0])
        spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=place)  # noqa: E731
        layer = {kind: spec(shape) for kind, shape in KERNELS.items()} | {"norm": spec((HIDDEN,))}
        per = [layer] * args.layers
        stacked = {kind: spec((args.layers, *s.shape)) for kind, s in layer.items()}
        return spec((args.rows, HIDDEN)), per, stacked, jnp.matmul, HIDDEN * HIDDEN
    dense, pack, dtype = jnp.matmul, jnp.asarray, jnp.float32
    if args.dense == "native":
        dense, pack, dtype = _native_dense(args.native_dtype)

    def one_layer():
        kernels = {k: pack(0.02 * rng.standard_normal(s, np.float32)) for k, s in KERNELS.items()}
        return kernels | {"norm": jnp.ones(HIDDEN, dtype)}

    per = [one_layer() for _ in range(args.layers)]
    stacked = {kind: jnp.stack([w[kind] for w in per]) for kind in per[0]}
    return jnp.ones((args.rows, HIDDEN), dtype), per, stacked, dense, HIDDEN * HIDDEN


def _native_dense(dtype: str):
    """(dense op, packing, activations' dtype) of the native kernel: a `_Layer` operand is read
    from its stack in place."""
    import jax.numpy as jnp

    from pallas_kernels import cpu
    from tpu_platform.attention_backend import native_build_dir

    library = cpu.load(native_build_dir(None))
    half = dtype == "bfloat16" and bool(cpu.dense_isas(library))
    pack = cpu.pack_dense_kernel if half else cpu.pack_dense_kernel_f32
    width = jnp.bfloat16 if half else jnp.float32

    def dense(x, kernel):
        if isinstance(kernel, _Layer):
            return cpu.native_dense(x, kernel.stack, layer=kernel.index)
        return cpu.native_dense(x, kernel)

    dense.takes_layer = True
    return dense, lambda k: jnp.asarray(pack(jnp.asarray(k, width))), width


def _timed(compiled, leaves: list, reps: int) -> tuple[float, float]:
    """(median run ms of a step, mean calling-thread CPU us of the call alone)."""
    import statistics

    from tpu_platform.dispatch import FlatCall

    call = FlatCall.of(compiled, len(leaves))
    for _ in range(3):
        call(leaves)[0].block_until_ready()
    runs, spent = [], 0.0
    for _ in range(reps):
        start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = call(leaves)
        spent += time.thread_time() - cpu_start
        outputs[0].block_until_ready()
        runs.append(time.perf_counter() - start)
    return 1e3 * statistics.median(runs), 1e6 * spent / reps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    x, per, stacked, dense, weight_elements = _weights(args)
    where = args.target or f"local CPU, {args.dense} dense"
    print(f"{args.layers} layers, {args.rows} rows, {where}")
    results = {}
    for name, function in _programs(args.layers, dense).items():
        weights = per if name == "per layer" else stacked
        start = time.perf_counter()
        compiled = jax.jit(function).trace(x, weights).lower().compile()
        row = {
            "arguments": 1 + len(jax.tree.leaves(weights)),
            "compile_s": round(time.perf_counter() - start, 2),
            "temp_bytes": getattr(compiled.memory_analysis(), "temp_size_in_bytes", None),
            "weight_copies": materialized_weights(compiled.as_text(), weight_elements),
        }
        if not args.target:
            run_ms, call_us = _timed(compiled, [x, *jax.tree.leaves(weights)], args.reps)
            row |= {"run_ms": round(run_ms, 2), "call_cpu_us": round(call_us, 1)}
        results[name] = row
        print(f"  {name:14s} " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
