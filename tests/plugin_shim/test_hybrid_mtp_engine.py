# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding of a hybrid target through vLLM's real engine: a tiny random
Qwen3-Next checkpoint with its multi-token-prediction layer, whose Gated DeltaNet layers get
1 + k state blocks a request from the engine (`MambaSpec.num_speculative_blocks`). The random
layer's drafts are mostly rejected, so most verifications leave rejected rows' states behind:
greedy output still equals transformers' greedy decoding token for token (decoding without
speculation), with prompts prefilled at once and in chunks, several requests at once; vLLM's
spec-decode counters agree with ours; nothing compiles after warm-up. (The accepted and rejected
counts of hand-made drafts: tests/tpu_platform/test_qwen3_next_mtp.py.)"""

import gc

import numpy as np
import pytest
import torch
from transformers import Qwen3NextForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp

pytestmark = pytest.mark.full  # builds vllm.LLM for a hybrid target and its layer

NEW_TOKENS = 12
K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(str(tmp_path_factory.mktemp("hybrid_mtp")), seed=5)


@pytest.fixture(scope="module")
def llm(checkpoint):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    engine = LLM(
        model=checkpoint, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, block_size=16,
        seed=0, disable_log_stats=False, speculative_config={"method": "mtp", "num_speculative_tokens": K},
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


def test_greedy_with_mtp_drafts_equals_greedy_decoding(llm, checkpoint):
    hf = Qwen3NextForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    rng = np.random.default_rng(0)
    # Prompts within the 16-token step budget prefill at once, the others in chunks.
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (9, 15, 26)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    expected = [hf_greedy(hf.eval(), p, NEW_TOKENS) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["verified_steps"] > 0
    assert stats["accepted_tokens"] < stats["draft_tokens"]  # rejected drafts' states were left behind
    vllm_drafted, vllm_accepted = _spec_counters(llm)
    assert vllm_accepted == stats["accepted_tokens"]
    assert vllm_drafted >= stats["draft_tokens"]
    assert stats["partial_prefill_steps"] > 0
    assert stats["compiles_after_warmup"] == 0
