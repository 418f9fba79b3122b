# SPDX-License-Identifier: Apache-2.0
"""vLLM's LoRA options and requests, handed to the runner's adapter slots (`tpu_platform.lora_slots`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_platform.lora_slots import LoraConfig, LoraSlots

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.sched.output import SchedulerOutput

    from tpu_platform.runner import Runner


def runner_lora_config(config: VllmConfig) -> LoraConfig | None:
    """The runner's LoRA limits from vLLM's `LoRAConfig` (None: `enable_lora` is off)."""
    lora = config.lora_config
    if lora is None:
        return None
    dtype = lora.lora_dtype
    dtype = None if dtype in (None, "auto") else str(dtype).removeprefix("torch.")
    return LoraConfig(
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        max_cpu_loras=lora.max_cpu_loras,
        dtype=dtype,
    )


def adapters(runner: Runner) -> LoraSlots:
    """The runner's adapters, or a RuntimeError saying how to enable them."""
    if runner.lora is None:
        raise RuntimeError("LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)")
    return runner.lora


def add(runner: Runner, request: LoRARequest) -> bool:
    """vLLM's `add_lora`: reads the adapter (a ValueError names what is wrong with it)."""
    return adapters(runner).add(
        request.lora_int_id, request.lora_name, request.lora_path, replace=request.load_inplace
    )


def remember_requested(runner: Runner, output: SchedulerOutput) -> None:
    """Where to read the adapters that new requests name (read when a step first needs one)."""
    for request in output.scheduled_new_reqs:
        lora = request.lora_request
        if lora is not None:
            adapters(runner).remember(lora.lora_int_id, lora.lora_name, lora.lora_path)
