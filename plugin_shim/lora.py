# SPDX-License-Identifier: Apache-2.0
"""vLLM's LoRA options and requests, handed to the runner's adapter slots (`tpu_platform.lora_slots`).

Adapters are read and checked when vLLM's `add_lora` asks (the server's /v1/load_lora_adapter,
resolvers, `LLM.llm_engine.add_lora`): a bad one is refused there, by name, and only that call
fails. A request may still name an adapter the worker cannot read when its step comes (an
offline `LoRARequest` never added, or an adapter evicted from the host cache whose files have
gone since). Such a request fails alone: the worker names it and why in the step's output, and
vLLM's scheduler finishes it with an error (`plugin_shim.request_failures`; the server answers
it with a 500). Its row is also ended by its own stop condition, which is all that ends it under
a scheduler that cannot fail requests: it samples only its stop token (EOS, else its first stop
id) on the base model and returns no text. A pooling request ends with an empty vector (the
server's classify and score answers then fail that request alone). The error naming the
request, the adapter and why is logged; the engine and every other request go on.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from tpu_platform.lora_slots import LoraConfig, LoraSlots
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import StepUpdate

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput

    from tpu_platform.runner import Runner

logger = init_logger("vllm.xla.lora")


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


def admit_requested(
    runner: Runner, output: SchedulerOutput, update: StepUpdate
) -> tuple[StepUpdate, dict[str, str]]:
    """Reads the adapters this step's new requests name (before the step takes slots): `update`
    with each request whose adapter cannot be read served on the base model (a generating one
    ended by its stop token), and those requests' ids with why (see the module)."""
    slots = adapters(runner)
    named: dict[str, tuple[LoRARequest, SamplingParams | None]] = {}
    for request in output.scheduled_new_reqs:
        lora = request.lora_request
        if lora is not None:
            slots.remember(lora.lora_int_id, lora.lora_name, lora.lora_path)
            named[request.req_id] = (lora, request.sampling_params)
    failed = slots.read_ahead([lora.lora_int_id for lora, _ in named.values()]) if named else {}
    if not failed:
        return update, {}
    refused, reasons = {}, {}
    for request in update.new_requests:
        lora, params = named.get(request.req_id, (None, None))
        if lora is None or lora.lora_int_id not in failed:
            continue
        reasons[request.req_id] = failed[lora.lora_int_id]
        logger.error("request %s is ended without output: %s", request.req_id, reasons[request.req_id])
        if params is None:  # a pooling request: no sampling, its vector is withheld
            withheld = dataclasses.replace(request.pooling, answered=False)
            refused[request.req_id] = dataclasses.replace(request, lora_id=0, pooling=withheld)
        else:
            refused[request.req_id] = dataclasses.replace(request, lora_id=0, sampling=_stop_at_once(params))
    new = [refused.get(request.req_id, request) for request in update.new_requests]
    return dataclasses.replace(update, new_requests=new), reasons


def _stop_at_once(params: SamplingParams) -> SamplingOptions:
    """Options under which a request's first sampled token is one that ends it (its EOS, else
    its first stop id; a request that ignores EOS and has no stop id runs to its max_tokens)."""
    stops = [params.eos_token_id] if params.eos_token_id is not None else sorted(params.stop_token_ids or ())
    token = stops[0] if stops else next(iter(params.all_stop_token_ids or ()), 0)
    return SamplingOptions(
        temperature=0.0,
        allowed_token_ids=(token,),
        stop_token_ids=(token,),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
    )
