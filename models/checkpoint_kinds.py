# SPDX-License-Identifier: Apache-2.0
"""What the checkpoint at a path holds as it is, read from its config and its files' headers: the
values of its quantized weights (`checkpoint_values`), their group size, and a GGUF's block types
(Q8_0 and 4-bit projections, a Q8_0 embedding), which decide how a model is prepared to load it."""

from __future__ import annotations

import numpy as np

from models import awq_checkpoint, compressed_tensors, fp8_checkpoint, gguf_reader, gptq_checkpoint
from models.checkpoint_reads import checkpoint_files
from models.fp8 import FP8_DTYPE
from models.int4 import INT4_DTYPE


def int8_group_size(path: str) -> int | None:
    """The inputs per scale of the int8 weights the checkpoint at `path` holds as they are: a
    GGUF's Q8_0 blocks (`gguf_reader.Q8_0_BLOCK`), a compressed-tensors `group` checkpoint's
    `group_size`; None when they are per channel (or there are none: quantized at load per
    channel). What `models.quantization.quantize_int8` takes to prepare a model that loads them."""
    if gguf_q8_0_weights(path):  # none where it holds no weights (a converted directory)
        return gguf_reader.Q8_0_BLOCK
    config = compressed_tensors.quantization_config(path)
    block = fp8_checkpoint.block_of(config)
    if block is not None:
        return block[1]
    return (
        compressed_tensors.group_size(config)
        or gptq_checkpoint.group_size(config)
        or awq_checkpoint.group_size(config)
    )


def checkpoint_values(path: str) -> str | None:
    """The values of the quantized weights the checkpoint at `path` holds as they are: "fp8" (a
    compressed-tensors FP8 or a `quant_method: fp8` checkpoint), "int8" (a compressed-tensors
    int8 one), "int4" (a compressed-tensors 4-bit one, a symmetric GPTQ one), "int4z" (4-bit with
    zero points: AWQ, asymmetric GPTQ and compressed-tensors), None for any other (its weights
    are quantized at load when asked; a GGUF's 4-bit blocks are served as they are when nothing
    is asked: `gguf_4bit_quantization`)."""
    config = compressed_tensors.quantization_config(path) or {}
    if config.get("quant_method") == fp8_checkpoint.METHOD:
        return "fp8"
    if config.get("quant_method") == gptq_checkpoint.METHOD:
        return "int4" if config.get("sym", True) else "int4z"
    if config.get("quant_method") == awq_checkpoint.METHOD:
        return "int4z"
    if config.get("quant_method") == compressed_tensors.METHOD:
        values = compressed_tensors.values_dtype(config)
        if values == INT4_DTYPE:
            return "int4z" if compressed_tensors.has_zero_points(config) else "int4"
        return "fp8" if values == FP8_DTYPE else "int8"
    return None


def gguf_files(path: str) -> list[str]:
    """The GGUF files of the model at `path`: none for safetensors, or where it holds no weights
    (a converted directory)."""
    try:
        return [f for f in checkpoint_files(path) if f.endswith(".gguf")]
    except FileNotFoundError:
        return []


def gguf_q4_weights(path: str) -> set[str]:
    """The HF names of the projection weights of the model at `path`'s GGUF files when they are
    all 4-bit (`gguf_reader.q4_linear_weights`: served as int4 as they are); none otherwise."""
    return {name for file in gguf_files(path) for name in gguf_reader.q4_linear_weights(file)}


def gguf_4bit_quantization(path: str) -> str | None:
    """The preparation serving the model at `path` as it ships when vLLM's `quantization` is not
    set: "int4z-g32" for a GGUF whose projections are all 4-bit (int4 values with a scale and an
    offset per 32 inputs, `models.int4`), else None (its weights load in the model's dtype). With
    a `quantization` asked, its weights are dequantized and quantized so, as before."""
    return f"int4z-g{gguf_reader.Q4_BLOCK}" if gguf_q4_weights(path) else None


def gguf_float16_scales(path: str) -> bool:
    """Whether the model at `path` is a GGUF whose projections are all Q4_0 or Q4_1
    (`gguf_reader.q4_float16_blocks`): their scales and bases are float16, as the native CPU
    int4 kernel can hold them."""
    files = gguf_files(path)
    return bool(files) and all(gguf_reader.q4_float16_blocks(file) for file in files)


def gguf_q8_0_embedding(path: str) -> bool:
    """Whether the model at `path` is a GGUF whose token embedding is Q8_0."""
    return any(gguf_reader.q8_0_embedding(f) for f in gguf_files(path))


def gguf_q8_0_embedding_blocks(path: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The Q8_0 blocks of the token embedding of the model at `path`, a GGUF
    (`gguf_reader.q8_0_embedding`: int8 values `[V, D]`, float16 scales `[V, D / 32]`, a tied
    head's copy as the file holds it); None for another type or checkpoint."""
    blocks = (gguf_reader.q8_0_embedding_blocks(f) for f in gguf_files(path))
    return next((b for b in blocks if b is not None), None)


def gguf_q8_0_weights(path: str) -> set[str]:
    """The HF names of the Q8_0 linear weights of the model at `path`'s GGUF files (none for
    safetensors)."""
    return {name for file in gguf_files(path) for name in gguf_reader.q8_0_linear_weights(file)}
