# SPDX-License-Identifier: Apache-2.0
"""Compile worker: one grouped int8 projection (scales per 32 inputs, a GGUF's Q8_0 layout) as
`models.int8.int8_dot` runs it, compiled for a compile-only GPU at a few token counts. Prints one
JSON line: per token count, the program's temporary bytes per weight.

    python -m tests.aot.int8_grouped_gpu_worker TARGET TOKENS[,TOKENS...]
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

from models.int8 import int8_dot
from tpu_platform.planner.targets import compile_only_devices

INPUTS, OUTPUTS, GROUP = 3072, 8192, 32


def temp_bytes_per_weight(target: str, tokens: int) -> float:
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = (
        jax.ShapeDtypeStruct((tokens, INPUTS), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((INPUTS, OUTPUTS), jnp.int8, sharding=sharding),
        jax.ShapeDtypeStruct((INPUTS // GROUP, OUTPUTS), jnp.float32, sharding=sharding),
    )
    with jax.default_device(device):
        compiled = jax.jit(int8_dot).trace(*args).lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes / (INPUTS * OUTPUTS)


def main(target: str, tokens: str) -> None:
    print(json.dumps({t: temp_bytes_per_weight(target, int(t)) for t in tokens.split(",")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
