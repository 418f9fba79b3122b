# SPDX-License-Identifier: Apache-2.0
"""A draft model on a hybrid target in the runner, with JAX alone (no vLLM): a tiny random Llama
(attention only) drafts for a tiny random Qwen3-Next (three Gated DeltaNet layers and one full
attention one, a KV-cache group each). The draft's cache follows the block tables of the target's
full-attention group (its state groups hold states, not tokens), so after a prompt prefilled in two
chunks and after each verification its drafts are its own greedy continuation (transformers on the
draft). The verified drafts keep none, one, all and again none of the target's greedy tokens: only
the target's state layers keep 1 + k blocks a request, and the output is the target's greedy
continuation token for token (transformers), with the hand-counted accepted drafts; nothing
compiles after warm-up."""

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3NextForCausalLM

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import VOCAB, prompts
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.speculation_driver import PROMPT_LEN, assert_verified_like_reference, speculating_runner
from tests.tiny_models import save_tiny_llama
from tpu_platform.step_program import KVLayout

pytestmark = pytest.mark.slow  # a hybrid target's programs and a draft's

K = 2


def test_a_draft_model_drafts_its_own_greedy_tokens_for_a_hybrid_target(tmp_path):
    target_dir = save_tiny_qwen3_next(str(tmp_path / "target"), seed=5)
    draft_dir = save_tiny_llama(
        str(tmp_path / "draft"), seed=4, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1,
    )  # fmt: skip
    layout = lambda runner: KVLayout.for_model(runner.model_config)  # noqa: E731
    runner = speculating_runner(target_dir, "draft_model", draft_dir, K, num_pages=16, layout=layout)
    assert runner.speculation.draft.cache_group == 3  # the three linear layers' groups, then the full one's
    target = Qwen3NextForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="eager"
    )
    draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    blocks = [[1 + g, 5 + g, 9 + g] for g in range(4)]  # the full group's KV pages; 1 + K state slots
    assert_verified_like_reference(
        runner, target.eval(), lambda history: hf_greedy(draft, history, K), prompt, K,
        keeps=(0, 1, K, 0), vocab=VOCAB, blocks=blocks,
    )  # fmt: skip
    assert runner.speculation.stats.accepted_tokens == 0 + 1 + K + 0
