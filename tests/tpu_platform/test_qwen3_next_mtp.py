# SPDX-License-Identifier: Apache-2.0
"""The MTP proposer of a hybrid target in the runner, with JAX alone (no vLLM): the
multi-token-prediction layer of a tiny random Qwen3-Next checkpoint (`mtp.*`) proposes exactly
what an independent torch reference of vLLM's layer proposes on the target's final hidden states
(transformers), after a prompt prefilled in two chunks and after verification steps, so its KV
cache follows the block tables of the target's full-attention group (not its Gated DeltaNet
groups') at the right positions and each next draft reads the layer's own output. The verified
drafts keep none, one, all and again none of the target's greedy tokens: each Gated DeltaNet
layer keeps a state after each verified row (1 + k blocks a request) and the next step starts
after the last one kept, so the output is the target's greedy continuation token for token
(transformers), with the hand-counted accepted drafts; nothing compiles after warm-up."""

import pytest
import torch
from transformers import Qwen3NextForCausalLM

from tests.models.tiny_checkpoints import VOCAB, prompts
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp
from tests.qwen_mtp_reference import QwenMtpReference
from tests.speculation_driver import PROMPT_LEN, assert_verified_like_reference, speculating_runner

pytestmark = pytest.mark.slow  # a hybrid target's programs, and the layer's two a step shape

K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(str(tmp_path_factory.mktemp("qwen_mtp")), seed=5)


@pytest.fixture(scope="module")
def runner(checkpoint):
    from tpu_platform.step_program import KVLayout

    # The engine's grouping of 3 linear-attention layers and 1 full one: a group each; a request's
    # blocks in the full group are its KV pages, in the others its state slot.
    return speculating_runner(
        checkpoint,
        "mtp",
        checkpoint,
        K,
        num_pages=16,
        layout=lambda runner: KVLayout.for_model(runner.model_config),
    )


def test_the_layer_proposes_what_the_reference_does_through_verification(runner, checkpoint):
    target = Qwen3NextForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    target = target.eval()
    reference = QwenMtpReference(checkpoint, target)
    assert runner.speculation.draft.cache_group == 3  # the three linear layers' groups, then the full one's
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    # The full group's KV pages; each state group's 1 + K state slots.
    blocks = [[1 + g, 5 + g, 9 + g] for g in range(4)]
    assert_verified_like_reference(
        runner, target, lambda history: reference.drafts(history, K), prompt, K, keeps=(0, 1, K, 0),
        vocab=VOCAB, blocks=blocks,
    )  # fmt: skip
    assert runner.speculation.stats.accepted_tokens == 0 + 1 + K + 0
