# SPDX-License-Identifier: Apache-2.0
"""EAGLE-1 speculative decoding (method 'eagle') through vLLM's real engine: vLLM reads the head's
Llama config as its `EagleLlamaForCausalLM` and schedules its drafts; greedy output equals
transformers' greedy decoding token for token (so equals decoding without speculation), for
prompts prefilled at once and in chunks, under preemption; the head (its own embedding and LM
head here; `tests/tpu_platform/test_eagle.py` shares the target's and checks its drafts against
a torch reference) drafts for every request, and vLLM's spec-decode counters agree with ours;
nothing compiles after warm-up."""

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.speculation_engine import greedy_run_equals_reference, strict_compile_engine
from tests.tiny_models import save_tiny_eagle_head, save_tiny_llama

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 24
K = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_llama(str(tmp_path_factory.mktemp("eagle_target")), seed=11, num_hidden_layers=2)
    head = save_tiny_eagle_head(
        str(tmp_path_factory.mktemp("eagle_head")), target, seed=12, own_embedding=True, own_lm_head=True
    )
    return target, head


@pytest.fixture(scope="module")
def llm(dirs):
    target, head = dirs
    # A 16-token step budget chunks every prompt; 12 pages of 16 tokens cannot hold four
    # sequences of ~50 tokens (and their lookahead slots) at once: the scheduler preempts.
    with strict_compile_engine(
        model=target, tokenizer=target, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=16, seed=0, disable_log_stats=False, num_gpu_blocks_override=12,
        speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K},
    ) as engine:  # fmt: skip
        yield engine


def test_greedy_with_an_eagle_head_equals_greedy_decoding(llm, dirs):
    hf = LlamaForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    # Prompts within the 16-token step budget prefill at once, the others in chunks.
    stats = greedy_run_equals_reference(llm, hf, NEW_TOKENS, lengths=(9, 15, 26, 31))
    assert stats["draft_tokens"] >= 4 * K  # every request drafted
    assert stats["preempted_requests"] > 0
