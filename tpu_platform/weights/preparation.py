# SPDX-License-Identifier: Apache-2.0
"""How the loaded weights are prepared beyond the model itself (`Preparation`: packing for the
native CPU kernels, the tensor-parallel layout, the quantization and its scales' layout), which
quantization serves a checkpoint (`int8_quantization`), and the prepared model's structure
without any weights (`abstract_prepared`). The prepared weights' checkpoint is
`tpu_platform.weights.prepared`."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig, PackedKernel, build, pack_for_native_dense
from models.checkpoint_kinds import checkpoint_values, int8_group_size
from models.linear import is_packed_int4, keep_float_layers, packed_for_native_dense
from models.quantization import (
    FP8_METHODS,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_tied_head_int8,
)
from models.weight_stream import served_abstract

_PACKINGS = ("none", "native", "native+f32")
_QUANTIZATIONS = ("none", "int8", "fp8", "int4", "int4z")  # and "int8-g<G>" ...: one scale per G inputs
_GROUPED = re.compile(r"(int8|fp8|int4|int4z)-g([1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class Preparation:
    """How the loaded weights were prepared, beyond the model itself.

    `packing`: "none" (XLA's dots), "native" (bfloat16 kernels packed for the native CPU dense
    kernel) or "native+f32" (float32 kernels too: CPUs whose best path is AVX2). `tp_size`: the
    tensor-parallel size the weights were laid out for (fused projections one block a device, KV
    heads repeated up to it: `models.sharding`). `quantization`: "none", "int8" (every float
    dense kernel int8 with a scale per output channel: `models.quantization`) or "int8-g<G>"
    (the dense projections' and the head's scales per group of G inputs of each column, as a
    GGUF's Q8_0 weights (G = 32) or a compressed-tensors `group` checkpoint hold them:
    `int8_quantization`). The two int8 layouts are distinct preparations (names, cache entries).
    "fp8" and "fp8-g<G>" alike with float8_e4m3fn values (`models.fp8`; the head stays in the
    model's dtype: `models.quantization.quantize_fp8`). "int4" and "int4-g<G>" alike with int4
    values (`models.int4`: a 4-bit checkpoint's, `models.quantization.quantize_int4`), held as
    int4 on TPU and GPU and as int8 on CPU: `backend` names the platform (None: JAX's default
    backend; the planner's compile-only targets name theirs). "int4z" and "int4z-g<G>": int4 with
    an offset per scale (`kernel_offset`, `models.int4`: a checkpoint with zero points or group
    minimums, AWQ, asymmetric GPTQ, GGUF Q4). Packed for the native CPU kernels, a 4-bit
    preparation holds a tied head's copy in int8 (`quantize_tied_head_int8`), in the same groups.
    `float16_scales`: packed so, the int4z kernels hold float16 scales and bases instead of
    float32 scales and offsets (`models.linear.halve_int4_scales`: a GGUF whose projections are
    all Q4_0 or Q4_1, `models.checkpoint_kinds.gguf_float16_scales`, whose blocks hold exactly
    those).
    `float16_head_scales`: packed so, a tied head's grouped int8 copy holds float16 scales (a GGUF
    whose embedding is Q8_0, `models.checkpoint_kinds.gguf_q8_0_embedding`: each block's own d).
    """

    dtype: str
    packing: str = "none"
    tp_size: int = 1
    quantization: str = "none"
    backend: str | None = None  # the platform int4 values are held for (`int4.held_dtype`)
    float16_scales: bool = False
    float16_head_scales: bool = False

    def __post_init__(self) -> None:
        if self.float16_head_scales and (self.packing == "none" or self.fp8 or self.int8_group_size is None):
            raise ValueError(
                f"float16 head scales are for a grouped int8 head packed for the native CPU int8 kernel, "
                f"not {self.quantization!r} weights packed {self.packing!r}"
            )
        if self.float16_scales and not (self.quantization.startswith("int4z") and self.packing != "none"):
            raise ValueError(
                f"float16 scales are for int4z kernels packed for the native CPU int4 kernel, not "
                f"{self.quantization!r} weights packed {self.packing!r}"
            )
        if self.packing not in _PACKINGS:
            raise ValueError(f"packing {self.packing!r} is not one of {_PACKINGS}")
        if self.quantization not in _QUANTIZATIONS and not _GROUPED.fullmatch(self.quantization):
            raise ValueError(
                f"quantization {self.quantization!r} is not one of {_QUANTIZATIONS}, int8-g<group "
                "size>, fp8-g<group size>, int4-g<group size> or int4z-g<group size>"
            )

    @property
    def int8(self) -> bool:
        """Whether the dense kernels are quantized (int8 or fp8 values with scales)."""
        return self.quantization != "none"

    @property
    def fp8(self) -> bool:
        return self.quantization.startswith("fp8")

    @property
    def int4(self) -> bool:
        return self.quantization.startswith("int4")

    @property
    def int8_group_size(self) -> int | None:
        """The inputs sharing a weight scale: None per channel (or not quantized)."""
        grouped = _GROUPED.fullmatch(self.quantization)
        return int(grouped.group(2)) if grouped else None

    @classmethod
    def for_dense_isa(
        cls,
        dtype: str,
        dense_isa: str | None,
        tp_size: int = 1,
        quantization: str = "none",
        *,
        float16_scales: bool = False,
        float16_head_scales: bool = False,
    ) -> Preparation:
        """The preparation of a runner whose native dense kernel runs `dense_isa` (None: XLA's
        dots), on `tp_size` devices; `float16_scales` and `float16_head_scales` where the
        weights allow them and the kernels are packed (else ignored)."""
        packing = "none" if dense_isa is None else "native+f32" if dense_isa == "avx2" else "native"
        halves = float16_scales and packing != "none" and quantization.startswith("int4z")
        grouped = _GROUPED.fullmatch(quantization) is not None and not quantization.startswith("fp8")
        heads = float16_head_scales and packing != "none" and grouped
        return cls(
            jnp.dtype(dtype).name,
            packing,
            tp_size,
            quantization,
            float16_scales=halves,
            float16_head_scales=heads,
        )

    @property
    def name(self) -> str:
        halves = ("-f16scales" if self.float16_scales else "") + (
            "-f16head" if self.float16_head_scales else ""
        )
        int8 = f"-{self.quantization}{halves}" if self.int8 else ""
        return f"{self.dtype}-{self.packing}{int8}" + (f"-tp{self.tp_size}" if self.tp_size > 1 else "")

    def apply(self, model: nnx.Module) -> int:
        """Quantizes and packs `model`'s kernels as this preparation does (after
        `prepare_for_serving`); returns how many kernels were packed."""
        if self.int8:  # before packing: the int8 kernels pack for the native int8 kernel
            if self.int4:
                affine = self.quantization.startswith("int4z")
                quantize_int4(model, self.int8_group_size, self.backend, affine=affine)
                if self.packing != "none":  # a tied head on the native int8 kernel, not bfloat16
                    quantize_tied_head_int8(model, self.int8_group_size)
            else:
                (quantize_fp8 if self.fp8 else quantize_int8)(model, self.int8_group_size)
        if self.packing == "none":
            return 0
        return pack_for_native_dense(
            model,
            float32=self.packing == "native+f32",
            int4=self.int4,
            float16_scales=self.float16_scales,
            float16_head_scales=self.float16_head_scales,
        )

    def served_value(self, value: np.ndarray, served: nnx.Variable) -> np.ndarray:
        """One parameter as `prepare_for_serving` leaves it, as this preparation has it: packed
        when its abstract served Variable is a `PackedKernel` (`stream_model`'s `place`)."""
        if not isinstance(served, PackedKernel):
            return value
        four_bit = is_packed_int4(served.get_value())  # the abstract served value: how it was packed
        return packed_for_native_dense(value, float32=self.packing == "native+f32", int4=four_bit)


def int8_quantization(path: str, method: str | None = None) -> str:
    """The `Preparation.quantization` serving the model at `path` with vLLM's `quantization`
    `method`: the values its checkpoint holds quantized (`models.checkpoint_kinds.checkpoint_values`),
    else fp8 for an fp8 method (`models.quantization.FP8_METHODS`) and int8 for the others; in its
    own quantized weights' layout where it holds them as they are
    (`models.checkpoint_kinds.int8_group_size`: a GGUF's Q8_0 blocks, a compressed-tensors `group`
    checkpoint, a block-fp8 checkpoint), else per channel."""
    values = checkpoint_values(path) or ("fp8" if method in FP8_METHODS else "int8")
    size = int8_group_size(path)
    return values if size is None else f"{values}-g{size}"


def abstract_prepared(
    config: ModelConfig, preparation: Preparation, float_layers: Sequence[str] = ()
) -> tuple[nnx.GraphDef, nnx.State]:
    """The prepared model's structure and its state's shapes and dtypes, without any weights:
    the model is built (host zeros, never written: no memory) and prepared under `nnx.eval_shape`.
    `float_layers`: the layers its checkpoint kept in float (`models.linear.float_layers`), which
    the preparation leaves so."""
    model = build(config, jnp.dtype(preparation.dtype))
    keep_float_layers(model, float_layers)
    return served_abstract(model, config, preparation.tp_size, preparation.apply)
