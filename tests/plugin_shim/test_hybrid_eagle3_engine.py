# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 speculative decoding of a hybrid target through vLLM's real engine: a random head of
vLLM's layout reading two Gated DeltaNet layers' outputs and the full-attention one's of a tiny
random Qwen3-Next, whose state layers get 1 + k blocks a request from the engine. The random
head's drafts are mostly rejected, so most verifications leave rejected rows' states behind:
greedy output still equals transformers' greedy decoding token for token, with prompts prefilled
at once and in chunks, several requests at once; vLLM's spec-decode counters agree with ours;
nothing compiles after warm-up. (Drafts against the head's torch reference, and hand-counted
accepted drafts: tests/tpu_platform/test_hybrid_eagle3.py.)"""

import pytest
import torch
from transformers import Qwen3NextForCausalLM

from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.speculation_engine import greedy_run_equals_reference, strict_compile_engine
from tests.tiny_models import save_tiny_eagle3_head

pytestmark = pytest.mark.full  # builds vllm.LLM for a hybrid target and its head

NEW_TOKENS = 12
K = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_qwen3_next(str(tmp_path_factory.mktemp("hybrid")), seed=5)
    head = save_tiny_eagle3_head(
        str(tmp_path_factory.mktemp("head")), target, seed=7, aux_layer_ids=(1, 3, 4), draft_vocab_size=256
    )
    return target, head


@pytest.fixture(scope="module")
def llm(dirs):
    speculative = {"method": "eagle3", "model": dirs[1], "num_speculative_tokens": K}
    with strict_compile_engine(
        model=dirs[0], max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, block_size=16,
        seed=0, disable_log_stats=False, speculative_config=speculative,
    ) as engine:  # fmt: skip
        yield engine


def test_greedy_with_an_eagle3_head_on_a_hybrid_target_equals_greedy_decoding(llm, dirs):
    hf = Qwen3NextForCausalLM.from_pretrained(dirs[0], dtype=torch.float32, attn_implementation="eager")
    stats = greedy_run_equals_reference(llm, hf, NEW_TOKENS)
    assert stats["accepted_tokens"] < stats["draft_tokens"]  # rejected drafts' states were left behind
