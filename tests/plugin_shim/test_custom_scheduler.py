# SPDX-License-Identifier: Apache-2.0
"""vLLM's `scheduler_cls` runs unchanged on our platform: a subclass of vLLM's v1 `Scheduler`
that serves the longest prompt first (a priority tweak) drives the engine, in its order, and
the greedy tokens still equal transformers'."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.core.sched.scheduler import Scheduler

from tests.greedy_reference import hf_greedy
from tests.tiny_models import save_tiny_llama

NEW_TOKENS = 6


class LongestPromptFirst(Scheduler):
    """vLLM's scheduler under its priority policy, a request's priority being minus its prompt
    length; records the prompt lengths of the requests in the order they were first scheduled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_scheduled: list[int] = []

    def add_request(self, request) -> None:
        request.priority = -request.num_prompt_tokens
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        self.first_scheduled += [len(new.prompt_token_ids) for new in output.scheduled_new_reqs]
        return output


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("scheduler_llama")), seed=2)


@pytest.mark.slow
def test_a_custom_scheduler_class_orders_the_requests_and_tokens_stay_exact(tiny_dir):
    rng = np.random.default_rng(2)
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (4, 30, 11, 21)]
    llm = LLM(
        model=tiny_dir, max_model_len=128, max_num_seqs=1, block_size=16, seed=0,
        scheduler_cls=LongestPromptFirst, scheduling_policy="priority",
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    finally:
        del llm
        gc.collect()
    assert type(scheduler) is LongestPromptFirst
    # One request at a time, longest prompt first (vLLM's own order would be arrival order).
    assert scheduler.first_scheduled == [30, 21, 11, 4]
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert [list(o.outputs[0].token_ids) for o in out] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
