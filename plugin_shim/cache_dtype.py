# SPDX-License-Identifier: Apache-2.0
"""vLLM's `kv_cache_dtype` (`--kv-cache-dtype`) as the runner's KV cache dtype."""

from __future__ import annotations

import torch

# vLLM's names -> the runner's (`tpu_platform.kv_cache.KV_CACHE_DTYPES`). "fp8" is e4m3, as on
# CUDA; float8 values are stored unscaled (vLLM's default k_scale = v_scale = 1).
_VLLM_TO_RUNNER = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# The dtype of the KV cache spec the engine sizes pages with (vLLM's own choice for float8).
_SPEC_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
}


def runner_kv_cache_dtype(cache_config) -> str | None:
    """The runner's KV cache dtype for vLLM's `cache_config` (None: the model's), or a ValueError
    naming the option and the choices."""
    name = str(cache_config.cache_dtype)
    if name == "auto":
        return None
    if name not in _VLLM_TO_RUNNER:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported by vllm-xla; use auto, bfloat16, float16, "
            "fp8 (= fp8_e4m3) or fp8_e5m2"
        )
    skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None)
    if skipped:
        raise ValueError(
            f"kv_cache_dtype_skip_layers ({skipped}) is not supported by vllm-xla: every layer's "
            "cache has one dtype; drop the option or use kv_cache_dtype='auto'"
        )
    return _VLLM_TO_RUNNER[name]


def spec_dtype(runner_dtype: str) -> torch.dtype:
    """The torch dtype of vLLM's KV cache spec for a runner KV cache dtype."""
    return _SPEC_DTYPES[runner_dtype]
