# SPDX-License-Identifier: Apache-2.0
"""RMSNorm, with the residual add before it, as one native call each (`rms_norm.cc`).

On XLA:CPU a decoder layer's `x = x + attn; norm(x)` runs as five or six small ops (the add, the
squares, the mean, the rsqrt, the scaling), each dispatched on its own, which at a few rows costs
more than their arithmetic. The native calls compute the same values in one pass over each row,
in float32, rounding once to the activations' dtype as the jnp form does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import ADD_RMS_NORM_TARGET, RMS_NORM_TARGET, require_loaded

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def rms_norm_reference(
    x: jax.Array, weight: jax.Array, *, eps: float, unit_offset: bool = False, layer: int | None = None
) -> jax.Array:
    """`x * rsqrt(mean(x^2) + eps) * w` over the last axis, in float32, rounded once to x's dtype;
    `w` is `weight [D]`, or row `layer` of a `[L, D]` stack, plus 1 with `unit_offset`."""
    w = (weight if layer is None else weight[layer]).astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + w if unit_offset else w)).astype(x.dtype)


def add_rms_norm_reference(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    unit_offset: bool = False,
    layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(rms_norm_reference(x + residual), x + residual)`, the sum rounded to x's dtype first."""
    total = x + residual
    return rms_norm_reference(total, weight, eps=eps, unit_offset=unit_offset, layer=layer), total


def takes(x: jax.Array, weight: jax.Array) -> bool:
    """Whether the native calls take these operands: float32 or bfloat16 activations and weight."""
    return jnp.dtype(x.dtype) in DTYPES and jnp.dtype(weight.dtype) in DTYPES and x.ndim >= 1


def rms_norm(
    x: jax.Array, weight: jax.Array, *, eps: float, unit_offset: bool = False, layer: int | None = None
) -> jax.Array:
    """`rms_norm_reference` in one native call: x float32 or bfloat16 `[..., D]`, the weight
    float32 or bfloat16 `[D]` (or `[L, D]` with `layer`)."""
    _check(x, weight, layer)
    call = jax.ffi.ffi_call(RMS_NORM_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, weight, **_attributes(eps, unit_offset, layer))


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    unit_offset: bool = False,
    layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` in one native call: `(normed, x + residual)`, both x's dtype."""
    _check(x, weight, layer)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm adds a residual of x's shape and dtype ({x.dtype.name} {tuple(x.shape)}), "
            f"not {residual.dtype.name} {tuple(residual.shape)}"
        )
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (shape, shape))
    normed, total = call(x, residual, weight, **_attributes(eps, unit_offset, layer))
    return normed, total


def _attributes(eps: float, unit_offset: bool, layer: int | None) -> dict:
    return dict(eps=np.float32(eps), layer=np.int64(-1 if layer is None else layer), unit_offset=unit_offset)


def _check(x: jax.Array, weight: jax.Array, layer: int | None) -> None:
    require_loaded()
    stacked = layer is not None
    if (
        not takes(x, weight)
        or weight.ndim != (2 if stacked else 1)
        or weight.shape[-1] != x.shape[-1]
        or (stacked and not 0 <= layer < weight.shape[0])
    ):
        raise ValueError(
            f"the native RMSNorm takes float32 or bfloat16 x [..., D] and a weight [D] (or [L, D] "
            f"with 0 <= layer < L), not x {x.dtype.name} {tuple(x.shape)}, weight "
            f"{weight.dtype.name} {tuple(weight.shape)}, layer {layer}"
        )
