# SPDX-License-Identifier: Apache-2.0
"""FP8 checkpoints of `quant_method: "fp8"` (vLLM's and transformers' fp8 format), loaded as they are.

Such a model directory's `config.json` holds a `quantization_config` like `{"quant_method":
"fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}`, and
its quantized linear layers hold a float8_e4m3fn `weight [out, in]` with:

- with `weight_block_size [Bo, Bi]` (DeepSeek-V3/R1, Qwen3-FP8): `weight_scale_inv [ceil(out /
  Bo), ceil(in / Bi)]`, one float32 scale per block, which multiplies the values (the name
  says inverse: it is the inverse of the quantizer's scale); held per group of `Bi` inputs of
  each channel (`models.fp8.block_scales`);
- without it: `weight_scale`, one per tensor (or per channel).

Activations stay in the model's dtype whatever `activation_scheme` says (a static scheme's
`input_scale` tensors are dropped). The layers named in `ignored_layers` /
`modules_to_not_convert` hold float weights and load as such. Refused by name: another `fmt`
(e5m2 weights), a block of other than two positive sizes, an unknown activation scheme.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from models.compressed_tensors import Int8Checkpoint, int8_kernels_for, quantization_config, weight_shapes
from models.fp8 import FP8_DTYPE

METHOD = "fp8"
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


def check_config(config: dict) -> None:
    """ValueError naming the field unless `config` is an e4m3 fp8 config vllm-xla serves."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"fp8 checkpoint weights of fmt {fmt!r} are not supported; vllm-xla loads "
            "float8_e4m3fn (fmt 'e4m3')"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"fp8 checkpoint activation_scheme {scheme!r} is not 'static' or 'dynamic'")
    block = config.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)
    ):
        raise ValueError(f"fp8 checkpoint weight_block_size {block!r} is not [outputs, inputs] of a block")


def block_of(config: dict | None) -> tuple[int, int] | None:
    """The `[outputs, inputs]` block of a `quant_method: fp8` config's scales (None: not blocks,
    or not such a config)."""
    if not config or config.get("quant_method") != METHOD or config.get("weight_block_size") is None:
        return None
    return tuple(config["weight_block_size"])


def fp8_layout(
    model: nnx.Module,
    path: str,
    names: Callable[[], list[str]],
    our_name: Callable[[str], str | None],
) -> Int8Checkpoint | None:
    """For a `quant_method: fp8` checkpoint at `path` whose tensor names `names()` lists: gives
    each layer it quantized fp8 zeros and a scale (in place, before loading: grouped by the
    block's inputs for block scales, else per channel) and returns how to read it; None for any
    other checkpoint. `our_name`: an HF name's parameter path (the loader's table)."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD:
        return None
    check_config(config)
    scaled = {n.removesuffix(s) + ".weight" for n in names() for s in _SCALE_SUFFIXES if n.endswith(s)}
    block = block_of(config)
    param_map = int8_kernels_for(model, scaled, our_name, path, block and block[1], FP8_DTYPE)
    shapes = weight_shapes(model, scaled, our_name) if block is not None else {}
    return Int8Checkpoint(param_map, frozenset(scaled), block, shapes)
