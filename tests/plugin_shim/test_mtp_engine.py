# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding through vLLM's real engine on a tiny DeepSeek-V3 checkpoint with its
multi-token-prediction layer: vLLM maps method 'mtp' to the target's own checkpoint and schedules
the layer's drafts; greedy output equals transformers' greedy decoding token for token (so equals
decoding without speculation), for prompts prefilled at once and in chunks; the layer drafts for
every request and vLLM's spec-decode counters agree with ours; nothing compiles after warm-up.
(Preemption and the drafts' exact values: tests/tpu_platform/test_mtp.py and the EAGLE-3 engine
test, whose proposer programs these are.)"""

import gc

import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy
from tests.models.tiny_deepseek import save_tiny_deepseek_mtp

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 16
K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("mtp_target")), seed=21)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A 16-token step budget chunks the longest prompt; two sequences keep the programs few.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    engine = LLM(
        model=checkpoint, tokenizer=checkpoint, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
        block_size=16, seed=0, disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()
    mp.undo()


def _spec_counters(llm):
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}
    return metrics["vllm:spec_decode_num_draft_tokens"].value, metrics[
        "vllm:spec_decode_num_accepted_tokens"
    ].value


def test_greedy_with_the_mtp_layer_equals_greedy_decoding(llm, checkpoint):
    hf = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    rng = np.random.default_rng(0)
    # Prompts within the 16-token step budget prefill at once, the others in chunks.
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (9, 15, 26)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    expected = [hf_greedy(hf.eval(), p, NEW_TOKENS) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["draft_tokens"] >= len(prompts) * K  # every request drafted
    assert stats["verified_steps"] > 0
    vllm_drafted, vllm_accepted = _spec_counters(llm)
    assert vllm_accepted == stats["accepted_tokens"]
    assert vllm_drafted >= stats["draft_tokens"]
    assert stats["partial_prefill_steps"] > 0
    assert stats["compiles_after_warmup"] == 0
