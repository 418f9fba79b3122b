# SPDX-License-Identifier: Apache-2.0
"""The scheduler that fails one request: chosen unless the user chose a scheduler class, by the
engine's async setting, and a step output naming failures keeps every field of the plain one."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from plugin_shim.request_failures import (
    FailingRequestsAsyncScheduler,
    FailingRequestsScheduler,
    StepOutputWithFailures,
    scheduler_fails_requests,
    with_failures,
)


def _config(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(max_model_len=64, is_encoder_decoder=False, **kwargs)


@pytest.mark.parametrize(
    "async_scheduling, chosen, base",
    [(False, FailingRequestsScheduler, Scheduler), (True, FailingRequestsAsyncScheduler, AsyncScheduler)],
)
def test_the_failing_scheduler_is_chosen_by_the_async_setting(async_scheduling, chosen, base):
    config = _config(async_scheduling=async_scheduling)
    assert scheduler_fails_requests(config)
    assert config.get_scheduler_cls() is chosen and issubclass(chosen, base)
    assert scheduler_fails_requests(config)  # a second call keeps it


def test_a_user_scheduler_class_is_kept():
    config = _config(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")
    assert not scheduler_fails_requests(config)
    assert config.get_scheduler_cls() is Scheduler


def test_a_step_output_naming_failures_keeps_the_plain_fields():
    plain = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[3], [4]]
    )
    assert with_failures(plain, {}) is plain
    named = with_failures(plain, {"b": "adapter 7 cannot be read"})
    assert isinstance(named, StepOutputWithFailures)
    assert named.failed_requests == {"b": "adapter 7 cannot be read"}
    for field in dataclasses.fields(plain):
        assert getattr(named, field.name) == getattr(plain, field.name)
