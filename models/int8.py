# SPDX-License-Identifier: Apache-2.0
"""int8 weights (W8A16): symmetric, one float32 scale per output channel or per group of inputs.

A kernel `[..., in, out]` is stored as int8 values `q` and a float32 scale `s` with `w ~ q * s`,
`s = max|w| / 127`, `q = round(w / s)` in [-127, 127] (the symmetric range: -128 is never
produced, so `-q` is always representable). Two scale layouts:

- per channel: `s [..., out]`, the maximum over every input of a column;
- grouped: `s [..., in / G, out]`, one scale per column for each run of `G` consecutive inputs
  (GGUF's Q8_0 blocks, G = 32; compressed-tensors' `group` strategy). `G` is never stored: it
  is `in / s.shape[-2]` (`group_size`).

The product keeps the activations' dtype: `(x @ q.astype(x.dtype)) * s`. Every int8 value is
exact in bfloat16 (8 significant bits), so the only rounding is the weights' own quantization;
the scale multiplies the float32 accumulator after the dot, where it costs one multiply per
output (per group and output when grouped: a partial product per group, scaled, then summed)
instead of one per weight. Under `jax.jit` XLA fuses the int8 -> bfloat16 convert into the
dot's operand on TPU and GPU, so the weights cross memory as int8.

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
    """`kernel [..., in, out]` (any float dtype) -> int8 `q [..., in, out]`, float32 `s [..., out]`:
    `quantize_grouped` with one group of every input. An all-zero column gets scale 1 (and zero
    values), never a division by zero."""
    q, scale = quantize_grouped(kernel, kernel.shape[-2])
    return q, scale[..., 0, :]


def quantize_grouped(kernel, group_size: int) -> tuple:
    """`kernel [..., in, out]` -> int8 `q [..., in, out]`, float32 `s [..., in / G, out]`: one
    scale per column for each `group_size` consecutive inputs (`in` must be a multiple of it).
    An all-zero group gets scale 1."""
    *lead, inputs, outputs = kernel.shape
    if group_size < 1 or inputs % group_size:
        raise ValueError(f"a kernel of {inputs} inputs does not split into groups of {group_size}")
    xp = _xp(kernel)
    w = kernel.astype(np.float32).reshape(*lead, inputs // group_size, group_size, outputs)
    amax = xp.max(xp.abs(w), axis=-2, keepdims=True)
    scale = xp.where(amax > 0, amax / INT8_MAX, np.float32(1)).astype(SCALE_DTYPE)
    q = xp.clip(xp.round(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.reshape(kernel.shape), scale[..., 0, :]


def quantize(kernel, group_size: int | None = None) -> tuple:
    """`quantize_grouped` with `group_size`, else `quantize_per_channel`."""
    return quantize_per_channel(kernel) if group_size is None else quantize_grouped(kernel, group_size)


def group_size(kernel_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """The inputs sharing a scale of an int8 kernel of `kernel_shape` with a scale of
    `scale_shape`: None per channel (`[..., out]`), `in / groups` grouped (`[..., groups, out]`)."""
    if len(scale_shape) == len(kernel_shape) - 1:
        return None
    inputs, groups = kernel_shape[-2], scale_shape[-2]
    if len(scale_shape) != len(kernel_shape) or groups < 1 or inputs % groups:
        raise ValueError(f"an int8 scale of shape {scale_shape} fits no kernel of shape {kernel_shape}")
    return inputs // groups


def dequantize(q, scale, dtype=np.float32):
    """`q [..., in, out] * s` in `dtype` (float32 by default), `s` per channel or grouped."""
    size = group_size(q.shape, scale.shape)
    s = scale.astype(np.float32)
    if size is None:
        return (q.astype(np.float32) * s[..., None, :]).astype(dtype)
    xp = _xp(q)
    w = q.astype(np.float32).reshape(*q.shape[:-2], q.shape[-2] // size, size, q.shape[-1])
    return xp.reshape(w * s[..., None, :], q.shape).astype(dtype)


def checkpoint_scale(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A checkpoint's weight scale as ours of `shape` (float32): `(out,)` per channel, from `[out,
    1]` or `[out]` (as compressed-tensors writes it) or one per tensor (`[1]` or a scalar,
    broadcast to every channel); `(in / G, out)` grouped, from the HF orientation `[out, in / G]`
    (compressed-tensors' `group` strategy, GGUF's Q8_0 blocks: `models.gguf_reader`)."""
    value = np.asarray(value, np.float32)
    if len(shape) == 2:
        if value.shape != shape[::-1]:
            raise ValueError(
                f"a weight scale of shape {value.shape} is not one per group of inputs and output "
                f"channel ({shape[::-1]})"
            )
        return np.ascontiguousarray(value.T, SCALE_DTYPE)
    (out_features,) = shape
    flat = value.reshape(-1)
    if flat.size == 1:
        return np.full((out_features,), flat[0], SCALE_DTYPE)
    if flat.size != out_features:
        raise ValueError(
            f"a weight scale of shape {value.shape} fits neither one per output channel "
            f"({out_features}) nor one per tensor"
        )
    return flat.astype(SCALE_DTYPE)


def int8_dot(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """`x [T, in] @ (q * s) [in, out]` in float32, the int8 values converted inside the program.

    Per channel: one dot of the int8 values converted to `x`'s dtype (fused into the dot's
    operand), the product's columns times `s [out]`. Grouped (`s [in / G, out]`): on TPU (and
    GPU at few tokens: `int8_dot_on_gpu`) a partial product per group (`[in / G, T, G] x
    [in / G, G, out] -> [in / G, T, out]`, a dot batched over the groups, the int8 -> `x` dtype
    convert fused into it), each times its scale, summed over the groups: no dequantized weight
    is materialized. XLA:CPU runs such narrow batched dots far slower than one dot, and converts
    an int8 dot operand in memory anyway: there the weight is dequantized in float32 (exact:
    8-bit values times scales of at most 16 significant bits) and multiplied in one dot."""
    size = group_size(q.shape, scale.shape)
    if size is None:
        y = jnp.einsum("td,df->tf", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
        return _rounded_on_accelerators(y, x.dtype) * scale.astype(jnp.float32)
    return jax.lax.platform_dependent(
        x, q, scale, cpu=int8_dot_dequantized, cuda=int8_dot_on_gpu, default=int8_dot_per_group
    )


def _rounded(y: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The float32 `y` rounded to `dtype` and back (as it is, for float32)."""
    return y if jnp.dtype(dtype) == jnp.float32 else y.astype(dtype).astype(jnp.float32)


def _rounded_on_accelerators(y: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The float32 product `y` rounded to the activations' `dtype` (and back) on TPU and GPU, as
    a bfloat16 weight's dot rounds its product. Under tensor parallelism XLA moves that narrowing
    ahead of a row-parallel layer's all-reduce, which then carries `dtype` instead of float32;
    without it the scale multiply between the dot and the model's cast keeps the reduction in
    float32. The CPU keeps the exact float32 product (no collective to save there)."""
    return jax.lax.platform_dependent(y, cpu=lambda v: v, default=lambda v: _rounded(v, dtype))


def int8_dot_per_group(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """`int8_dot` of a grouped kernel as TPU and GPU run it: a dot batched over the groups."""
    groups = scale.shape[0]
    size = q.shape[0] // groups
    # The groups lead both operands: the batched dot XLA:CPU can run on bfloat16 (with the batch
    # axis inside x it falls back to a generic dot without bfloat16 -> float32).
    xg = jnp.swapaxes(x.reshape(x.shape[0], groups, size), 0, 1)  # [in / G, T, G]
    qg = q.reshape(groups, size, q.shape[1]).astype(x.dtype)
    partial = jnp.einsum("gti,gif->gtf", xg, qg, preferred_element_type=jnp.float32)
    # rounded to x's dtype as `_rounded_on_accelerators` says, for the same all-reduce
    return _rounded(jnp.einsum("gtf,gf->tf", partial, scale.astype(jnp.float32)), x.dtype)


def int8_dot_on_gpu(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """`int8_dot` of a grouped kernel on GPU, where the per-group products are a float32 buffer
    `[in / G, T, out]` (4 T / G bytes a weight): per group while that is no larger than a copy
    of the weight in x's dtype, else the weight dequantized to x's dtype (each value rounded
    once, as a bfloat16 checkpoint's are) for one dot."""
    group = q.shape[0] // scale.shape[0]
    if 4 * x.shape[0] <= group * jnp.dtype(x.dtype).itemsize:
        return int8_dot_per_group(x, q, scale)
    w = dequantize(q, scale, x.dtype)
    return jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32)


def int8_dot_dequantized(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """`int8_dot` of a grouped kernel as XLA:CPU runs it: the weight dequantized, one dot."""
    w = dequantize(q, scale)
    return jnp.einsum("td,df->tf", x.astype(jnp.float32), w, preferred_element_type=jnp.float32)
