# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding through vLLM's real engine on a tiny DeepSeek-V3 checkpoint with its
multi-token-prediction layer: vLLM maps method 'mtp' to the target's own checkpoint and schedules
the layer's drafts; greedy output equals transformers' greedy decoding token for token (so equals
decoding without speculation), for prompts prefilled at once and in chunks; the layer drafts for
every request and vLLM's spec-decode counters agree with ours; nothing compiles after warm-up.
(Preemption and the drafts' exact values: tests/tpu_platform/test_mtp.py and the EAGLE-3 engine
test, whose proposer programs these are.)"""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from tests.models.tiny_deepseek import save_tiny_deepseek_mtp
from tests.speculation_engine import greedy_run_equals_reference, strict_compile_engine

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 16
K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("mtp_target")), seed=21)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A 16-token step budget chunks the longest prompt; two sequences keep the programs few.
    with strict_compile_engine(
        model=checkpoint, tokenizer=checkpoint, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
        block_size=16, seed=0, disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    ) as engine:  # fmt: skip
        yield engine


def test_greedy_with_the_mtp_layer_equals_greedy_decoding(llm, checkpoint):
    hf = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    stats = greedy_run_equals_reference(llm, hf, NEW_TOKENS)
    assert stats["draft_tokens"] >= 3 * K  # every request drafted
