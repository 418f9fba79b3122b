# SPDX-License-Identifier: Apache-2.0
"""The native CPU attention kernel alone, at the embedded model's shapes (SmolLM2-135M: 9 query
heads, 3 kv heads, head dim 64, 128-token pages as served on CPU), against a roofline.

    .venv/bin/python benchmarks/cpu_attention.py [--rows 1,16,64,256] [--contexts 128,512,2048]
        [--prefill 256,512] [--dtypes bfloat16,float32] [--kv-dtypes auto,float8_e4m3fn]
        [--iters 5] [--layers N] [--out benchmarks/out/cpu_attention.json]

Cases: decode (R rows of one query each over C-token contexts) and prefill chunks (one prompt of
N tokens, N query rows). Each measurement is a chain of calls over distinct layers' caches, as a
model step runs them (enough layers to pass 96 MB of cache, at most 30, so the pages come from
memory, not from the last-level cache; `--layers 2` keeps small cases in cache, which shows the
kernel's arithmetic apart from memory); each call's output is the next call's queries. Reported
per case: the best wall time a call over the iterations, and GFLOP/s per second of process CPU
time (a core's work, which other processes' time slices do not stretch), against the roofline of
a core: min(peak FLOP/s, FLOPs a byte x memory bytes/s), peak from `--peak-gflops` (default: the
clock from /proc/cpuinfo x 32 float32 FLOPs a cycle, two 256-bit FMA pipes) and the bytes one
thread reads of a 256 MB buffer a CPU second (measured here). FLOPs count the visible query-key
pairs, 4 * D each per query head; bytes are each sequence's K and V read once. Only ratios mean much on a
shared machine: the load (`/proc/loadavg`) is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from attention import Workload, build, cost  # noqa: E402

from pallas_kernels import api, cpu  # noqa: E402
from tpu_platform.attention_backend import native_build_dir  # noqa: E402
from tpu_platform.envs import read_env  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 128
STREAMED_BYTES = 96e6
MAX_LAYERS = 30


def _clock_hz() -> float:
    with open("/proc/cpuinfo") as f:
        mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    return max(mhz) * 1e6 if mhz else 2.5e9


def _read_bandwidth() -> float:
    """Bytes a CPU second one thread reads a 256 MB buffer at (a vectorized max; the best of three)."""
    data = np.ones(64 * 2**20, np.float32)
    best = math.inf
    for _ in range(3):
        start = time.process_time()
        data.max()
        best = min(best, time.process_time() - start)
    return data.nbytes / best


def _chain(num_layers: int, kv_dtype: str):
    def run(q, caches, kv_lens, table, cu_q_lens, num_seqs):
        for cache in caches:
            q = api.ragged_paged_attention(
                q, cache, kv_lens, table, cu_q_lens, num_seqs,
                sm_scale=HEAD_DIM**-0.5, backend="cpu_native", kv_dtype=kv_dtype,
            )  # fmt: skip
        return q

    return jax.jit(run)


def measure(w: Workload, dtype, kv_dtype, iters: int, layers: int | None = None) -> dict:
    flops, nbytes = cost(w, dtype.itemsize, kv_dtype.itemsize)
    layers = layers or int(min(MAX_LAYERS, max(2, math.ceil(STREAMED_BYTES / nbytes))))
    built = [build(w, "cpu_native", dtype, kv_dtype, seed=i) for i in range(layers)]
    q, _, kv_lens, table, cu_q_lens, num_seqs = built[0]
    caches = tuple(b[1] for b in built)  # the same block table and lengths, distinct pages
    fn = _chain(layers, kv_dtype.name)
    args = (q, caches, kv_lens, table, cu_q_lens, num_seqs)
    jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(iters):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append((time.perf_counter() - wall0) / layers)
        cpus.append((time.process_time() - cpu0) / layers)
    best = min(range(iters), key=lambda i: cpus[i])
    return {
        "flops": flops, "kv_bytes": nbytes, "layers": layers,
        "wall_s": min(walls), "cpu_s": cpus[best],
        "gflops_per_cpu_s": flops / cpus[best] / 1e9, "gb_per_cpu_s": nbytes / cpus[best] / 1e9,
    }  # fmt: skip


def workloads(rows, contexts, prefill) -> list[Workload]:
    shape = (HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE)
    cases = [Workload(f"decode {r}x{c}", (1,) * r, (c,) * r, *shape) for r in rows for c in contexts]
    return cases + [Workload(f"prefill {n}", (n,), (n,), *shape) for n in prefill]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--prefill", default="256,512")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--kv-dtypes", default="auto", help="auto: the rows' dtype; or float8_e4m3fn")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layers", type=int, help="caches in a chain (default: past 96 MB); 2: from cache")
    parser.add_argument("--peak-gflops", type=float, help="a core's peak GFLOP/s (default: clock x 32)")
    parser.add_argument("--out", default="benchmarks/out/cpu_attention.json")
    args = parser.parse_args()

    cpu.load(native_build_dir(read_env().cache_dir))
    peak = args.peak_gflops * 1e9 if args.peak_gflops else _clock_hz() * 32
    bandwidth = _read_bandwidth()
    load_before = os.getloadavg()[0]
    print(f"roofline a core: {peak / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s; load {load_before:.1f}")
    results = []
    for dtype_name in args.dtypes.split(","):
        for kv_name in args.kv_dtypes.split(","):
            dtype = jnp.dtype(dtype_name)
            kv_dtype = dtype if kv_name == "auto" else jnp.dtype(kv_name)
            for w in workloads(_ints(args.rows), _ints(args.contexts), _ints(args.prefill)):
                row = measure(w, dtype, kv_dtype, args.iters, args.layers)
                roof = min(peak, row["flops"] / row["kv_bytes"] * bandwidth)
                mode = f"{args.layers} layers" if args.layers else "streamed"
                row.update(case=w.name, dtype=dtype.name, kv_dtype=kv_dtype.name, mode=mode)
                row["roofline_gflops"] = roof / 1e9
                results.append(row)
                gflops = row["gflops_per_cpu_s"]
                print(
                    f"{w.name:18s} {dtype.name:8s} kv {kv_dtype.name:13s} {row['wall_s'] * 1e3:8.3f} ms"
                    f" {gflops:6.1f} GFLOP/cpu-s ({gflops * 1e9 / roof:4.0%} of {roof / 1e9:.0f})"
                    f" {row['gb_per_cpu_s']:5.1f} GB/cpu-s",
                    flush=True,
                )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "load": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(), "peak_gflops": peak / 1e9,
        "read_gb_s": bandwidth / 1e9, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    out.write_text(json.dumps({"machine": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
