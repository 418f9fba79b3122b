# SPDX-License-Identifier: Apache-2.0
"""XLA's dot on fp8 weights against bfloat16 and int8 weights, on the CPU device: the product
every projection runs (`models.linear.matmul`), per output channel and with fp8's 128-input
block scales, over a decode step's one row to a prefill's hundreds.

    .venv/bin/python benchmarks/dense_fp8.py [--rows 1,16,128] [--shape 2048x2048]
        [--out benchmarks/out/dense_fp8.json]

Each measurement is one jitted program applying distinct weights of one shape in a chain (each
product's first value feeds the next input), enough of them to pass 64 MB of bfloat16 weights,
so the weights stream from memory as a model step's do. The programs alternate call by call,
each call timed in process CPU time (all threads). Reported per row count: the median over
calls of bfloat16 time over each other format's (above 1: that format is faster). Only the
ratios mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8, int8

HERE = pathlib.Path(__file__).resolve().parent
STREAMED_BYTES = 64e6


def _chain(product):
    def run(x, weights, scales):
        for w, s in zip(weights, scales, strict=True):
            y = product(x, w, s)
            x = x + (y[0, 0] * 0).astype(x.dtype)  # a dependency: the products run in order
        return x

    return jax.jit(run)


def _bf16(x, w, _):
    return jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32)


def _scaled(x, q, s):
    return int8.int8_dot(x, q, s)


def _cpu_seconds(program, *args) -> float:
    start = time.process_time()
    program(*args).block_until_ready()
    return time.process_time() - start


def measure(depth: int, width: int, rows: list[int], calls: int = 7) -> list[dict]:
    rng = np.random.default_rng(0)
    copies = max(2, int(STREAMED_BYTES // (depth * width * 2)))
    floats = [rng.standard_normal((depth, width)).astype(np.float32) for _ in range(copies)]
    formats = {
        "bfloat16": ([w.astype(jnp.bfloat16) for w in floats], [np.zeros(1, np.float32)] * copies, _bf16),
        "int8": (*zip(*(int8.quantize(w) for w in floats), strict=True), _scaled),
        "fp8": (*zip(*(fp8.quantize(w) for w in floats), strict=True), _scaled),
        "fp8-g128": (*zip(*(fp8.quantize(w, 128) for w in floats), strict=True), _scaled),
    }
    placed = {
        name: ([jax.device_put(w) for w in ws], [jax.device_put(s) for s in ss], _chain(product))
        for name, (ws, ss, product) in formats.items()
    }
    results = []
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, depth)), jnp.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in placed}
        for ws, ss, program in placed.values():
            program(x, ws, ss).block_until_ready()  # compile
        for _ in range(calls):
            for name, (ws, ss, program) in placed.items():
                times[name].append(_cpu_seconds(program, x, ws, ss) / copies)
        row = {"rows": t, "fastest_ms": {n: min(v) * 1e3 for n, v in times.items()}}
        row["bf16_over"] = {
            n: statistics.median(b / o for b, o in zip(times["bfloat16"], v, strict=True))
            for n, v in times.items()
            if n != "bfloat16"
        }
        results.append(row)
        print(json.dumps(row))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,128")
    parser.add_argument("--shape", default="2048x2048")
    parser.add_argument("--out", default=str(HERE / "out" / "dense_fp8.json"))
    args = parser.parse_args()
    depth, width = (int(v) for v in args.shape.split("x"))
    results = measure(depth, width, [int(r) for r in args.rows.split(",")])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": [depth, width], "results": results}, indent=1))


if __name__ == "__main__":
    main()
