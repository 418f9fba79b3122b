# SPDX-License-Identifier: Apache-2.0
"""4-bit weights against bfloat16 on the CPU device: the product every projection of a 4-bit
checkpoint runs there (`models.linear.matmul`; the values held as int8, `models.int4`), per
output channel and with one scale per 128 inputs, on XLA's dot and on the native CPU int8 dense
kernel (per channel; grouped where the kernel takes 128-input groups), over a decode step's one
row to a prefill's hundreds.

    .venv/bin/python benchmarks/dense_int4.py [--rows 1,16,128] [--shape 2048x2048]
        [--out benchmarks/out/dense_int4.json]

Measured as `benchmarks/dense_fp8.py` measures (a jitted chain of distinct weights passing 64 MB
of bfloat16 weights, programs alternating call by call, process CPU time): per row count the
median over calls of bfloat16 time over each other format's (above 1: that format is faster).
Only the ratios mean anything on a shared machine.
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

from models import int4, int8
from pallas_kernels import cpu

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


def _held(weights: list[np.ndarray], group: int | None) -> tuple[list, list]:
    """4-bit values (as int8: the CPU's `int4.held_dtype`) and scales of each weight."""
    pairs = [int4.quantize(w, group) for w in weights]
    return [q.astype(np.int8) for q, _ in pairs], [s for _, s in pairs]


def _formats(floats: list[np.ndarray]) -> dict[str, tuple]:
    copies = len(floats)
    formats = {
        "bfloat16": ([w.astype(jnp.bfloat16) for w in floats], [np.zeros(1, np.float32)] * copies, _bf16),
        "int4-xla": (*_held(floats, None), int8.int8_dot),
        "int4-g128-xla": (*_held(floats, 128), int8.int8_dot),
    }
    q, s = _held(floats, None)
    if cpu.can_pack_int8(q[0].shape, q[0].dtype):
        formats["int4-native"] = ([cpu.pack_dense_kernel_int8(k) for k in q], s, cpu.native_dense_int8)
        if cpu.dense_int8_takes_groups(128):
            q, s = _held(floats, 128)
            formats["int4-g128-native"] = (
                [cpu.pack_dense_kernel_int8(k) for k in q],
                s,
                cpu.native_dense_int8,
            )
    return formats


def _cpu_seconds(program, *args) -> float:
    start = time.process_time()
    program(*args).block_until_ready()
    return time.process_time() - start


def measure(depth: int, width: int, rows: list[int], calls: int = 7) -> list[dict]:
    rng = np.random.default_rng(0)
    copies = max(2, int(STREAMED_BYTES // (depth * width * 2)))
    floats = [rng.standard_normal((depth, width)).astype(np.float32) for _ in range(copies)]
    placed = {
        name: ([jax.device_put(w) for w in ws], [jax.device_put(s) for s in ss], _chain(product))
        for name, (ws, ss, product) in _formats(floats).items()
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
    parser.add_argument("--out", default=str(HERE / "out" / "dense_int4.json"))
    args = parser.parse_args()
    depth, width = (int(v) for v in args.shape.split("x"))
    cache = os.environ.get("VLLM_XLA_CACHE_DIR", str(HERE.parent / ".cache" / "vllm-xla"))
    cpu.load(os.path.join(cache, "native"))  # the native int8 dense kernel
    results = measure(depth, width, [int(r) for r in args.rows.split(",")])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": [depth, width], "results": results}, indent=1))


if __name__ == "__main__":
    main()
