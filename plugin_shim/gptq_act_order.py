# SPDX-License-Identifier: Apache-2.0
"""GPTQ checkpoints with activation order (`desc_act: true`, most GPTQ checkpoints on the hub)
through vLLM: vLLM's own GPTQ configuration refuses them at start (its CUDA kernels dropped
act-order), before any platform code runs. Our loader serves them (`models.gptq_checkpoint`),
so the platform registers a quantization method of its own, `GPTQ_ACT_ORDER`, through vLLM's
public `register_quantization_config`; its `override_quantization_method` claims exactly those
checkpoints (vLLM probes registered methods before its built-in GPTQ ones), and vLLM then
builds this configuration instead of refusing. The method carries no layer code: our worker
reads the checkpoint's `quantization_config` itself. Registered from
`XlaPlatform.pre_register_and_update`, before vLLM reads the model."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from tpu_platform.runner_config import GPTQ_ACT_ORDER

# The `quantization` values a user may give for such a checkpoint (vLLM's names of GPTQ, or ours).
_GPTQ_NAMES = (None, "gptq", "auto_gptq", "gptq_marlin", GPTQ_ACT_ORDER)


def claims(hf_quant_cfg: dict[str, Any], user_quant: str | None) -> bool:
    """Whether a checkpoint's `quantization_config` is a grouped GPTQ one with activation order
    (vLLM serves per-channel desc_act itself: the order does not matter there)."""
    return (
        hf_quant_cfg.get("quant_method") == "gptq"
        and bool(hf_quant_cfg.get("desc_act"))
        and hf_quant_cfg.get("group_size", -1) != -1
        and user_quant in _GPTQ_NAMES
    )


class GptqActOrderConfig(QuantizationConfig):
    """vLLM's view of a GPTQ act-order checkpoint served by our worker: its config as it is."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = config

    def get_name(self) -> str:
        return GPTQ_ACT_ORDER

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GptqActOrderConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        return GPTQ_ACT_ORDER if claims(hf_quant_cfg, user_quant) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> None:
        return None  # our worker builds the layers


def register_gptq_act_order() -> None:
    """Registers `GptqActOrderConfig` with vLLM under `GPTQ_ACT_ORDER` (once a process)."""
    if GPTQ_ACT_ORDER not in QUANTIZATION_METHODS:
        register_quantization_config(GPTQ_ACT_ORDER)(GptqActOrderConfig)
