# SPDX-License-Identifier: Apache-2.0
"""The MTP proposer of a hybrid target in the runner, with JAX alone (no vLLM): the
multi-token-prediction layer of a tiny random Qwen3-Next checkpoint (`mtp.*`) proposes exactly
what an independent torch reference of vLLM's layer proposes on the target's final hidden states
(transformers), after a prompt prefilled in two chunks and after verification steps, so its KV
cache follows the block tables of the target's full-attention group (not its Gated DeltaNet
groups') at the right positions and each next draft reads the layer's own output; the verified
steps' output is the target's greedy continuation; nothing compiles after warm-up. The verified
drafts are the target's own greedy tokens: a rejected draft would stay in the target's Gated
DeltaNet state (which the engine refuses to serve: `plugin_shim.feature_check`)."""

import pytest
import torch
from transformers import Qwen3NextForCausalLM

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp
from tests.qwen_mtp_reference import QwenMtpReference
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.sampling import SamplingOptions
from tpu_platform.speculation import SpeculationConfig
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest, StepUpdate

pytestmark = pytest.mark.slow  # a hybrid target's programs, and the layer's two a step shape

K = 2
GREEDY = SamplingOptions(temperature=0.0)
PROMPT_LEN = 20
CHUNK = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(str(tmp_path_factory.mktemp("qwen_mtp")), seed=5)


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
    # The engine's grouping of 3 linear-attention layers and 1 full one: a group each; a request's
    # blocks in the full group are its KV pages, in the others its state slot.
    runner.initialize_kv_cache(num_pages=16, layout=_layout(runner))
    shapes = {runner.buckets.shape_for(n, 1) for n in (CHUNK, PROMPT_LEN - CHUNK, 1 + K)}
    runner.warm_up(sorted(shapes))
    return runner


def _layout(runner):
    from tpu_platform.step_program import KVLayout

    return KVLayout.for_model(runner.model_config)


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
    target = Qwen3NextForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    target = target.eval()
    reference = QwenMtpReference(checkpoint, target)
    assert runner.speculation.draft.cache_group == 3  # the three linear layers' groups, then the full one's
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    # Block 0 of every group: the full group's first KV page, each state group's slot.
    blocks = [[1 + g, 5 + g, 9 + g] if g == 3 else [1 + g] for g in range(4)]
    new = NewRequest("a", prompt, blocks, 0, GREEDY)
    out, drafts = _step(runner, CHUNK, new=new)
    assert out == [] and drafts == []  # a partial prefill chunk: the layer's pass only
    out, drafts = _step(runner, PROMPT_LEN - CHUNK, computed=CHUNK)
    history = [*prompt, *out]
    assert out == hf_greedy(target, prompt, 1)
    assert drafts == reference.drafts(history, K)
    for _ in range(3):
        expected = hf_greedy(target, history, K + 1)
        computed, outputs = len(history) - 1, len(history) - PROMPT_LEN
        out, drafts = _step(runner, 1 + K, computed=computed, outputs=outputs, drafts=expected[:K])
        assert out == expected  # every draft kept, and the target's next token
        history += out
        assert drafts == reference.drafts(history, K)
    assert runner.speculation.stats.accepted_tokens == 3 * K
    assert runner.programs.compiles_after_warmup == 0
