# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings (RoPE): frequencies, the rotation, and per-position tables.

A step's cosines and sines are computed from its positions unless the attention layer holds a
`RopeTable` (`models.attach_rope_tables`), from which they are gathered. XLA fuses the cosine
and sine into every fusion that consumes them, once per head, and on CPU these are scalar calls:
a step's rotations recomputed every cosine and sine per head before the tables (traced on the
embedded model: a visible share of both decode and mixed prefill steps); gathering rows of a
table removes that work.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import RopeScaling
from pallas_kernels.rope import rotate_half, table_rows


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """`[H / 2]` inverse frequencies, with linear or Llama 3 scaling when configured."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    if scaling.high_freq_factor == scaling.low_freq_factor:  # no band between (Llama 4 Scout's)
        return scaled.astype(np.float32)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN: each dimension's frequency blends the interpolated one (divided by `factor`) and the
    original, the original kept for dimensions that rotate more than `beta_fast` times over the
    original context, the interpolated one for fewer than `beta_slow`, a linear ramp between.
    In float32 as transformers computes it."""
    original = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(
        high - low if high != low else 0.001
    )
    extrapolation = 1 - np.clip(ramp, 0, 1)
    inv = (1 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


@dataclasses.dataclass(frozen=True, slots=True)
class Rope:
    """One layer's rotary embedding: base `theta` and optional frequency scaling."""

    theta: float
    scaling: RopeScaling | None = None

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        return rope_inverse_frequencies(head_dim, self.theta, self.scaling)

    @property
    def attention_factor(self) -> float:
        """What the cosines and sines are multiplied by (YaRN's attention scaling; else 1)."""
        return 1.0 if self.scaling is None else self.scaling.attention_factor


@dataclasses.dataclass(frozen=True, slots=True)
class ProportionalRope:
    """Gemma 4's "proportional" RoPE: only the first `int(fraction * H // 2)` frequency pairs
    rotate, at `theta ** (-2i / H)` (H the layer's whole head dim), divided by `factor`; the
    other pairs get frequency zero (cosine 1, sine 0), which leaves those dimensions as they are."""

    theta: float
    fraction: float = 1.0
    factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        rotated = int(self.fraction * head_dim // 2)
        exponents = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(head_dim)
        inv = np.zeros(head_dim // 2, np.float32)
        inv[:rotated] = 1.0 / (np.float32(self.theta) ** exponents)
        return (inv / np.float32(self.factor)).astype(np.float32)

    @property
    def attention_factor(self) -> float:
        return 1.0


class RopeTable(nnx.Variable):
    """`[positions, H]` float32: each position's cosines (`[:, :H/2]`), then its sines."""


def rope_table(rope: Rope, head_dim: int, num_positions: int) -> np.ndarray:
    """The `RopeTable` values of positions `0 .. num_positions - 1`. Angles are float32 products,
    as `rope_cos_sin` (and HF) compute them; their cosines and sines are rounded from float64."""
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * rope.inverse_frequencies(head_dim)[None, :]
    angles = angles.astype(np.float64)
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return table if rope.attention_factor == 1.0 else table * np.float32(rope.attention_factor)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, table: RopeTable | None = None
) -> tuple[jax.Array, jax.Array]:
    """Cosines and sines `[T, H/2]` of `positions[T]`: gathered from `table` when given (positions
    must lie below its length), else computed."""
    if table is not None:
        return table_rows(table[...], positions)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x[T, heads, H]` by the angles whose `cos`, `sin` (`[T, R/2]`) are given
    (rotate-half convention, as HF), in float32; the result keeps `x`'s dtype. With `R < H`
    (partial rotary, GLM-4.5) the first R dimensions rotate and the others pass unchanged."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return rotate_half(x, cos, sin)
    return jnp.concatenate([rotate_half(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)


def step_rope_table(
    positions: jax.Array, inv_freq: np.ndarray, table: RopeTable | None = None, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """A RoPE table and the positions to read from it: `table` and `positions` when given, else
    the step's own rows (`[T, H]`, computed, multiplied by `scale`: `Rope.attention_factor`,
    which `rope_table` includes) and `0 .. T - 1`."""
    if table is not None:
        return table[...], positions
    cos, sin = rope_cos_sin(positions, inv_freq)
    rows = jnp.concatenate([cos, sin], axis=-1)
    rows = rows if scale == 1.0 else rows * jnp.float32(scale)
    return rows, jnp.arange(positions.shape[0], dtype=jnp.int32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (DeepSeek's form)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek-V2/V3 configure it: frequencies interpolated by `factor`
    outside a ramp between the `beta_fast` and `beta_slow` rotation counts of the
    `original_max_position_embeddings` context, cosines and sines scaled by `rope_scale`, and
    the softmax scale multiplied by `softmax_scale` (`mscale_all_dim` applied to every dimension
    of the scores, not only the rotated ones)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def inverse_frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """`[head_dim / 2]` float32 inverse frequencies, as transformers' `yarn` computes them."""

        def correction_dim(rotations: float) -> float:
            context = self.original_max_position_embeddings
            return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        positions = (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim).astype(np.float32)
        pos_freqs = np.float32(theta) ** positions
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = (1 - ramp).astype(np.float32)
        inv = (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv.astype(np.float32)

    @property
    def rope_scale(self) -> float:
        """The factor on the cosines and sines (transformers' `attention_factor`)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale(self) -> float:
        """The factor on the softmax scale (DeepSeek's `mscale_all_dim` correction, squared)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2
