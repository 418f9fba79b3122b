# SPDX-License-Identifier: Apache-2.0
"""The MTP proposer in the runner, with JAX alone (no vLLM): the multi-token-prediction layer of
a tiny random DeepSeek-V3 checkpoint proposes exactly what an independent torch reference of
vLLM's layer proposes on the target's final hidden states (transformers), after a prompt
prefilled in two chunks and after verification steps that kept some drafts and rejected others,
so its latent cache holds the right entries at the right positions and each next draft reads the
layer's own output; the verified steps' output is the target's greedy continuation; nothing
compiles after warm-up."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import VOCAB, prompts
from tests.models.tiny_deepseek import save_tiny_deepseek_mtp
from tests.mtp_reference import MtpReference
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.sampling import SamplingOptions
from tpu_platform.speculation import SpeculationConfig
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest, StepUpdate

pytestmark = pytest.mark.slow  # a DeepSeek target's programs, and the layer's two a step shape

K = 3
GREEDY = SamplingOptions(temperature=0.0)
PROMPT_LEN = 20
CHUNK = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("mtp")), seed=5)


@pytest.fixture(scope="module")
def runner(checkpoint):
    runner = Runner(
        RunnerConfig(
            model_path=checkpoint, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, page_size=16,
            native_dense=False, strict_compile=True,
            speculation=SpeculationConfig(num_tokens=K, method="mtp", draft_model=checkpoint),
        )
    )  # fmt: skip
    runner.load_model()
    runner.initialize_kv_cache(num_pages=8)
    shapes = {runner.buckets.shape_for(n, 1) for n in (CHUNK, PROMPT_LEN - CHUNK, 1 + K)}
    runner.warm_up(sorted(shapes))
    return runner


def _step(runner, num_tokens, *, new=None, computed=0, outputs=0, drafts=None):
    cached = [] if new else [CachedRequest("a", None, False, computed, outputs)]
    runner.execute(
        StepUpdate(
            new_requests=[new] if new else [],
            cached=CachedRequests.of(cached),
            finished_req_ids=set(),
            num_scheduled_tokens={"a": num_tokens},
            spec_tokens={"a": drafts} if drafts else {},
        )
    )
    result = runner.sample()
    proposed = runner.speculation.propose(runner.table, result.req_ids, result.sampled_token_ids)
    return result.sampled_token_ids[0], proposed[0]


def test_the_layer_proposes_what_the_reference_does_through_verification(runner, checkpoint):
    target = DeepseekV3ForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    target = target.eval()
    reference = MtpReference(checkpoint, target)
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    new = NewRequest("a", prompt, [[1, 2, 3, 4]], 0, GREEDY)
    out, drafts = _step(runner, CHUNK, new=new)
    assert out == [] and drafts == []  # a partial prefill chunk: the layer's pass only
    out, drafts = _step(runner, PROMPT_LEN - CHUNK, computed=CHUNK)
    history = [*prompt, *out]
    assert out == hf_greedy(target, prompt, 1)
    assert drafts == reference.drafts(history, K)
    # The layer's own drafts first, then drafts made to keep 3, 1 and 2 tokens (a random layer's
    # are rarely kept): it proposes from the right cache entries whatever was kept.
    for keep in (None, K, 1, 2):
        expected = hf_greedy(target, history, K + 1)
        if keep is not None:
            drafts = [*expected[:keep], *[(t + 1) % VOCAB for t in expected[keep:K]]]
        kept = next((i for i in range(K) if drafts[i] != expected[i]), K)
        computed, outputs = len(history) - 1, len(history) - PROMPT_LEN
        out, drafts = _step(runner, 1 + K, computed=computed, outputs=outputs, drafts=drafts)
        assert out == expected[: kept + 1]  # the target's greedy tokens, however many drafts held
        history += out
        assert drafts == reference.drafts(history, K)
    assert runner.speculation.stats.draft_tokens == 4 * K
    assert runner.speculation.stats.accepted_tokens >= K + 1 + 2
    assert runner.programs.compiles_after_warmup == 0
