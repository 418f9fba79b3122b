# SPDX-License-Identifier: Apache-2.0
"""Our CPU dense kernels at a batch step's row counts against what vLLM's CPU backend runs there
(its own dispatch of a bfloat16 layer: oneDNN's matmul on a weight it packed), at the embedded
SmolLM2-135M's projection shapes, in one run.

    .venv/bin/python benchmarks/dense_batch.py [--rows 16,64,128,256,512]
        [--shapes 576x960,576x576,576x3072,1536x576,576x49152] [--calls 3]
        [--torch-threads 2] [--out benchmarks/out/dense_batch.json]

Formats: bfloat16 on the native bfloat16 kernel, int8 (a scale per channel) on the native int8
kernel, and 4-bit as the embedded model is served from its GGUF Q4_1 blocks (a float16 scale and
base per 32 inputs) on the native int4 kernel; vLLM's bfloat16 product beside them. Each
measurement applies distinct weights of one shape in a chain, enough of them to pass 64 MB of
bfloat16 weights (a model step streams its weights from memory, not from cache), and the
formats alternate call by call. Reported per shape and row count: GFLOP/s of each format's
fastest call in wall time (every format runs on all cores: ours on XLA's pool, torch on its OpenMP
threads) and per second of process CPU time (a core's efficiency, which other processes' time
slices do not stretch; OpenMP's spinning threads count in torch's), and the median over calls of
torch's wall time over each of ours (above 1: ours is faster). On a loaded machine OpenMP's
threads wait on each other at every barrier for a peer that lost its core, and torch's figures
collapse (measured at load 30 on two cores: 2-25 GFLOP/s on two threads, 45-66 on one); there
`--torch-threads 1` and the per-CPU-second figures compare a core's work with a core's.
Only the ratios mean much on a shared machine: the load (`/proc/loadavg`) is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _dense_timing import chain

from models import int8
from pallas_kernels import cpu

HERE = pathlib.Path(__file__).resolve().parent
STREAMED_BYTES = 64e6  # bfloat16 weights a chain applies: past the last-level cache
SHAPES = "576x960,576x576,576x3072,1536x576,576x49152"  # fused qkv, o, gate_up, down, head


def _q4_1(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1's blocks of `w`: 4-bit values q in [-8, 7], float16 scales d and bases (the
    float16 block minimum, the weight of stored value 0), `w ~ (q + 8) d + base`."""
    k, n = w.shape
    blocks = w.reshape(k // group, group, n)
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    scale = np.where(high > low, (high - low) / 15, 1).astype(np.float16)
    low = low.astype(np.float16)
    u = np.clip(np.round((blocks - low[:, None]) / scale[:, None].astype(np.float32)), 0, 15)
    return (u - 8).astype(np.int8).reshape(k, n), scale, low


def _ours(floats: list[np.ndarray]) -> dict[str, tuple[list[tuple], object]]:
    bf16 = [(cpu.pack_dense_kernel(jnp.asarray(w, jnp.bfloat16)),) for w in floats]
    eight = [(cpu.pack_dense_kernel_int8(q), s) for q, s in (int8.quantize(w) for w in floats)]
    four = [(cpu.pack_dense_kernel_int4(q), s, b) for q, s, b in (_q4_1(w) for w in floats)]
    return {
        "bfloat16": (bf16, cpu.native_dense),
        "int8": (eight, cpu.native_dense_int8),
        "int4-q4_1": (four, lambda x, p, s, b: cpu.native_dense_int4(x, p, s, base=b)),
    }


def _placed(floats: list[np.ndarray]) -> dict[str, object]:
    """Each format's call `x (NumPy float32) -> (wall seconds, process CPU seconds)`, torch's included."""
    calls = {}
    for name, (weights, product) in _ours(floats).items():
        on_device = [tuple(jax.device_put(a) for a in arrays) for arrays in weights]
        program = chain(product)

        def timed(x, on_device=on_device, program=program):
            x = jnp.asarray(x, jnp.bfloat16)
            start, cpu_start = time.perf_counter(), time.process_time()
            program(x, on_device).block_until_ready()
            return time.perf_counter() - start, time.process_time() - cpu_start

        calls[name] = timed
    torch_weights = [torch.from_numpy(np.ascontiguousarray(w.T)).to(torch.bfloat16) for w in floats]
    linear = _vllm_linear(torch_weights)

    def torch_timed(x):
        x = torch.from_numpy(x).to(torch.bfloat16)
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for w in torch_weights:
                y = linear(x, w)
                x = x + y[0, 0] * 0
        return time.perf_counter() - start, time.process_time() - cpu_start

    calls["torch-bfloat16"] = torch_timed
    return calls


def _vllm_linear(weights: list) -> object:
    """`linear(x, w)` as vLLM's CPU backend runs its unquantized layers (its own dispatch:
    oneDNN's matmul on a weight it packed, or sgl-kernel's for small ones), or torch's
    `linear` where vLLM's CPU ops are not installed."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return torch.nn.functional.linear
    layers = {}
    for w in weights:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        layer.weight.data = w
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layers[id(w)] = layer
    return lambda x, w: layers[id(w)].cpu_linear(x, w, None)


def measure(depth: int, width: int, rows: list[int], calls: int) -> list[dict]:
    rng = np.random.default_rng(0)
    copies = max(2, int(STREAMED_BYTES // (depth * width * 2)))
    floats = [rng.standard_normal((depth, width)).astype(np.float32) for _ in range(copies)]
    placed = _placed(floats)
    results = []
    for t in rows:
        x = rng.standard_normal((t, depth)).astype(np.float32)
        for timed in placed.values():
            timed(x)  # compile, warm
        times: dict[str, list[float]] = {name: [] for name in placed}
        cpu_times: dict[str, list[float]] = {name: [] for name in placed}
        for _ in range(calls):
            for name, timed in placed.items():
                wall, cpu_seconds = timed(x)
                times[name].append(wall / copies)
                cpu_times[name].append(cpu_seconds / copies)
        flops = 2.0 * t * depth * width
        row = {
            "shape": f"{depth}x{width}",
            "rows": t,
            "gflops": {n: round(flops / min(v) / 1e9, 1) for n, v in times.items()},
            "gflops_per_cpu_second": {n: round(flops / min(v) / 1e9, 1) for n, v in cpu_times.items()},
            "torch_over": {
                n: round(statistics.median(b / o for b, o in zip(times["torch-bfloat16"], v, strict=True)), 3)
                for n, v in times.items()
                if n != "torch-bfloat16"
            },
            "loadavg": _loadavg(),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def _loadavg() -> str:
    try:
        return pathlib.Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,128,256,512")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(HERE / "out" / "dense_batch.json"))
    args = parser.parse_args()
    cache = os.environ.get("VLLM_XLA_CACHE_DIR", str(HERE.parent / ".cache" / "vllm-xla"))
    cpu.load(os.path.join(cache, "native"))  # the native dense kernels
    torch.set_num_threads(args.torch_threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        depth, width = (int(v) for v in shape.split("x"))
        results += measure(depth, width, rows, args.calls)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"cpus": os.cpu_count(), "torch_threads": args.torch_threads, "results": results}
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
