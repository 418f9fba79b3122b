# SPDX-License-Identifier: Apache-2.0
"""The draft-model proposer in the runner, with JAX alone (no vLLM): a draft of other shapes
(width, heads, head size, depth) than its target proposes exactly its own greedy continuation
(transformers on the draft), after a prompt and after a verification step that kept some drafts
and rejected the rest, so its cache holds the right tokens at the right positions; the verified
step's output is the target's greedy continuation; nothing compiles after warm-up."""

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.tiny_models import save_tiny_llama
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.sampling import SamplingOptions
from tpu_platform.speculation import SpeculationConfig
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest, StepUpdate

pytestmark = pytest.mark.slow  # two models' programs built and run: about a minute

K = 3
GREEDY = SamplingOptions(temperature=0.0)
PROMPT_LEN = 20


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_llama(str(tmp_path_factory.mktemp("target")), seed=3)
    draft = save_tiny_llama(
        str(tmp_path_factory.mktemp("draft")), seed=4, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
    )  # fmt: skip
    return target, draft


@pytest.fixture(scope="module")
def runner(dirs):
    target, draft = dirs
    runner = Runner(
        RunnerConfig(
            model_path=target, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=16,
            native_dense=False, strict_compile=True,
            speculation=SpeculationConfig(num_tokens=K, method="draft_model", draft_model=draft),
        )
    )  # fmt: skip
    runner.load_model()
    runner.initialize_kv_cache(num_pages=8)
    runner.warm_up([runner.buckets.shape_for(PROMPT_LEN, 1), runner.buckets.shape_for(1 + K, 1)])
    return runner


def _model(path):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_draft_proposes_its_own_greedy_continuation_before_and_after_verification(runner, dirs):
    target, draft = (_model(path) for path in dirs)
    (prompt,) = prompts([PROMPT_LEN], seed=5)
    runner.execute(
        StepUpdate(
            new_requests=[NewRequest("a", prompt, [[1, 2, 3]], 0, GREEDY)],
            cached=CachedRequests.of([]),
            finished_req_ids=set(),
            num_scheduled_tokens={"a": PROMPT_LEN},
        )
    )
    result = runner.sample()
    (first,) = result.sampled_token_ids[0]
    assert first == hf_greedy(target, prompt, 1)[0]
    (drafts,) = runner.speculation.propose(runner.table, result.req_ids, result.sampled_token_ids)
    assert drafts == hf_greedy(draft, [*prompt, first], K)

    # The target's own continuation decides: the output is its greedy tokens either way.
    runner.execute(
        StepUpdate(
            new_requests=[],
            cached=CachedRequests.of([CachedRequest("a", None, False, PROMPT_LEN, 1)]),
            finished_req_ids=set(),
            num_scheduled_tokens={"a": 1 + K},
            spec_tokens={"a": drafts},
        )
    )
    result = runner.sample()
    (out,) = result.sampled_token_ids
    expected = hf_greedy(target, [*prompt, first], K + 1)
    kept = next((i for i in range(K) if drafts[i] != expected[i]), K)
    assert out == expected[: kept + 1]
    (drafts,) = runner.speculation.propose(runner.table, result.req_ids, result.sampled_token_ids)
    assert drafts == hf_greedy(draft, [*prompt, first, *out], K)
    assert runner.programs.compiles_after_warmup == 0
