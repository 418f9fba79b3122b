# SPDX-License-Identifier: Apache-2.0
"""A step between its dispatch and its result: the forward's outputs before sampling, the sampled
step whose tokens may still be on the device, and their recording into the request table."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from tpu_platform.inputs import StepPlan
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplerFlags, SamplerOutput, SamplingTensors
from tpu_platform.step_update import StepLogprobs, StepResult

if TYPE_CHECKING:
    from tpu_platform.speculation.verdict import StepDrafts, Verification


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class DispatchedStep:
    """A dispatched forward whose logits are not sampled yet."""

    plan: StepPlan
    req_ids: list[str]
    logits: jax.Array
    greedy: jax.Array  # the rows' argmax, from the forward
    prompt_logprobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    # The sampler's inputs, made before the forward was dispatched (grammar bitmasks come later).
    tensors: SamplingTensors
    flags: SamplerFlags
    dispatched_at: float
    hidden: jax.Array | None = None  # `[T, D]` hidden states of every token (a pooling runner's)
    drafts: StepDrafts | None = None  # the step's draft tokens (speculative decoding)
    expert_load: jax.Array | None = None  # `[L, E]` tokens routed per expert (a MoE model's)
    # A verify shape's `[T, V]` logits and `[T]` greedy tokens of every token row (`step.forward_logits`).
    verify_rows: tuple[jax.Array, jax.Array] | None = None
    # Its sampling tensors per verified position, where its requests use penalties, bad words,
    # min_tokens, logit biases or allowed ids (`SpeculativeDecoding.position_tensors`).
    positions: tuple[SamplingTensors, SamplerFlags] | None = None


@dataclasses.dataclass(slots=True)
class InFlightStep:
    """A sampled step whose tokens may still be on the device; `Runner.finish` records them."""

    plan: StepPlan | None
    req_ids: list[str]
    out: SamplerOutput | None  # `out.sampled_token_ids`: [feed width], the next step's fed tokens
    prompt_logprobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    dispatched_at: float
    result: StepResult | None = None  # once finished
    verification: Verification | None = None  # a step whose drafts a program verified
    expert_load: jax.Array | None = None  # as `DispatchedStep`'s, on its way to the host


def record_step(table: RequestTable, step: InFlightStep) -> StepResult:
    """Writes each emitting row's token of a finished `step` where its plan reserved it in the
    history (`RequestTable.reserve`), and gives the step's result; a partial prefill chunk emits `[]`."""
    plan, req_ids, out = step.plan, step.req_ids, step.out
    n = len(req_ids)
    tokens = np.asarray(out.sampled_token_ids)[:n]
    table.fill(plan.appends, tokens)
    if step.verification is not None:  # each row's first token, then the drafts kept after it
        sampled = step.verification.record(table, plan.rows, plan.emits_token)
    elif plan.all_emit:
        sampled = [[t] for t in tokens.tolist()]
    else:
        emits = plan.emits_token.tolist()
        sampled = [[t] if e else [] for t, e in zip(tokens.tolist(), emits, strict=True)]
    logprobs = None
    if step.verification is not None and step.verification.logprobs is not None:
        logprobs = step.verification.step_logprobs(sampled)
    elif out.logprob_token_ids is not None:
        logprobs = StepLogprobs(
            token_ids=np.asarray(out.logprob_token_ids)[:n],
            logprobs=np.asarray(out.logprobs)[:n],
            ranks=np.asarray(out.sampled_token_ranks)[:n],
        )
    return StepResult(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs=step.prompt_logprobs or {},
    )
