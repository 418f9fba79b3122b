# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the Mosaic TPU KV write for a compile-only TPU target, over a shape grid.

`python -m tests.aot.kv_write_compile TARGET [NUM_CASES]` (run by `toolchains.run_worker`)
compiles the first NUM_CASES cases of the grid (default all) and prints one JSON line: per case
its name, compile seconds, temp bytes and whether the cache's bytes are aliased (updated in
place), or the compiler's error.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from pallas_kernels import tpu
from tpu_platform.planner.targets import compile_only_devices

# (tokens, pages, page size, kv heads, head dim, cache dtype): decode and prefill buckets, every
# dtype's tile (page sizes 16/32/128), head dims 64/128/256, 1 to 8 kv heads.
CASES = [
    (64, 4096, 16, 8, 128, "bfloat16"),
    (256, 2048, 32, 4, 256, "float8_e4m3fn"),
    (8, 512, 32, 1, 64, "float32"),
    (128, 1024, 128, 2, 128, "float8_e5m2"),
    (2048, 1024, 128, 8, 128, "bfloat16"),
]


def compile_case(device: jax.Device, case: tuple) -> dict:
    tokens, pages, page_size, kv_heads, head_dim, dtype = case
    sharding = SingleDeviceSharding(device)
    cache = jax.eval_shape(lambda: tpu.allocate_kv_cache(pages, page_size, kv_heads, head_dim, dtype))
    args = (
        jax.ShapeDtypeStruct(cache.shape, cache.dtype, sharding=sharding),
        jax.ShapeDtypeStruct((tokens, kv_heads, head_dim), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((tokens, kv_heads, head_dim), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding),
    )
    name = f"t{tokens}_p{pages}x{page_size}_k{kv_heads}_d{head_dim}_{dtype}"
    start = time.perf_counter()
    try:
        compiled = jax.jit(tpu.write_kv, donate_argnums=0).trace(*args).lower().compile()
    except Exception as e:  # the compiler's message is the answer
        return {"case": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    memory = compiled.memory_analysis()
    cache_bytes = cache.size * cache.dtype.itemsize
    return {
        "case": name,
        "seconds": round(time.perf_counter() - start, 2),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "cache_bytes": int(cache_bytes),
        "in_place": int(memory.alias_size_in_bytes) >= cache_bytes,
    }


def main(argv: list[str]) -> None:
    device = compile_only_devices(argv[0])[0]
    cases = CASES[: int(argv[1])] if len(argv) > 1 else CASES
    print(json.dumps([compile_case(device, case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
