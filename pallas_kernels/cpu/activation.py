# SPDX-License-Identifier: Apache-2.0
"""SwiGLU's elementwise half, `silu(gate) * up`, as one native call (`silu_mul.cc`).

On XLA:CPU, `jax.nn.silu(gate) * up` on bfloat16 runs as a loop fusion of scalar ops, each
rounded to bfloat16: the largest XLA op left beside the native kernels in a prefill step. The
native call computes each value in float32 and rounds once, as PyTorch does, and skips a step's
trailing padding rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu.build import SILU_MUL_TARGET, require_loaded

OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def silu_and_mul_reference(gate_up: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    """`silu(gate) * up` of `dtype` from `gate_up [T, 2I]` (gate columns, then up): gate and up
    rounded to `dtype`, silu computed in float32 and rounded, then the product, rounded."""
    gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(dtype)
    return (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)


def silu_and_mul(gate_up: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    """`silu_and_mul_reference` in one native call: `gate_up [T, 2I]` float32 (a projection's
    products), the result `[T, I]` float32 or bfloat16. Trailing all-zero rows give zero rows."""
    require_loaded()
    dtype = jnp.dtype(dtype)
    if (
        dtype not in OUTPUT_DTYPES
        or gate_up.dtype != jnp.float32
        or gate_up.ndim != 2
        or gate_up.shape[1] % 2
    ):
        raise ValueError(
            f"silu_and_mul takes float32 [T, 2I] products and gives float32 or bfloat16, not "
            f"{gate_up.dtype.name} {tuple(gate_up.shape)} to {dtype.name}"
        )
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    return jax.ffi.ffi_call(SILU_MUL_TARGET, jax.ShapeDtypeStruct((rows, width), dtype))(gate_up)
