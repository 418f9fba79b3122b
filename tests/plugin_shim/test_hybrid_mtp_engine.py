# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding of a hybrid target through vLLM's real engine: a tiny random
Qwen3-Next checkpoint with its multi-token-prediction layer, whose Gated DeltaNet layers get
1 + k state blocks a request from the engine (`MambaSpec.num_speculative_blocks`). The random
layer's drafts are mostly rejected, so most verifications leave rejected rows' states behind:
greedy output still equals transformers' greedy decoding token for token (decoding without
speculation), with prompts prefilled at once and in chunks, several requests at once; vLLM's
spec-decode counters agree with ours; nothing compiles after warm-up. (The accepted and rejected
counts of hand-made drafts: tests/tpu_platform/test_qwen3_next_mtp.py.)"""

import pytest
import torch
from transformers import Qwen3NextForCausalLM

from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp
from tests.speculation_engine import greedy_run_equals_reference, strict_compile_engine

pytestmark = pytest.mark.full  # builds vllm.LLM for a hybrid target and its layer

NEW_TOKENS = 12
K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(str(tmp_path_factory.mktemp("hybrid_mtp")), seed=5)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with strict_compile_engine(
        model=checkpoint, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, block_size=16,
        seed=0, disable_log_stats=False, speculative_config={"method": "mtp", "num_speculative_tokens": K},
    ) as engine:  # fmt: skip
        yield engine


def test_greedy_with_mtp_drafts_equals_greedy_decoding(llm, checkpoint):
    hf = Qwen3NextForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    stats = greedy_run_equals_reference(llm, hf, NEW_TOKENS)
    assert stats["accepted_tokens"] < stats["draft_tokens"]  # rejected drafts' states were left behind
