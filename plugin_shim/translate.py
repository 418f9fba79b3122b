# SPDX-License-Identifier: Apache-2.0
"""Translation between vLLM's scheduler/sampling types and the runner's plain types."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput

from plugin_shim.pooling import pooling_options
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import CachedRequests, NewRequest, StepResult, StepUpdate

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

# SamplingParams fields we cannot honour, with the value that means "not used".
_UNSUPPORTED = {
    "watermarking": (None, False),
    "logprob_token_ids": (None,),
    "prompt_logprob_start": (None, 0),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
}


def sampling_options(params: SamplingParams) -> SamplingOptions:
    """Our `SamplingOptions` for vLLM `params`; a ValueError names anything unsupported."""
    for name, unused in _UNSUPPORTED.items():
        value = getattr(params, name, None)
        if value not in unused:
            raise ValueError(f"SamplingParams.{name}={value!r} is not supported by vllm-xla; leave it unset")
    # vLLM suppresses `all_stop_token_ids` (stop ids, plus EOS unless ignore_eos) before min_tokens.
    stop_ids = params.all_stop_token_ids or set(params.stop_token_ids or ())
    return SamplingOptions(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        allowed_token_ids=tuple(params.allowed_token_ids) if params.allowed_token_ids else None,
        bad_words_token_ids=tuple(tuple(w) for w in params.bad_words_token_ids or ()),
        min_tokens=params.min_tokens,
        stop_token_ids=tuple(sorted(stop_ids)),
        seed=params.seed,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        structured_output=params.structured_outputs is not None,
    )


def refuse_oversized_sampling(params: SamplingParams) -> None:
    """Raises a ValueError for `params` the runner cannot serve from its warmed programs: an
    unsupported option, or more logit_bias / min_tokens stop ids / bad words than its sparse list
    holds (before tokenization each bad word counts twice: vLLM bans it with and without a
    leading space)."""
    options = sampling_options(params)
    untokenized = 2 * len(params.bad_words or ())
    options.check_sparse_entries(max(len(options.bad_words_token_ids), untokenized))


# A pooling request's options: its argmax is recorded like a greedy request's token (no sampler runs).
POOLING_SAMPLING = SamplingOptions(temperature=0.0)


def step_update(so: SchedulerOutput) -> StepUpdate:
    """The runner's view of one `SchedulerOutput` (single KV-cache group).

    Continuing requests pass through as vLLM's own columns (no object per request): block id
    lists are read, never kept, and the scheduler builds them anew each step.
    """
    new = [
        NewRequest(
            req_id=r.req_id,
            prompt_token_ids=r.prompt_token_ids or [],
            block_ids=[list(ids) for ids in r.block_ids],
            num_computed_tokens=r.num_computed_tokens,
            sampling=POOLING_SAMPLING if r.sampling_params is None else sampling_options(r.sampling_params),
            lora_id=r.lora_request.lora_int_id if r.lora_request is not None else 0,
            pooling=None if r.pooling_params is None else pooling_options(r.pooling_params),
        )
        for r in so.scheduled_new_reqs
    ]
    c = so.scheduled_cached_reqs
    return StepUpdate(
        new_requests=new,
        cached=CachedRequests(
            req_ids=c.req_ids,
            new_block_ids=c.new_block_ids,
            resumed_req_ids=c.resumed_req_ids,
            num_computed_tokens=c.num_computed_tokens,
            num_output_tokens=c.num_output_tokens,
        ),
        finished_req_ids=so.finished_req_ids,
        num_scheduled_tokens=so.num_scheduled_tokens,
        preempted_req_ids=so.preempted_req_ids or frozenset(),
        spec_tokens=so.scheduled_spec_decode_tokens,
        num_spec_tokens=so.num_spec_tokens_to_schedule,
    )


def grammar_bitmasks(
    grammar: GrammarOutput | None, spec_tokens: dict[str, list[int]] | None = None
) -> dict[str, np.ndarray]:
    """Request id -> its packed allowed-token bitmask rows, `[1 + n, W]` for a request with n
    scheduled drafts (`spec_tokens`, the step's): vLLM's scheduler fills one row for each draft's
    position and one after them, request after request."""
    if grammar is None:
        return {}
    spec_tokens, masks, start = spec_tokens or {}, {}, 0
    for rid in grammar.structured_output_request_ids:
        end = start + 1 + len(spec_tokens.get(rid, ()))
        masks[rid] = grammar.grammar_bitmask[start:end]
        start = end
    return masks


def model_runner_output(result: StepResult) -> ModelRunnerOutput:
    """vLLM's `ModelRunnerOutput` for a runner step."""
    if not result.req_ids:
        return EMPTY_MODEL_RUNNER_OUTPUT
    logprobs = None
    if result.logprobs is not None:
        lp = result.logprobs
        logprobs = LogprobsLists(lp.token_ids, lp.logprobs, lp.ranks, lp.cu_num_generated)
    return ModelRunnerOutput(
        req_ids=result.req_ids,
        req_id_to_index=dict(zip(result.req_ids, range(len(result.req_ids)), strict=True)),
        sampled_token_ids=result.sampled_token_ids,
        logprobs=logprobs,
        prompt_logprobs_dict={
            req_id: LogprobsTensors(torch.from_numpy(ids), torch.from_numpy(lps), torch.from_numpy(ranks))
            for req_id, (ids, lps, ranks) in result.prompt_logprobs.items()
        },
    )
