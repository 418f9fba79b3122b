# SPDX-License-Identifier: Apache-2.0
"""The native 4-bit and int8 dense kernels at a decode step's few rows (speculative verification's
1 + k, a small batch's 2-16), at the embedded model's shapes, as the embedded model holds them:
Q4_1 (float16 scales and bases per 32 inputs) on the int4 kernel, int8 with float16 scales per
channel and per 32 inputs (GGUF Q8_0, the tied head's) on the int8 kernel.

    .venv/bin/python benchmarks/dense_few_rows.py [--rows 1,2,4,5,8,12,16] [--calls 7]
        [--native DIR] [--out benchmarks/out/dense_few_rows.json]

Each figure is one jitted chain of distinct weights of one shape and format, enough of them to
stream past the last-level cache as a model step does (at most `MAX_COPIES`), timed in process
CPU time (all threads) per product; the row counts alternate call by call and the median of
`--calls` calls is kept. Reported per format and shape: microseconds at each row count and the
per-row ratio t(k) / (k t(1)) (1: k rows cost k single rows; the lower, the more the rows share
each decoded panel). `--native` names the kernels' build directory, so that two checkouts (each on
`PYTHONPATH` in turn, one process each) keep their own builds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _dense_timing import chain, cpu_seconds

from pallas_kernels import cpu

HERE = pathlib.Path(__file__).resolve().parent
STREAMED_BYTES = 48e6  # the format's bytes a chain applies: past a 32 MiB last-level cache
MAX_COPIES = 128
SHAPES = {
    "qkv": (576, 1728),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "o": (576, 576),
    "head": (576, 49152),
}
FORMATS = {"q4_1": 0.625, "int8": 1.0, "int8_g32": 1.0625}  # bytes a weight with the scales


def _q4_1(w: np.ndarray) -> tuple:
    """GGUF Q4_1 per 32 inputs: d and the minimum in float16, u in [0, 15] (as the embedded model's
    GGUF is served: packed, float16 scales and bases)."""
    k, n = w.shape
    blocks = w.reshape(k // 32, 32, n)
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    scale = np.where(high > low, (high - low) / 15, 1).astype(np.float16).astype(np.float32)
    low = low.astype(np.float16).astype(np.float32)
    u = np.clip(np.round((blocks - low[:, None]) / scale[:, None]), 0, 15)
    q = (u - 8).astype(np.int8).reshape(k, n)
    return (cpu.pack_dense_kernel_int4(q), *cpu.float16_scales(scale, low + 8 * scale))


def _int8(w: np.ndarray, group: int | None) -> tuple:
    k, n = w.shape
    blocks = w.reshape(k // (group or k), group or k, n)
    scale = (np.abs(blocks).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(blocks / scale[:, None]), -127, 127).astype(np.int8).reshape(k, n)
    return cpu.pack_dense_kernel_int8(q), cpu.float16_int8_scales(scale if group else scale[0])


def _weights(fmt: str, w: np.ndarray) -> tuple:
    if fmt == "q4_1":
        return _q4_1(w)
    return _int8(w, 32 if fmt == "int8_g32" else None)


def _product(fmt: str):
    if fmt == "q4_1":
        return lambda x, packed, scale, base: cpu.native_dense_int4(x, packed, scale, base=base)
    return cpu.native_dense_int8


def measure(fmt: str, shape: tuple[int, int], rows: list[int], calls: int, rng) -> dict:
    depth, width = shape
    copies = int(min(MAX_COPIES, max(2, STREAMED_BYTES // (depth * width * FORMATS[fmt]))))
    base = rng.standard_normal((depth, width)).astype(np.float32)
    weights = [
        tuple(jax.device_put(a) for a in _weights(fmt, base * (1 + i / copies))) for i in range(copies)
    ]
    program = chain(_product(fmt))
    xs = {t: jnp.asarray(rng.standard_normal((t, depth)), jnp.bfloat16) for t in rows}
    for x in xs.values():
        program(x, weights).block_until_ready()  # compile
    times: dict[int, list[float]] = {t: [] for t in rows}
    for _ in range(calls):
        for t, x in xs.items():
            times[t].append(cpu_seconds(program, x, weights) / copies)
    us = {t: statistics.median(v) * 1e6 for t, v in times.items()}
    return {"us": us, "per_row": {t: us[t] / (t * us[rows[0]]) for t in rows}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,5,8,12,16")
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {sorted(SHAPES)}")
    parser.add_argument("--native", help="the kernels' build directory (default: the cache's)")
    parser.add_argument("--out", default=str(HERE / "out" / "dense_few_rows.json"))
    args = parser.parse_args()
    cache = os.environ.get("VLLM_XLA_CACHE_DIR", str(HERE.parent / ".cache" / "vllm-xla"))
    cpu.load(args.native or os.path.join(cache, "native"))
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    results = []
    for fmt in args.formats.split(","):
        for name in args.shapes.split(","):
            if fmt == "q4_1" and name == "head":
                continue  # the embedded model's head is int8 (its GGUF's Q8_0 embedding)
            result = {"format": fmt, "shape": name, **measure(fmt, SHAPES[name], rows, args.calls, rng)}
            result["loadavg"] = pathlib.Path("/proc/loadavg").read_text().split()[0]
            results.append(result)
            print(json.dumps(result), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
