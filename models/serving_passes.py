# SPDX-License-Identifier: Apache-2.0
"""Whole-model passes run once a model is built and loaded, before it serves: fusing projections
and repeating KV heads for a mesh (`loader.prepare_for_serving`), attaching RoPE tables (the
runner), packing kernels for the native CPU dense kernel (prepared weights), running the norms
as native calls beside them (the runner). Each walks the model's modules and rewrites the ones
it applies to; the building blocks themselves are `models.layers`.
"""

from __future__ import annotations

import jax
from flax import nnx

from models.int8 import group_size
from models.layers import Embedding, GatedMLP, PagedAttention, RMSNorm
from models.linear import (
    Linear,
    PackedKernel,
    halve_int4_scales,
    halve_int8_scales,
    is_packed_int4,
    native_dense_takes_groups,
    packed_for_native_dense,
)
from models.rope import Rope, RopeTable, rope_table


def fuse_projections(model: nnx.Module, blocks: int = 1) -> None:
    """Fuses q/k/v and gate/up projections everywhere in `model`: fewer, wider matmuls (a single
    stream's matvecs run faster on XLA:CPU) and fewer arrays for every step to pass. `blocks`:
    the tensor-parallel size, whose devices each get one block of every fused kernel."""
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, (PagedAttention, GatedMLP)):
            module.fuse_projections(blocks)


def repeat_kv_heads_for_mesh(model: nnx.Module, num_kv_heads: int) -> None:
    """Repeats every attention layer's KV heads up to `num_kv_heads` (`sharding.kv_heads_on_mesh`)."""
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, PagedAttention):
            module.repeat_kv_heads(num_kv_heads // module.num_kv_heads)


def attach_rope_tables(model: nnx.Module, num_positions: int) -> int:
    """Gives every attention layer a table of its RoPE's cosines and sines for positions below
    `num_positions` (the runner's `max_model_len`), one table shared by the layers of one RoPE;
    returns how many tables. Steps then gather their rotations instead of computing them
    (`models.rope`)."""
    tables: dict[tuple[Rope, int], RopeTable] = {}
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, PagedAttention):
            key = (module.rope, module.rotary_dim)
            if key not in tables:
                tables[key] = RopeTable(rope_table(module.rope, module.rotary_dim, num_positions))
            module.rope_table = tables[key]
    return len(tables)


def pack_for_native_dense(
    model: nnx.Module,
    *,
    float32: bool = False,
    int4: bool = False,
    float16_scales: bool = False,
    float16_head_scales: bool = False,
) -> int:
    """Packs every Linear kernel (and a tied head's copy) that the native CPU dense kernel can take
    (`pallas_kernels.cpu.native_dense`): the bfloat16 and int8 ones, and with `float32` the float32 ones;
    returns how many. Run after loading, on a CPU where `pallas_kernels.cpu.dense_isa` is not None
    (for `float32`, where it is "avx2": CPUs with AVX-512 or AMX run XLA's float32 dots faster).
    `int4`: the model's quantized kernels hold 4-bit values (`models.int4`, held as int8 on CPU),
    packed two a byte for the native int4 kernel (`pallas_kernels.cpu.native_dense_int4`), but
    a tied head's copy, int8 (`models.quantization.quantize_tied_head_int8`): the int8 kernel.
    A kernel with grouped scales is packed only where its native kernel takes them
    (`linear.native_dense_takes_groups`: an int4 one the int4 kernel refuses goes to the int8
    kernel where that one takes them); else it stays on XLA's dot. `float16_scales`: the packed
    int4 kernels with offsets hold float16 scales and bases instead (`linear.halve_int4_scales`:
    a GGUF Q4_0 or Q4_1 file's own, which a host model's values must fit). `float16_head_scales`:
    a tied head's packed int8 copy with grouped scales holds them in float16
    (`linear.halve_int8_scales`: a GGUF Q8_0 embedding's own d)."""
    packed = 0
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, Linear):
            name, scale = "kernel", module.kernel_scale
        elif isinstance(module, Embedding) and module.head_kernel is not None:
            name, scale = "head_kernel", module.head_scale
        else:
            continue
        kernel = getattr(module, name)
        if isinstance(kernel, PackedKernel):
            continue
        grouped = scale is not None and group_size(kernel.get_value().shape, scale.get_value().shape)
        takes = not grouped or native_dense_takes_groups(grouped, int4=True)
        four_bit = int4 and name == "kernel" and scale is not None and takes  # a head's are int8
        if grouped and not four_bit and not native_dense_takes_groups(grouped):
            continue
        value = packed_for_native_dense(kernel[...], float32=float32, int4=four_bit)
        if value is not None:
            setattr(module, name, PackedKernel(value))
            packed += 1
            affine = getattr(module, "kernel_offset", None) is not None
            if float16_scales and affine and is_packed_int4(value):
                halve_int4_scales(module)
            if float16_head_scales and name == "head_kernel" and grouped:
                module.head_scale = halve_int8_scales(module.head_scale)
    return packed


def use_native_norms(model: nnx.Module) -> int:
    """Runs every RMSNorm of `model` as one native call (`pallas_kernels.cpu.rms_norm`, the residual
    add before a pre-norm block's second norm in the same call) where its dense layers run on the
    native CPU kernels (packed: `pack_for_native_dense`, on one device); returns how many. Each norm
    is several small XLA ops otherwise, each dispatched on its own, which at a few rows costs more
    than the norm's arithmetic."""
    if not jax.tree.leaves(nnx.state(model, PackedKernel)):
        return 0
    norms = [module for _, module in nnx.iter_modules(model) if isinstance(module, RMSNorm)]
    for norm in norms:
        norm.native = True
    return len(norms)
