# SPDX-License-Identifier: Apache-2.0
"""A step's sampled tokens into the request table and the runner's `StepResult`."""

from __future__ import annotations

import numpy as np

from tpu_platform.batch_update import StepLogprobs, StepResult
from tpu_platform.inputs import StepPlan
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplerOutput


def record_step(
    table: RequestTable,
    plan: StepPlan,
    req_ids: list[str],
    out: SamplerOutput,
    prompt_logprobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None,
) -> StepResult:
    """Appends each emitting row's token to its history (as `plan.appends` says); a partial
    prefill chunk emits `[]`."""
    n = len(req_ids)
    tokens = np.asarray(out.sampled_token_ids)[:n]
    table.append(plan.appends, tokens)
    if plan.all_emit:
        sampled = [[t] for t in tokens.tolist()]
    else:
        emits = plan.emits_token.tolist()
        sampled = [[t] if e else [] for t, e in zip(tokens.tolist(), emits, strict=True)]
    logprobs = None
    if out.logprob_token_ids is not None:
        logprobs = StepLogprobs(
            token_ids=np.asarray(out.logprob_token_ids)[:n],
            logprobs=np.asarray(out.logprobs)[:n],
            ranks=np.asarray(out.sampled_token_ranks)[:n],
        )
    return StepResult(
        req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs or {}
    )
