# SPDX-License-Identifier: Apache-2.0
"""Dense layers with int8 weights in C++ (`dense_int8.cc`): `(x [M, K] @ q [K, N]) * s [N]` in
float32, q int8 with one float32 scale per output column (W8A16: x stays bfloat16 or float32).

XLA:CPU converts an int8 kernel to a bfloat16 copy in memory every step before its dot, which
costs more than int8's halved bytes save; the native kernel widens the int8 values in registers
(AVX-512 or AVX2) as they stream, so a decode step reads each weight once, as one byte. The kernel
is packed once (`pack_dense_kernel_int8`) into `[N/16, K, 16]` panels (the float32 kernel's
layout, one byte a value); `native_dense_int8_reference` computes the same product in plain JAX
from the packed form (the oracle in tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import DENSE_INT8_ISAS, DENSE_INT8_TARGET, NativeKernelError, is_loaded

COLUMN_MULTIPLE = 16  # N: one packed row holds 16 columns


def _xp(array):  # NumPy for host arrays (a streamed or host load), jax.numpy for everything else
    return np if isinstance(array, np.ndarray) else jnp


def can_pack_int8(shape: tuple[int, ...], dtype: jnp.dtype) -> bool:
    """Whether a `[K, N]` kernel of this shape and dtype can run on `native_dense_int8`."""
    return len(shape) == 2 and jnp.dtype(dtype) == jnp.int8 and shape[1] % COLUMN_MULTIPLE == 0


def pack_dense_kernel_int8(kernel):
    """`[K, N]` int8 -> `[N/16, K, 16]`: each 16-column panel contiguous, row after row (NumPy in,
    NumPy out)."""
    if not can_pack_int8(kernel.shape, kernel.dtype):
        raise ValueError(
            f"the int8 native dense kernel takes an int8 [K, N] kernel with N a multiple of "
            f"{COLUMN_MULTIPLE}, not {kernel.dtype} {tuple(kernel.shape)}"
        )
    k, n = kernel.shape
    return _xp(kernel).transpose(kernel.reshape(k, n // COLUMN_MULTIPLE, COLUMN_MULTIPLE), (1, 0, 2))


def unpack_dense_kernel_int8(packed: jax.Array) -> jax.Array:
    """The `[K, N]` int8 kernel back from `pack_dense_kernel_int8`'s layout."""
    blocks, depth, cols = packed.shape
    return packed.transpose(1, 0, 2).reshape(depth, blocks * cols)


def native_dense_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """`(x [M, K] @ q) * s`, float32, from the packed kernel, in plain JAX."""
    q = unpack_dense_kernel_int8(packed).astype(jnp.float32)
    return jnp.einsum("mk,kn->mn", x.astype(jnp.float32), q, precision="highest") * scale.astype(jnp.float32)


def native_dense_int8(
    x: jax.Array, packed: jax.Array, scale: jax.Array, *, isa: str | None = None
) -> jax.Array:
    """`(x [M, K] @ q) * s` in float32, `packed` from `pack_dense_kernel_int8`, `scale [N]`.

    x is bfloat16 (read as it is) or another float dtype (converted to float32). `isa` picks the
    path ("avx512_bf16", "avx512" or "avx2"); None takes the best the CPU has
    (`dense_int8_isas`). Trailing rows of x that are all zero are written as zero rows without
    being multiplied, as in `native_dense`.
    Needs the native kernels loaded (`pallas_kernels.cpu.load`); a path the CPU lacks fails when
    the program runs.
    """
    if not is_loaded():
        raise NativeKernelError(
            "the native CPU kernels are not loaded in this process: "
            "call pallas_kernels.cpu.load(build_dir) first"
        )
    codes = {name: code for code, name in DENSE_INT8_ISAS.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"isa must be one of {sorted(codes)} or None, not {isa!r}")
    blocks, depth, cols = packed.shape
    if (
        x.ndim != 2
        or x.shape[1] != depth
        or cols != COLUMN_MULTIPLE
        or packed.dtype != jnp.int8
        or scale.shape != (blocks * cols,)
    ):
        raise ValueError(
            f"x {tuple(x.shape)} and scale {tuple(scale.shape)} do not match a packed int8 kernel "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    x = x if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)
    call = jax.ffi.ffi_call(DENSE_INT8_TARGET, jax.ShapeDtypeStruct((x.shape[0], blocks * cols), jnp.float32))
    return call(x, packed, scale.astype(jnp.float32), isa=np.int32(codes.get(isa, 0)))
