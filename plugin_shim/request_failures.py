# SPDX-License-Identifier: Apache-2.0
"""Failing one generating request from the worker, the engine and every other request going on.

vLLM 0.32's step output has no field for "this request failed" (its own runners end the engine
instead), but its scheduler can finish a request with an error, as it does for a grammar that
fails to compile: the request ends with `finish_reason` "error", and the OpenAI server answers it
with a 500 while serving the others. So the worker names a step's failed requests and why in
its step output (`StepOutputWithFailures`), and the scheduler class this module provides
finishes them so before it reads the step's tokens, logging each reason.

vLLM calls scheduler classes an interface it may change. A user's own `scheduler_cls` is kept,
and so is vLLM's scheduler when it lacks what this uses (`finish_requests`): then a failed
request keeps the worker's fallback, which ends it by its own stop condition with no text
(`plugin_shim.lora`). `tests/plugin_shim/test_lora_traffic.py` serves both ways.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.config import SchedulerConfig

logger = init_logger("vllm.xla.requests")


@dataclasses.dataclass
class StepOutputWithFailures(ModelRunnerOutput):
    """A step's output naming the requests that failed in it: request id -> why."""

    failed_requests: dict[str, str] = dataclasses.field(default_factory=dict)


def with_failures(output: ModelRunnerOutput, failures: dict[str, str]) -> ModelRunnerOutput:
    """`output`, naming `failures` when there are any (the plain output otherwise)."""
    if not failures:
        return output
    fields = {field.name: getattr(output, field.name) for field in dataclasses.fields(output)}
    return StepOutputWithFailures(**fields, failed_requests=dict(failures))


class _FinishesFailedRequests:
    """Finishes a step's failed requests with an error before vLLM's scheduler reads the step."""

    def update_from_output(self, scheduler_output, model_runner_output):
        failures = getattr(model_runner_output, "failed_requests", None) or {}
        # Finished first, the requests' tokens of this step are skipped as an aborted one's are.
        failed = self.finish_requests(list(failures), RequestStatus.FINISHED_ERROR) if failures else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in failed:
            logger.error("request %s failed: %s", request.request_id, failures[request.request_id])
            ended = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(ended)
        return outputs


class FailingRequestsScheduler(_FinishesFailedRequests, Scheduler):
    """vLLM's scheduler, finishing the requests a step names as failed."""


class FailingRequestsAsyncScheduler(_FinishesFailedRequests, AsyncScheduler):
    """vLLM's async scheduler, finishing the requests a step names as failed."""


def scheduler_fails_requests(scheduler: SchedulerConfig) -> bool:
    """Chooses this module's scheduler unless the user chose one, or vLLM's lacks what it uses;
    True when requests can be failed one by one."""
    if scheduler.scheduler_cls is not None:
        return scheduler.scheduler_cls in (
            _qualified(FailingRequestsScheduler),
            _qualified(FailingRequestsAsyncScheduler),
        )
    if not callable(getattr(Scheduler, "finish_requests", None)):
        return False
    chosen = FailingRequestsAsyncScheduler if scheduler.async_scheduling else FailingRequestsScheduler
    scheduler.scheduler_cls = _qualified(chosen)
    return True


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
