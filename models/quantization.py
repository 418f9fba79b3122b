# SPDX-License-Identifier: Apache-2.0
"""int8 weight-only quantization (W8A16) of a loaded model: which weights, and the pass itself.

`quantize_int8(model)` replaces every float dense kernel by int8 values and a float32 scale per
output channel, or with `group_size` per group of that many inputs (`models.int8`): the
attention and MLP projections (fused or not), the MoE experts' stacked kernels, and the LM head
(an untied `lm_head`, or a tied head's `[D, V]` copy). Kept in the model's dtype: the embedding
table (a lookup reads one row a token: its bytes do not bound a step), norms, biases, and the
MoE router (tiny, and a rounding there changes which experts run, not just how precisely). A
kernel that is int8 already (loaded so from a pre-quantized checkpoint:
`models.compressed_tensors`, a GGUF's Q8_0 weights) is left as it is. Grouped scales are for
the dense projections and the head: the MoE experts keep one scale per channel, and so does a
kernel whose inputs do not split into groups of `group_size`.

Run after `prepare_for_serving` (quantizing per output channel, or per group of inputs of each
column, commutes with fusing columns and repeating KV heads: each column keeps its own scales)
and before packing for the native CPU dense kernel, which then packs the int8 kernels for its
int8 path (`pallas_kernels.cpu.native_dense_int8`).
Also runs under `nnx.eval_shape`, giving the quantized layout's shapes and dtypes.

`quantize_int4(model)` is `quantize_fp8`'s pass with int4 values (`models.int4`, held as
`int4.held_dtype`: int8 on CPU): the layout a 4-bit checkpoint's model is served in (its
kernels load as they are), the head kept in the model's dtype as 4-bit checkpoints ship it.

`quantize_fp8(model)` is the same pass with float8_e4m3fn values (`models.fp8`), grouped scales
for the MoE experts too (a block checkpoint's experts hold them: `models.moe`), except that
the LM head (an untied `lm_head`, a tied head's copy) stays in the model's dtype, as vLLM's fp8
methods keep it and as fp8 checkpoints ship it: 3 significant bits on the layer whose every
output is a logit would move tokens, and the head is one layer of many. A kernel that is fp8
already (a checkpoint's: `models.compressed_tensors`, `models.fp8_checkpoint`) is left as it is.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from models import fp8, int4, int8
from models.latent_attention import LatentUpProjection
from models.layers import Embedding, HeadCopy
from models.linear import Linear, PackedKernel, kept_float
from models.moe import SparseMoE, StackedLinear

# The values of vLLM's `quantization` option that serve int8 weights, and what each means here.
INT8_METHODS = {
    "int8_per_channel_weight_only": (
        "int8 weights quantized at load from a float checkpoint (a GGUF's Q8_0 weights loaded as they are)"
    ),
    "compressed-tensors": "a pre-quantized int8 checkpoint (compressed-tensors), loaded as it is",
}


# The values of vLLM's `quantization` option that serve fp8 weights, and what each means here.
FP8_METHODS = {
    "fp8": (
        "an fp8 checkpoint (quant_method fp8, per tensor, per channel or in 128x128 blocks) as it "
        "is, or a float checkpoint's weights quantized to fp8 at load, per output channel"
    ),
    "fp8_per_channel": "a float checkpoint's weights quantized to fp8 at load, per output channel",
}


def quantize_int8(model: nnx.Module, group_size: int | None = None) -> int:
    """Quantizes `model`'s float dense kernels to int8 in place (see the module docstring);
    returns how many."""
    return _quantize(model, int8.quantize, group_size, head=True)


def quantize_fp8(model: nnx.Module, group_size: int | None = None) -> int:
    """Quantizes `model`'s float dense kernels but the head's to fp8 in place, latent attention's
    up-projections (`kv_b_proj`) too, as a block-fp8 DeepSeek checkpoint holds them; returns how
    many."""
    count = _quantize(model, fp8.quantize, group_size, head=False, grouped_experts=True)
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, LatentUpProjection) and module.kernel_scale is None and not kept_float(module):
            q, scale = _quantized(fp8.quantize, module.kernel[...], group_size)
            module.kernel, module.kernel_scale = nnx.Param(q), nnx.Param(scale)
            count += 1
    return count


def quantize_int4(
    model: nnx.Module, group_size: int | None = None, backend: str | None = None, *, affine: bool = False
) -> int:
    """`quantize_fp8`'s pass with int4 values (`models.int4`) held as `int4.held_dtype(backend)`:
    what a 4-bit checkpoint's model is prepared as (its layers arrive int4; any float one left,
    the head aside, is quantized at load like them); returns how many kernels. `affine`: the
    dense projections also get offsets (`kernel_offset`, zero for a kernel quantized here), the
    layout of a checkpoint with zero points or group minimums, the MoE experts' stacks too."""
    count = _quantize(model, int4.quantizer_held(backend), group_size, head=False, grouped_experts=True)
    if affine:
        lm_head = getattr(model, "lm_head", None)
        routers = {id(m.router) for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)}
        for _, module in list(nnx.iter_modules(model)):
            quantized = isinstance(module, (Linear, StackedLinear)) and module.kernel_scale is not None
            if quantized and module is not lm_head and id(module) not in routers:
                if module.kernel_offset is None:
                    scale = module.kernel_scale.get_value()
                    module.kernel_offset = nnx.Param(np.zeros(scale.shape, scale.dtype))
    return count


def quantize_tied_head_int8(model: nnx.Module, group_size: int | None = None) -> int:
    """A tied head's `[D, V]` copy (`layers.Embedding.head_kernel`) as int8 with its scales (per
    group of `group_size` inputs where they split so, else per channel), where the 4-bit and fp8
    passes leave it in the model's dtype: a single stream's step reads the head's `D * V`
    weights, which a small 4-bit model's projections do not outweigh, and the head at 4 bits
    would move every logit (int8 moves them about as a GGUF's own Q8_0 embedding does). For the
    CPU's native int8 kernel; returns how many heads."""
    quantized = 0
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, Embedding) and module.head_kernel is not None and module.head_scale is None:
            q, scale = _quantized(int8.quantize, module.head_kernel[...], group_size)
            module.head_kernel, module.head_scale = HeadCopy(q), HeadCopy(scale)
            quantized += 1
    return quantized


def _quantize(
    model: nnx.Module, quantize, group_size: int | None, *, head: bool, grouped_experts: bool = False
) -> int:
    routers = {id(m.router) for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)}
    quantized = 0
    for _, module in list(nnx.iter_modules(model)):
        if kept_float(module):
            continue
        if isinstance(module, (Linear, StackedLinear)) and id(module) not in routers:
            if module.kernel_scale is None and not isinstance(module.kernel, PackedKernel):
                size = group_size if isinstance(module, Linear) or grouped_experts else None
                if not head and module is getattr(model, "lm_head", None):
                    continue
                q, scale = _quantized(quantize, module.kernel[...], size)
                module.kernel, module.kernel_scale = nnx.Param(q), nnx.Param(scale)
                quantized += 1
        elif (
            head
            and isinstance(module, Embedding)
            and module.head_kernel is not None
            and module.head_scale is None
        ):
            q, scale = _quantized(quantize, module.head_kernel[...], group_size)
            module.head_kernel, module.head_scale = HeadCopy(q), HeadCopy(scale)
            quantized += 1
    return quantized


def _quantized(quantize, kernel, group_size: int | None) -> tuple:
    """`kernel [in, out]` quantized in groups of `group_size` inputs where they split so, else per channel."""
    if group_size is not None and kernel.shape[-2] % group_size == 0:
        return quantize(kernel, group_size)
    return quantize(kernel)
