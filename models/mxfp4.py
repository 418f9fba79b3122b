# SPDX-License-Identifier: Apache-2.0
"""MXFP4 weights (OCP microscaling FP4) as GPT-OSS checkpoints ship their experts, kept so.

A weight `[out, in]` is stored as `blocks [.., out, in / 32, 16]` uint8, two e2m1 FP4 values a
byte (the low nibble is the even input, the high nibble the odd one), and `scales [.., out,
in / 32]` uint8, one e8m0 exponent per 32 inputs with a bias of 127: the value of input i is
`fp4(i) * 2 ** (scale - 127)`. An e2m1 nibble is a sign bit, two exponent bits and one mantissa
bit: `0, 0.5, 1, 1.5, 2, 3, 4, 6` and their negatives.

`Mxfp4Stack` holds an expert stack so (`[E, out, in / 32, 16]` and `[E, out, in / 32]`), 4.25
bits a weight. The routed experts decode each tile's own expert into the step's dtype inside
the grouped matmul (`models.moe.experts_routed`, `Mxfp4Stack.tile_matmul`): every product of an
FP4 value and a power of two is exact in bfloat16, so the weights are the dequantized
checkpoint's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127  # e8m0: the scale is 2 ** (byte - 127)
METHODS = ("mxfp4", "gpt_oss_mxfp4")  # a checkpoint's `quantization_config.quant_method`


def is_mxfp4(hf_config: dict) -> bool:
    """Whether an HF config dict says its experts are mxfp4 (`quantization_config`)."""
    return (hf_config.get("quantization_config") or {}).get("quant_method") in METHODS


def _fp4_values(nibbles: jax.Array) -> jax.Array:
    """uint8 e2m1 codes (0..15) -> float32, in integer arithmetic (no table gather): four
    times the magnitude is `2m` for exponent bits e = 0, else `(2 + m) << e`."""
    exponent = ((nibbles >> 1) & 3).astype(jnp.int32)
    mantissa = (nibbles & 1).astype(jnp.int32)
    quadruple = jnp.where(exponent == 0, mantissa << 1, (2 + mantissa) << exponent)
    magnitude = quadruple.astype(jnp.float32) * 0.25
    return jnp.where(nibbles >= 8, -magnitude, magnitude)


def _scale_values(scales: jax.Array) -> jax.Array:
    """uint8 e8m0 exponents -> float32 `2 ** (s - 127)`, exactly (the bits of that float; the
    codes 0 and 255, 2**-127 and NaN, which no trained weight uses, give 0 and inf)."""
    return jax.lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32)


def dequantize(blocks: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`blocks [.., out, G, 16]`, `scales [.., out, G]` -> the weight `[.., out, G * 32]` in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"mxfp4 blocks {blocks.shape} and scales {scales.shape} do not match: expected "
            f"blocks [.., out, in / {BLOCK}, {BLOCK // 2}] and scales [.., out, in / {BLOCK}]"
        )
    pairs = jnp.stack([_fp4_values(blocks & 15), _fp4_values(blocks >> 4)], axis=-1)  # [.., G, 16, 2]
    values = pairs.reshape(*scales.shape, BLOCK) * _scale_values(scales)[..., None]  # [.., out, G, 32]
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Stack:
    """An expert stack of `[in, out]` kernels held as mxfp4, in the checkpoint's `[out, in]` order."""

    blocks: jax.Array  # [E, out, in / 32, 16] uint8
    scales: jax.Array  # [E, out, in / 32] uint8

    @property
    def shape(self) -> tuple[int, int, int]:
        """The `[E, in, out]` kernel stack it stands for."""
        experts, out, groups, _ = self.blocks.shape
        return experts, groups * BLOCK, out

    def tile_matmul(self, rows: jax.Array, experts: jax.Array | slice, *, summed: bool = False) -> jax.Array:
        """`rows [N, B, in] @` the kernels of `experts [N]` -> `[N, B, out]` in the rows' dtype;
        `summed`: the N products' sum `[B, out]` instead (every expert's rows weighted already).

        The even and odd inputs (low and high nibbles) are two dots, each over values decoded
        and scaled elementwise from the gathered bytes in the rows' dtype (exact: an FP4 value
        times a power of two), which the compiler can fuse into the dot's operand: no
        interleaved or float32 copy of the tiles' weights is made."""
        n, b, inputs = rows.shape
        blocks = self.blocks[experts]  # [N, O, G, 16]
        scale = _scale_values(self.scales[experts]).astype(rows.dtype)[..., None]  # [N, O, G, 1]
        pairs = rows.reshape(n, b, inputs // BLOCK, BLOCK // 2, 2)  # [N, B, G, 16, 2]
        out = 0
        for parity, nibbles in enumerate((blocks & 15, blocks >> 4)):
            values = _fp4_values(nibbles).astype(rows.dtype) * scale  # [N, O, G, 16]
            out = out + jnp.einsum(
                "nbgj,nogj->bo" if summed else "nbgj,nogj->nbo",
                pairs[..., parity],
                values,
                preferred_element_type=jnp.float32,
            )
        return out.astype(rows.dtype)

    def dense(self, dtype: jnp.dtype) -> jax.Array:
        """The whole stack dequantized as `[E, in, out]` kernels (tests, references)."""
        return jnp.swapaxes(dequantize(self.blocks, self.scales, dtype), 1, 2)


def blocks_on_mesh(inputs: int, tp_size: int) -> int:
    """The inputs `inputs` padded to whole 32-value blocks on each of `tp_size` devices."""
    unit = BLOCK * tp_size
    return -(-inputs // unit) * unit


def zero_padded(value, shape: tuple[int, ...]):
    """`value` (NumPy or JAX, abstract too) with zeros after its end on each axis up to `shape`:
    zero blocks and scales decode to 0 (`_scale_values`)."""
    widths = [(0, target - size) for size, target in zip(value.shape, shape, strict=True)]
    if any(after < 0 for _, after in widths):
        raise ValueError(f"cannot pad shape {tuple(value.shape)} down to {tuple(shape)}")
    return (np if isinstance(value, np.ndarray) else jnp).pad(value, widths)
