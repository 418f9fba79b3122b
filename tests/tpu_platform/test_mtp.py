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

from tests.models.tiny_checkpoints import VOCAB, prompts
from tests.models.tiny_deepseek import save_tiny_deepseek_mtp
from tests.mtp_reference import MtpReference
from tests.speculation_driver import PROMPT_LEN, assert_verified_like_reference, speculating_runner

pytestmark = pytest.mark.slow  # a DeepSeek target's programs, and the layer's two a step shape

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("mtp")), seed=5)


@pytest.fixture(scope="module")
def runner(checkpoint):
    return speculating_runner(checkpoint, "mtp", checkpoint, K)


def test_the_layer_proposes_what_the_reference_does_through_verification(runner, checkpoint):
    target = DeepseekV3ForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    target = target.eval()
    reference = MtpReference(checkpoint, target)
    (prompt,) = prompts([PROMPT_LEN], seed=6)
    # The layer's own drafts first, then drafts made to keep 3, 1 and 2 tokens (a random layer's
    # are rarely kept): it proposes from the right cache entries whatever was kept.
    assert_verified_like_reference(
        runner, target, lambda history: reference.drafts(history, K), prompt, K, keeps=(None, K, 1, 2),
        vocab=VOCAB,
    )  # fmt: skip
    assert runner.speculation.stats.draft_tokens == 4 * K
    assert runner.speculation.stats.accepted_tokens >= K + 1 + 2
