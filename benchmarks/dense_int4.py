# SPDX-License-Identifier: Apache-2.0
"""4-bit weights against int8 and bfloat16 on the CPU device, each on the kernel it is served
with there (`models.linear.matmul`): bfloat16 on the native bfloat16 dense kernel, int8 (one
scale per channel) on the native int8 one, 4-bit packed two a byte on the native int4 kernel
(affine with a scale and an offset per 32 inputs, GGUF Q4_1's layout, in float32 and as the file
holds them, a float16 scale and base: `int4-g32-f16`; and symmetric with a scale per 128, GPTQ's,
or per 64 where 128 does not divide the inputs), and the same 4-bit values held
as int8 on the int8 kernel with the offsets' product on XLA (the path 4-bit weights took before
the int4 kernel), over a decode step's one row to a prefill's hundreds.

    .venv/bin/python benchmarks/dense_int4.py [--rows 1,4,16,128] [--shape 576x1536]
        [--out benchmarks/out/dense_int4.json]

Measured as `benchmarks/dense_fp8.py` measures (a jitted chain of distinct weights passing 64 MB
of bfloat16 weights, programs alternating call by call, process CPU time): per row count the
median over calls of bfloat16 time over each other format's (above 1: that format is faster),
and of int8's time over each 4-bit format's. Only the ratios mean anything on a shared machine:
the load (`/proc/loadavg`) is recorded beside them.
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

from models import int4, int8
from pallas_kernels import cpu

HERE = pathlib.Path(__file__).resolve().parent
STREAMED_BYTES = 64e6


def _bf16_native(x, packed):
    return cpu.native_dense(x, packed)


def _bf16_xla(x, w):
    return jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32)


def _int4_as_int8(x, packed, scale, offset):
    return cpu.native_dense_int8(x, packed, scale) + int4.offset_product(x, offset)


def _int4_half(x, packed, scale, base):
    return cpu.native_dense_int4(x, packed, scale, base=base, x_bits=16)


def _int4_half_x8(x, packed, scale, base):
    return cpu.native_dense_int4(x, packed, scale, base=base, x_bits=8)


def _affine(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit values, scales and offsets of `w` per group of inputs, as GGUF Q4_1 makes them:
    the group's range over 15 steps from its minimum (`w ~ q * s + m`, q in [-8, 7])."""
    k, n = w.shape
    blocks = w.reshape(k // group, group, n)
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    # d and the minimum in float16, as a Q4_1 block holds them
    scale = np.where(high > low, (high - low) / 15, 1).astype(np.float16).astype(np.float32)
    low = low.astype(np.float16).astype(np.float32)
    u = np.clip(np.round((blocks - low[:, None]) / scale[:, None]), 0, 15)
    return (u - 8).astype(np.int8).reshape(k, n), scale, (low + 8 * scale).astype(np.float32)


def _formats(floats: list[np.ndarray]) -> dict[str, tuple[list[tuple], object]]:
    formats = {}
    if cpu.can_pack(floats[0].shape, jnp.bfloat16):
        bf16 = [(cpu.pack_dense_kernel(w.astype(jnp.bfloat16)),) for w in floats]
        formats["bfloat16"] = (bf16, _bf16_native)
    else:
        formats["bfloat16"] = ([(w.astype(jnp.bfloat16),) for w in floats], _bf16_xla)
    pairs = [int8.quantize(w) for w in floats]
    formats["int8"] = ([(cpu.pack_dense_kernel_int8(q), s) for q, s in pairs], cpu.native_dense_int8)
    affine = [_affine(w, 32) for w in floats]
    as_int8 = [(cpu.pack_dense_kernel_int8(q), s, m) for q, s, m in affine]
    formats["int4-g32-as-int8"] = (as_int8, _int4_as_int8)
    packed = [(cpu.pack_dense_kernel_int4(q), s, m) for q, s, m in affine]
    formats["int4-g32"] = (packed, cpu.native_dense_int4)
    halves = [(p, *cpu.float16_scales(s, m)) for p, s, m in packed]
    formats["int4-g32-f16"] = (halves, _int4_half)
    formats["int4-g32-f16-x8"] = (halves, _int4_half_x8)
    group = 128 if floats[0].shape[0] % 128 == 0 else 64  # GPTQ's, or the nearest that divides
    symmetric = [(cpu.pack_dense_kernel_int4(q), s) for q, s in (int4.quantize(w, group) for w in floats)]
    formats[f"int4-g{group}"] = (symmetric, cpu.native_dense_int4)
    return formats


def _medians(times: dict[str, list[float]], base: str) -> dict[str, float]:
    return {
        n: statistics.median(b / o for b, o in zip(times[base], v, strict=True))
        for n, v in times.items()
        if n != base and (base == "bfloat16" or n.startswith("int4"))
    }


def measure(
    depth: int, width: int, rows: list[int], calls: int = 7, only: set[str] | None = None
) -> list[dict]:
    rng = np.random.default_rng(0)
    copies = max(2, int(STREAMED_BYTES // (depth * width * 2)))
    floats = [rng.standard_normal((depth, width)).astype(np.float32) for _ in range(copies)]
    placed = {
        name: ([tuple(jax.device_put(a) for a in arrays) for arrays in weights], chain(product))
        for name, (weights, product) in _formats(floats).items()
        if only is None or name in only or name in ("bfloat16", "int8")
    }
    results = []
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, depth)), jnp.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in placed}
        for weights, program in placed.values():
            program(x, weights).block_until_ready()  # compile
        for _ in range(calls):
            for name, (weights, program) in placed.items():
                times[name].append(cpu_seconds(program, x, weights) / copies)
        row = {
            "rows": t,
            "fastest_ms": {n: min(v) * 1e3 for n, v in times.items()},
            "bf16_over": _medians(times, "bfloat16"),
            "int8_over": _medians(times, "int8"),
            **({"two_plane_over_one": _medians(times, "int4-g32-f16")} if "int4-g32-f16-x8" in times else {}),
            "loadavg": _loadavg(),
        }
        results.append(row)
        print(json.dumps(row))
    return results


def _loadavg() -> str:
    try:
        return pathlib.Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--shape", default="576x1536")
    parser.add_argument("--out", default=str(HERE / "out" / "dense_int4.json"))
    parser.add_argument("--calls", type=int, default=7, help="timed calls of each format per row count")
    parser.add_argument("--formats", help="comma-separated formats to run (bfloat16 and int8 always run)")
    args = parser.parse_args()
    depth, width = (int(v) for v in args.shape.split("x"))
    cache = os.environ.get("VLLM_XLA_CACHE_DIR", str(HERE.parent / ".cache" / "vllm-xla"))
    cpu.load(os.path.join(cache, "native"))  # the native dense kernels
    only = set(args.formats.split(",")) if args.formats else None
    results = measure(depth, width, [int(r) for r in args.rows.split(",")], args.calls, only)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": [depth, width], "results": results}, indent=1))


if __name__ == "__main__":
    main()
