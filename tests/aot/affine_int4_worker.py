# SPDX-License-Identifier: Apache-2.0
"""Compiles one affine int4 projection (`models.linear.matmul` with values, scales and offsets,
`models.int4`) for a compile-only target, weights abstract, and prints one JSON line: whether
the values' argument is int4 and the large buffers of the optimized program (`step_compile`).

    python -m tests.aot.affine_int4_worker TARGET TOKENS INPUTS OUTPUTS GROUP
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import int4
from models.linear import matmul
from tests.aot.step_compile import large_buffers
from tpu_platform.planner.targets import compile_only_devices


def compile_case(target: str, tokens: int, inputs: int, outputs: int, group: int) -> dict:
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def product(x, q, scale, offset):
        return matmul(x, nnx.Param(q), nnx.Param(scale), nnx.Param(offset)).astype(x.dtype)

    groups = inputs // group
    shapes = (
        jax.ShapeDtypeStruct((tokens, inputs), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((inputs, outputs), int4.INT4_DTYPE, sharding=sharding),
        jax.ShapeDtypeStruct((groups, outputs), np.float32, sharding=sharding),
        jax.ShapeDtypeStruct((groups, outputs), np.float32, sharding=sharding),
    )
    compiled = jax.jit(product).lower(*shapes).compile()
    text = compiled.as_text()
    return {
        "target": target,
        "int4_values": f"s4[{inputs},{outputs}]" in text,  # the values' argument, two a byte
        # a wider copy of the weight: as large as its values at a byte each
        "large_buffers": large_buffers(text, inputs * outputs),
    }


def main(argv: list[str]) -> None:
    target, *sizes = argv
    print(json.dumps(compile_case(target, *(int(v) for v in sizes))))


if __name__ == "__main__":
    main(sys.argv[1:])
