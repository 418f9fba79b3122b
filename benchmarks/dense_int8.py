# SPDX-License-Identifier: Apache-2.0
"""The native int8 dense kernel against the native bfloat16 one at the embedded SmolLM2-135M's
projection shapes, over row counts from a decode step's one row to a prefill's hundreds.

    .venv/bin/python benchmarks/dense_int8.py [--rows 1,2,4,8,16,32,64,128,512]
        [--shapes 576x960,576x576,576x3072,1536x576,576x49152] [--isa avx512_vnni,avx512_bf16]
        [--out benchmarks/out/dense_int8.json]

Each measurement is one jitted program that applies distinct weights of one shape in a chain
(each product's first value feeds the next input, so XLA runs them one after another), enough
of them to pass 64 MB of bfloat16 weights: a model step streams its weights from memory, not
from cache, and so does this. The bfloat16 and int8 programs alternate call by call, and each
call is timed in process CPU time (all threads): on a shared machine another process's time
slices then fall outside the figures, which wall time would count. Reported per shape and row
count: the fastest call of each (per product) and the median over calls of bfloat16 time over
int8 time (above 1: int8 is faster), for each int8 path asked for (`--isa`, a comma list; by
default the best this CPU has).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from _dense_timing import cpu_seconds

from pallas_kernels import cpu

HERE = pathlib.Path(__file__).resolve().parent
STREAMED_BYTES = 64e6  # bfloat16 weights a program applies: past the last-level cache


def _chain(product):
    def run(x, weights, *per_weight):
        for i, w in enumerate(weights):
            y = product(x, w, *(p[i] for p in per_weight))
            x = x + (y[0, 0] * 0).astype(x.dtype)  # a dependency: the products run in order
        return x

    return jax.jit(run)


def measure(depth: int, width: int, rows: list[int], isas: list[str], rng: np.random.Generator) -> list[dict]:
    copies = max(2, int(STREAMED_BYTES // (depth * width * 2)))
    bf16 = [
        cpu.pack_dense_kernel(rng.standard_normal((depth, width)).astype(jnp.bfloat16)) for _ in range(copies)
    ]
    int8 = [
        cpu.pack_dense_kernel_int8(rng.integers(-127, 128, (depth, width), dtype=np.int8))
        for _ in range(copies)
    ]
    scales = [jnp.asarray(rng.random(width, dtype=np.float32) * 0.02) for _ in range(copies)]
    bf16, int8 = [jnp.asarray(w) for w in bf16], [jnp.asarray(w) for w in int8]
    run_bf16 = _chain(lambda x, w: cpu.native_dense(x, w))
    runs_int8 = [_chain(lambda x, w, s, isa=isa: cpu.native_dense_int8(x, w, s, isa=isa)) for isa in isas]
    results = []
    for count in rows:
        x = jnp.asarray(rng.standard_normal((count, depth)), jnp.bfloat16)
        cpu_seconds(run_bf16, x, bf16)  # compile, warm up
        for run in runs_int8:
            cpu_seconds(run, x, int8, scales)
        calls = max(7, min(40, int(1.5 / max(cpu_seconds(run_bf16, x, bf16), 1e-6))))
        times = np.array(
            [
                [cpu_seconds(run_bf16, x, bf16), *(cpu_seconds(run, x, int8, scales) for run in runs_int8)]
                for _ in range(calls)
            ]
        )
        times /= copies
        result = {
            "shape": f"{depth}x{width}",
            "rows": count,
            "bfloat16_us": round(float(times[:, 0].min()) * 1e6, 1),
        }
        line = f"{result['shape']:>10} rows {count:4d}: bfloat16 {result['bfloat16_us']:9.1f} us"
        for i, isa in enumerate(isas, start=1):
            result[f"int8_{isa}_us"] = round(float(times[:, i].min()) * 1e6, 1)
            result[f"bfloat16_over_int8_{isa}"] = round(float(np.median(times[:, 0] / times[:, i])), 3)
            line += f", {isa} {result[f'int8_{isa}_us']:9.1f} us ({result[f'bfloat16_over_int8_{isa}']:.2f}x)"
        print(line, flush=True)
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,512", help="comma list of row counts")
    parser.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576,576x49152", help="KxN list")
    parser.add_argument(
        "--isa", default=None, help="int8 paths, a comma list (default: the best this CPU has)"
    )
    parser.add_argument("--out", default=str(HERE / "out" / "dense_int8.json"), help="JSON path")
    args = parser.parse_args()
    cache = os.environ.get("VLLM_XLA_CACHE_DIR", str(HERE.parent / ".cache" / "vllm-xla"))
    library = cpu.load(os.path.join(cache, "native"))
    rows = [int(r) for r in args.rows.split(",")]
    isas = args.isa.split(",") if args.isa else [cpu.dense_int8_isas(library)[0]]
    rng = np.random.default_rng(0)
    results = []
    for shape in args.shapes.split(","):
        depth, width = (int(v) for v in shape.split("x"))
        results += measure(depth, width, rows, isas, rng)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    out.write_text(json.dumps({"isas": isas, "load_average_1min": load, "results": results}, indent=1) + "\n")
    print(f"wrote {out} (int8 paths {', '.join(isas)}, 1-minute load average {load:.1f})")


if __name__ == "__main__":
    main()
