# SPDX-License-Identifier: Apache-2.0
"""int8 weights (W8A16): symmetric, one float32 scale per output channel.

A kernel `[..., in, out]` is stored as int8 values `q` and a scale `s [..., out]` with
`w ~ q * s`, `s = max|w| / 127` over the input axis, `q = round(w / s)` in [-127, 127] (the
symmetric range: -128 is never produced, so `-q` is always representable).

The product keeps the activations' dtype: `(x @ q.astype(x.dtype)) * s`. Every int8 value is
exact in bfloat16 (8 significant bits), so the only rounding is the weights' own quantization;
the scale multiplies the float32 accumulator after the dot, where it costs one multiply per
output instead of one per weight. Under `jax.jit` XLA fuses the int8 -> bfloat16 convert into
the dot's operand on TPU and GPU, so the weights cross memory as int8.

The functions take NumPy arrays (quantizing on the host at load, no device program per tensor)
or JAX arrays and tracers (`nnx.eval_shape`, the step) alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127
SCALE_DTYPE = np.float32


def _xp(array):  # NumPy for host arrays, jax.numpy for everything else
    return np if isinstance(array, np.ndarray) else jnp


def quantize_per_channel(kernel) -> tuple:
    """`kernel [..., in, out]` (any float dtype) -> int8 `q [..., in, out]`, float32 `s [..., out]`.

    An all-zero column gets scale 1 (and zero values), never a division by zero."""
    xp = _xp(kernel)
    w = kernel.astype(np.float32)
    amax = xp.max(xp.abs(w), axis=-2)  # [..., out]
    scale = xp.where(amax > 0, amax / INT8_MAX, np.float32(1)).astype(SCALE_DTYPE)
    q = xp.clip(xp.round(w / scale[..., None, :]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def dequantize(q, scale, dtype=np.float32):
    """`q [..., in, out] * s [..., out]` in `dtype` (float32 by default)."""
    return (q.astype(np.float32) * scale[..., None, :].astype(np.float32)).astype(dtype)


def checkpoint_scale(value: np.ndarray, out_features: int) -> np.ndarray:
    """A checkpoint's weight scale as our `[out]` float32: per channel (`[out, 1]` or `[out]`, as
    compressed-tensors writes it) or per tensor (`[1]` or a scalar, broadcast to every channel)."""
    flat = np.asarray(value, np.float32).reshape(-1)
    if flat.size == 1:
        return np.full((out_features,), flat[0], SCALE_DTYPE)
    if flat.size != out_features:
        raise ValueError(
            f"a weight scale of shape {value.shape} fits neither one per output channel "
            f"({out_features}) nor one per tensor"
        )
    return flat.astype(SCALE_DTYPE)


def int8_dot(x: jax.Array, q: jax.Array, scale: jax.Array, spec: str = "td,df->tf") -> jax.Array:
    """`einsum(spec, x, q * s)` in float32: the int8 values converted to `x`'s dtype inside the
    program (fused into the dot's operand), the per-channel scale applied to the product's last
    axis. `scale` broadcasts against the product (`[out]`, or e.g. `[N, 1, out]` for tiles)."""
    y = jnp.einsum(spec, x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return y * scale.astype(jnp.float32)
