# SPDX-License-Identifier: Apache-2.0
"""Dense projections: the `Linear` module and the one `matmul` every projection runs through,
on XLA's dot (float or int8 weights) or, for packed kernels, the native CPU dense kernel."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import fp8, int4, int8
from models.int4 import is_int4
from models.int8 import group_size, int8_dot
from models.sharding import fused_parts, interleave_blocks, shared_input_order
from pallas_kernels import cpu


def zeros_param(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    """A parameter's placeholder until it is loaded: host zeros, which cost nothing until written
    (a device array would cost a dispatched program per shape, which adds up over a model)."""
    return nnx.Param(np.zeros(shape, dtype))


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with the kernel stored `[in, out]`; an int8 or fp8 kernel has its
    scale in `kernel_scale`: `[out]` per output channel or `[in / G, out]` per group of `G`
    inputs (`models.int8`, `models.fp8`, `models.quantization`); an affine int4 kernel its offsets
    in `kernel_offset`, the scale's layout (`models.int4`). A kernel whose rows a checkpoint
    reordered (GPTQ's activation order: `models.gptq_checkpoint`) has the order in `input_order`
    (int32 `[in]`, row r of the kernel weighs input `input_order[r]`): the product gathers the
    inputs into that order first, so the weights stay packed and every kernel unchanged."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = zeros_param((in_features, out_features), dtype)
        self.bias = zeros_param((out_features,), dtype) if bias else None
        self.kernel_scale: nnx.Param | None = nnx.data(None)
        self.kernel_offset: nnx.Param | None = nnx.data(None)
        self.input_order: nnx.Param | None = nnx.data(None)
        self.lora: nnx.Module | None = nnx.data(None)  # adapter slots: `models.lora.attach_lora`

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.product(x).astype(x.dtype)
        return y + self.bias[...] if self.bias is not None else y

    def product(self, x: jax.Array) -> jax.Array:
        """`x @ kernel` in float32, without the bias; plus each token's LoRA update when the
        projection carries adapter slots (`models.lora`)."""
        rows = x if self.input_order is None else jnp.take(x, self.input_order[...], axis=-1)
        layer = getattr(self, "layer_index", None)  # set where the layers' kernels are stacked
        y = matmul(rows, self.kernel, self.kernel_scale, self.kernel_offset, layer=layer)
        return y if self.lora is None else self.lora.add_update(y, x)

    @classmethod
    def concatenated(cls, parts: Sequence[Linear], blocks: int = 1) -> Linear:
        """One Linear computing every part's output side by side (same input, outputs concatenated).
        Host parts give a host Linear, device parts a device one. `blocks > 1` interleaves the
        parts in that many blocks (`sharding.interleave_blocks`): block j holds the j-th slice of
        every part, so a split over `blocks` devices gives each its own slice of each part."""
        if any(p.kernel_scale is not None for p in parts):  # int8 parts: all of them, each its scales
            values = _int8_kernels(parts)
            kernels, scales = [k for k, _ in values], [s for _, s in values]
        else:
            kernels, scales = [p.kernel[...] for p in parts], None
        kernel = interleave_blocks(kernels, blocks, axis=1)
        fused = cls(kernel.shape[0], kernel.shape[1], bias=parts[0].bias is not None, dtype=kernel.dtype)
        fused.kernel.set_value(kernel)
        if scales is not None:
            fused.kernel_scale = nnx.Param(interleave_blocks(scales, blocks, axis=scales[0].ndim - 1))
        if any(p.kernel_offset is not None for p in parts):  # affine int4 parts; the others' zero
            offsets = [
                p.kernel_offset[...] if p.kernel_offset is not None else int8._xp(s).zeros(s.shape, s.dtype)
                for p, s in zip(parts, scales, strict=True)
            ]
            fused.kernel_offset = nnx.Param(interleave_blocks(offsets, blocks, axis=offsets[0].ndim - 1))
        if all(kept_float(p) for p in parts):
            keep_float(fused)
        order = shared_input_order([p.input_order[...] if p.input_order is not None else None for p in parts])
        if order is not None:
            fused.input_order = nnx.Param(order)
        if fused.bias is not None:
            fused.bias.set_value(interleave_blocks([p.bias[...] for p in parts], blocks, axis=0))
        return fused


def keep_float(module: nnx.Module) -> None:
    """Marks `module` as one a pre-quantized checkpoint holds in float (its recipe's `ignore`,
    `ignored_layers` or `modules_to_not_convert`): no quantization pass of `models.quantization`
    makes its weights int8, fp8 or int4, so the served model computes the checkpoint's own."""
    module.checkpoint_float = True  # static (graph) data: part of the served structure


def kept_float(module: nnx.Module) -> bool:
    """Whether `module` is marked by `keep_float`."""
    return getattr(module, "checkpoint_float", False)


def keep_float_layers(model: nnx.Module, names: Sequence[str]) -> None:
    """Marks (`keep_float`) the layers of a built model (not yet served: q/k/v and gate/up
    apart) at the dotted paths `names`, as `float_layers` gave them."""
    modules = {".".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
    for name in names:
        if name not in modules:
            raise ValueError(f"the layer {name!r} kept in float is not one of {type(model).__name__}'s")
        keep_float(modules[name])


def float_layers(model: nnx.Module) -> list[str]:
    """The paths, in the built model, of the layers `model` (built or served) keeps in float:
    a fused projection's parts by their own names. What a restore marks again
    (`keep_float_layers`) before deriving the served structure from a config alone."""
    names = []
    for path, module in nnx.iter_modules(model):
        if kept_float(module):
            name = ".".join(map(str, path))
            names += [part.removesuffix(".kernel") for part in fused_parts(f"{name}.kernel")] or [name]
    return sorted(names)


def _int8_kernels(parts: Sequence[Linear]) -> list[tuple]:
    """Each part's int8 kernel and scale, a float part quantized like the int8 ones (per channel,
    or in their groups): a fused kernel has one scale layout, which every part must share."""
    sizes = {
        group_size(p.kernel.get_value().shape, p.kernel_scale.get_value().shape)
        for p in parts
        if p.kernel_scale is not None
    }
    if len(sizes) > 1:
        raise ValueError(
            "the projections fused into one have int8 scales of different layouts "
            f"(inputs per scale: {sorted(sizes, key=str)}); a fused projection needs one"
        )
    (size,) = sizes
    values = {np.dtype(p.kernel.get_value().dtype) for p in parts if p.kernel_scale is not None}
    if len(values) > 1:
        raise ValueError(
            f"the projections fused into one hold weights of different types {sorted(map(str, values))}"
        )
    quantize = quantizer_for(values.pop())
    return [
        (p.kernel[...], p.kernel_scale[...]) if p.kernel_scale is not None else quantize(p.kernel[...], size)
        for p in parts
    ]


def quantizer_for(dtype) -> object:
    """The quantizer (`quantize(kernel, group_size)`) giving values of `dtype`: fp8, int4 or int8."""
    return fp8.quantize if fp8.is_fp8(dtype) else int4.quantize if int4.is_int4(dtype) else int8.quantize


class PackedKernel(nnx.Variable):
    """A `[in, out]` kernel packed for the native CPU dense kernel (`pack_for_native_dense`)."""


class Int4Bases(nnx.Variable):
    """What a packed affine int4 kernel's `kernel_offset` holds once its scales are float16
    (`halve_int4_scales`): float16 bases `b = m - 8 s`, the weight of stored value 0, which
    the native int4 kernel takes in place of the offsets (`pallas_kernels.cpu.float16_scales`)."""


def halve_int4_scales(linear: Linear) -> None:
    """A packed affine int4 Linear's float32 scales and offsets as float16 scales and bases
    (`Int4Bases`): the same weights (`pallas_kernels.cpu.float16_scales`, which refuses scales
    float16 would round), 4 bytes a group instead of 8 for a decode step to stream."""
    scale, base = cpu.float16_scales(linear.kernel_scale[...], linear.kernel_offset[...])
    linear.kernel_scale, linear.kernel_offset = nnx.Param(scale), Int4Bases(base)


def halve_int8_scales(scale: nnx.Variable) -> nnx.Variable:
    """A grouped int8 kernel's float32 scales as float16 (`pallas_kernels.cpu.float16_int8_scales`,
    which refuses scales float16 would round: a GGUF Q8_0 block's d fits), in a Variable of the
    same kind: half the bytes a decode step streams for them, the same product."""
    return type(scale)(cpu.float16_int8_scales(scale.get_value()))


def matmul(
    x: jax.Array,
    kernel: nnx.Variable,
    scale: nnx.Variable | None = None,
    offset: nnx.Variable | None = None,
    *,
    layer: int | None = None,
) -> jax.Array:
    """`x [T, in] @ kernel [in, out]`, accumulated and returned in float32; with `scale`, an int8
    kernel converted to x's dtype in the program, the product times the per-column scale; with
    `offset`, an affine int4 kernel's offsets added (`models.int4.offset_product`).

    A `PackedKernel` runs on the native CPU dense kernel (bfloat16: AMX, AVX-512 BF16 or AVX2;
    float32: AVX2; int8 with `scale`: AVX-512 VNNI, AVX-512 or AVX2; 4-bit values packed two a
    byte with `scale` and `offset`: AVX2 or any CPU, the offsets inside the kernel, or float16
    scales and `Int4Bases`). Otherwise the float32 result type and the `[in, out]` kernel keep
    bfloat16 products on XLA:CPU's fast dot path (else both operands are upcast to float32
    copies first), and a single bfloat16 row is padded to two for the same reason.
    `layer`: a packed kernel (and its scale and offset) is the stack of every layer's
    (`models.layer_stacks`), of which the native kernel reads this layer in place.
    """
    if isinstance(kernel, PackedKernel) and is_packed_int4(kernel[...]):
        if isinstance(offset, Int4Bases):
            return cpu.native_dense_int4(x, kernel[...], scale[...], base=offset[...], layer=layer)
        m = None if offset is None else offset[...]
        return cpu.native_dense_int4(x, kernel[...], scale[...], m, layer=layer)
    y = _scaled_product(x, kernel, scale, layer)
    return y if offset is None else y + int4.offset_product(x, offset[...])


def unpacked_shape(packed: jax.Array) -> tuple[int, int]:
    """The `[in, out]` shape of the kernel a quantized `PackedKernel`'s value packs (`[out / 16,
    in, 16]`, or 4-bit `[out / 16, in / 8, 16]`)."""
    panels, rows, width = packed.shape
    return rows * (cpu.INT4_DEPTH_MULTIPLE if is_packed_int4(packed) else 1), panels * width


def is_packed_int4(packed: jax.Array) -> bool:
    """Whether a `PackedKernel`'s value is 4-bit values packed for `pallas_kernels.cpu.native_dense_int4`
    (uint32 words of eight values; the other packings keep their values' dtype)."""
    return packed.dtype == jnp.uint32


def _scaled_product(
    x: jax.Array, kernel: nnx.Variable, scale: nnx.Variable | None, layer: int | None
) -> jax.Array:
    if isinstance(kernel, PackedKernel):
        if scale is not None:  # int8 panels: the native int8 kernel
            return cpu.native_dense_int8(x, kernel[...], scale[...], layer=layer)
        return cpu.native_dense(x, kernel[...], layer=layer)
    single_bf16_row = x.shape[0] == 1 and x.dtype == jnp.bfloat16
    if single_bf16_row:
        x = jnp.concatenate([x, x])
    if scale is None:
        y = jnp.einsum("td,df->tf", x, kernel[...], preferred_element_type=jnp.float32)
    else:
        y = int8_dot(x, kernel[...], scale[...])
    return y[:1] if single_bf16_row else y


def native_dense_takes_groups(group_size: int = 32, *, int4: bool = False) -> bool:
    """Whether the native CPU dense kernel for quantized weights (`int4`: the int4 one, else the
    int8 one) takes scales grouped by `group_size` inputs (`scale [K / G, N]`; GGUF's 32 by
    default): a grouped kernel is packed for it only then, else it stays on XLA's dot (an int4
    one on the int8 kernel where that one takes its groups)."""
    return cpu.dense_int4_takes_groups(group_size) if int4 else cpu.dense_int8_takes_groups(group_size)


def packed_for_native_dense(
    kernel: jax.Array, *, float32: bool = False, int4: bool = False
) -> jax.Array | None:
    """One `[in, out]` kernel as `pack_for_native_dense` packs it, or None when it stays as it is
    (NumPy in, NumPy out: a streamed load packs each kernel on its way to the device). `int4`:
    an integer kernel holds 4-bit values (held as int8 on CPU: `models.int4.held_dtype`), packed
    two a byte for the native int4 kernel where its shape allows, else for the int8 one."""
    if cpu.can_pack(kernel.shape, kernel.dtype):
        return cpu.pack_dense_kernel(kernel)
    if float32 and cpu.can_pack_f32(kernel.shape, kernel.dtype):
        return cpu.pack_dense_kernel_f32(kernel)
    four_bit = (int4 and jnp.dtype(kernel.dtype) == jnp.int8) or is_int4(kernel.dtype)
    if four_bit and cpu.can_pack_int4(kernel.shape):  # its scale and offset stay beside it, unpacked
        return cpu.pack_dense_kernel_int4(kernel)
    if cpu.can_pack_int8(kernel.shape, kernel.dtype):
        return cpu.pack_dense_kernel_int8(kernel)
    return None
