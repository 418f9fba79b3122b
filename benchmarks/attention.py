# SPDX-License-Identifier: Apache-2.0
"""Times ragged paged attention on the current device, per available backend. Not a test.

Two workloads: decode-heavy (one query per sequence over long contexts: memory bound) and
prefill-heavy (long query chunks: compute bound). For each backend that runs natively here
(`xla` everywhere, `pallas_tpu` on TPU, `pallas_gpu` on GPU, `cpu_native` on CPU) it prints the
median step time, the achieved FLOP/s and bytes/s, and their fraction of the device's
spec-sheet peak when known, and writes everything as JSON.

    python benchmarks/attention.py [--out benchmarks/out/attention.json] [--iters 10]
        [--dtype bfloat16] [--kv-dtype float8_e4m3fn]

`--interpret` also times the Pallas backends in interpret mode on CPU: a smoke run of the code
path, not a performance number. Sizes are smaller on CPU (see WORKLOADS).

FLOPs count only visible (causal, in-window) query-key pairs: 4 * D per pair and query head
(q.k and p.v). Bytes are the ideal traffic: each sequence's K and V read once, q read, output
written, in the cache dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from pallas_kernels import api, cpu
from tpu_platform.attention_backend import native_build_dir
from tpu_platform.envs import read_env

# Spec-sheet peaks (dense bf16 FLOP/s, HBM bytes/s) by device kind prefix. Nothing else measured.
PEAKS = {
    "TPU v4": (275e12, 1.2e12),
    "TPU v5 lite": (197e12, 0.82e12),
    "TPU v5p": (459e12, 2.76e12),
    "TPU v6 lite": (918e12, 1.64e12),
    "NVIDIA H100": (989e12, 3.35e12),
    "NVIDIA A100": (312e12, 2.0e12),
    "NVIDIA L4": (121e12, 0.3e12),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


def workloads(platform: str) -> list[Workload]:
    if platform == "cpu":  # the xla reference gathers pages per token: keep CPU sizes modest
        return [
            Workload("decode", (1,) * 32, tuple(range(512, 2048, 48)), 8, 2, 128, 16),
            Workload("prefill", (256, 256), (512, 256), 8, 2, 128, 16),
        ]
    return [
        Workload("decode", (1,) * 64, tuple(range(1024, 3072, 32)), 32, 8, 128, 16),
        Workload("prefill", (512,) * 8, (1024,) * 4 + (512,) * 4, 32, 8, 128, 16),
    ]


def cost(w: Workload, itemsize: int, kv_itemsize: int) -> tuple[float, float]:
    """(FLOPs, ideal bytes) of one attention call over the workload."""
    pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in zip(w.q_lens, w.kv_lens, strict=True))
    flops = 4.0 * w.head_dim * w.num_q_heads * pairs
    kv_bytes = 2 * sum(w.kv_lens) * w.num_kv_heads * w.head_dim * kv_itemsize
    q_bytes = 2 * sum(w.q_lens) * w.num_q_heads * w.head_dim * itemsize  # q in, out back
    return flops, float(kv_bytes + q_bytes)


def build(w: Workload, backend: str, dtype, kv_dtype, seed: int = 0):
    """A filled cache in `backend`'s layout and the attention inputs (shuffled block table)."""
    rng = np.random.default_rng(seed)
    num_seqs = len(w.q_lens)
    pages_per_seq = -(-max(w.kv_lens) // w.page_size)
    num_pages = num_seqs * pages_per_seq
    table = rng.permutation(num_pages).reshape(num_seqs, pages_per_seq).astype(np.int32)
    pos = [np.arange(n) for n in w.kv_lens]
    slots = np.concatenate(
        [table[i, p // w.page_size] * w.page_size + p % w.page_size for i, p in enumerate(pos)]
    )
    k = jnp.asarray(rng.standard_normal((len(slots), w.num_kv_heads, w.head_dim), np.float32), dtype)
    cache = api.allocate_kv_cache(
        num_pages, w.page_size, w.num_kv_heads, w.head_dim, kv_dtype, backend=backend
    )
    write = jax.jit(
        lambda c, k, s: api.write_kv(c, k, -k, s, backend=backend, kv_dtype=kv_dtype.name), donate_argnums=0
    )
    cache = write(cache, k, jnp.asarray(slots, jnp.int32))
    q = jnp.asarray(rng.standard_normal((sum(w.q_lens), w.num_q_heads, w.head_dim), np.float32), dtype)
    cu_q_lens = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
    args = (q, cache, jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu_q_lens))
    return (*args, jnp.asarray([num_seqs], jnp.int32))


def time_call(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/attention.json")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--kv-dtype", choices=["bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"], help="default: --dtype"
    )
    parser.add_argument("--interpret", action="store_true", help="also run Pallas backends interpreted")
    parser.add_argument("--peak-flops", type=float, help="override the device's peak FLOP/s")
    parser.add_argument("--peak-bytes", type=float, help="override the device's peak memory bytes/s")
    args = parser.parse_args()

    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.dtype(args.kv_dtype or args.dtype)
    peak_flops, peak_bytes = next(
        (v for k, v in PEAKS.items() if device.device_kind.startswith(k)), (None, None)
    )
    peak_flops, peak_bytes = args.peak_flops or peak_flops, args.peak_bytes or peak_bytes
    native = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "cpu_native"}.get(device.platform)
    if native == "cpu_native":
        cpu.load(native_build_dir(read_env().cache_dir))
    backends = (
        ["xla"] + ([native] if native else []) + (["pallas_tpu", "pallas_gpu"] if args.interpret else [])
    )
    print(f"device: {device.platform} / {device.device_kind}; peak FLOP/s {peak_flops}, bytes/s {peak_bytes}")

    results = []
    for w in workloads(device.platform):
        flops, nbytes = cost(w, dtype.itemsize, kv_dtype.itemsize)
        for backend in dict.fromkeys(backends):
            interpret = backend not in ("xla", native)
            extra = {"interpret": True} if interpret else {}
            fn = jax.jit(
                functools.partial(
                    api.ragged_paged_attention,
                    sm_scale=w.head_dim**-0.5,
                    backend=backend,
                    kv_dtype=kv_dtype.name,
                    **extra,
                )
            )
            seconds = time_call(fn, build(w, backend, dtype, kv_dtype), args.iters)
            row = {
                "workload": w.name, "backend": backend, "interpret": interpret, "dtype": dtype.name,
                "kv_dtype": kv_dtype.name,
                "median_s": seconds, "tokens": sum(w.q_lens), "flops": flops, "bytes": nbytes,
                "flops_per_s": flops / seconds, "bytes_per_s": nbytes / seconds,
                "flops_fraction_of_peak": flops / seconds / peak_flops if peak_flops else None,
                "bytes_fraction_of_peak": nbytes / seconds / peak_bytes if peak_bytes else None,
                "shape": dataclasses.asdict(w),
            }  # fmt: skip
            results.append(row)
            frac = " (peak unknown: pass --peak-flops/--peak-bytes)"
            if peak_flops and peak_bytes:
                frac = (
                    f" ({row['flops_fraction_of_peak']:.1%} of peak FLOP/s,"
                    f" {row['bytes_fraction_of_peak']:.1%} of peak bytes/s)"
                )
            print(
                f"{w.name:8s} {backend:10s}{' (interpret)' if interpret else ''}: {seconds * 1e3:9.3f} ms  "
                f"{flops / seconds / 1e9:9.2f} GFLOP/s  {nbytes / seconds / 1e9:8.2f} GB/s{frac}"
            )

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__}
    out.write_text(
        json.dumps({"device": meta, "peak": [peak_flops, peak_bytes], "results": results}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
