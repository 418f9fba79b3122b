# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the Gated DeltaNet ops (`pallas_kernels.gated_delta`: the causal conv1d, then
the gated delta rule, each with its state pool donated) at Qwen3-Next-80B-A3B's per-layer shape
for a compile-only TPU or GPU target.

`python -m tests.aot.gated_delta_compile TARGET [ROWS]` (run by `toolchains.run_worker`)
compiles a decode step, a prefill step and a verification under speculative decoding (4 requests
of 1 + 4 rows, 5 state slots each: `state_indices [R, P]`), or only a decode step of ROWS
sequences if given, each over two pool sizes, and prints one JSON line: per case its name,
compile seconds, temp bytes, the pools' bytes and whether they are aliased (updated in place),
or the compiler's error.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from pallas_kernels import causal_conv1d, gated_delta_rule
from tpu_platform.planner.targets import compile_only_devices

# Qwen3-Next-80B-A3B's linear attention: 16 key heads and 32 value heads of 128, conv of 4 taps.
KEY_HEADS, VALUE_HEADS, DIM, WIDTH = 16, 32, 128, 4
CHANNELS = 2 * KEY_HEADS * DIM + VALUE_HEADS * DIM
# (rows, sequences, state slots a sequence): a decode step of 128 sequences, a 2048-row prefill
# step of 8, and a verification of 4 requests' 4 drafts (a state after each of their 5 rows).
STEPS = [(128, 128, 1), (2048, 8, 1), (20, 4, 5)]
POOL_SLOTS = (256, 1024)


def _layer(qkv, z, b, a, conv_weight, conv_pool, state_pool, slots, has_state, cu_q_lens, num_seqs):
    """A linear-attention layer's ops, as `models.gated_deltanet` runs them."""
    batch = (slots, has_state, cu_q_lens, num_seqs)
    qkv, conv_pool = causal_conv1d(qkv, conv_weight, conv_pool, *batch)
    keys = KEY_HEADS * DIM
    t = qkv.shape[0]
    q = qkv[:, :keys].reshape(t, KEY_HEADS, DIM)
    k = qkv[:, keys : 2 * keys].reshape(t, KEY_HEADS, DIM)
    v = qkv[:, 2 * keys :].reshape(t, VALUE_HEADS, DIM)
    g = -jax.nn.softplus(a.astype(jnp.float32))
    o, state_pool = gated_delta_rule(q, k, v, g, jax.nn.sigmoid(b.astype(jnp.float32)), state_pool, *batch)
    return o * z, conv_pool, state_pool


def compile_case(device: jax.Device, rows: int, seqs: int, columns: int, slots: int) -> dict:
    sharding = SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    conv_pool = spec((slots, WIDTH - 1, CHANNELS), jnp.bfloat16)
    state_pool = spec((slots, VALUE_HEADS, DIM, DIM), jnp.float32)
    args = (
        spec((rows, CHANNELS), jnp.bfloat16), spec((rows, VALUE_HEADS, DIM), jnp.bfloat16),
        spec((rows, VALUE_HEADS), jnp.bfloat16), spec((rows, VALUE_HEADS), jnp.bfloat16),
        spec((WIDTH, CHANNELS), jnp.bfloat16), conv_pool, state_pool, spec((seqs, columns), jnp.int32),
        spec((seqs,), jnp.bool_), spec((seqs + 1,), jnp.int32), spec((1,), jnp.int32),
    )  # fmt: skip
    name = f"t{rows}_r{seqs}_p{columns}_s{slots}"
    start = time.perf_counter()
    try:
        compiled = jax.jit(_layer, donate_argnums=(5, 6)).trace(*args).lower().compile()
    except Exception as e:  # the compiler's message is the answer
        return {"case": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    memory = compiled.memory_analysis()
    pool_bytes = sum(p.size * jnp.dtype(p.dtype).itemsize for p in (conv_pool, state_pool))
    return {
        "case": name,
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 2),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "pool_bytes": int(pool_bytes),
        "in_place": int(memory.alias_size_in_bytes) >= pool_bytes,
    }


def main(argv: list[str]) -> None:
    device = compile_only_devices(argv[0])[0]
    steps = STEPS if len(argv) == 1 else [(int(argv[1]), int(argv[1]), 1)]
    cases = [compile_case(device, *step, slots) for step in steps for slots in POOL_SLOTS]
    print(json.dumps(cases))


if __name__ == "__main__":
    main(sys.argv[1:])
