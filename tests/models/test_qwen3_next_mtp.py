# SPDX-License-Identifier: Apache-2.0
"""The multi-token-prediction layer of tiny random Qwen3-Next and Qwen3.5 checkpoints
(`models.qwen3_next_mtp`) against an independent torch computation of vLLM's formula
(`tests/qwen_mtp_reference.py`, its block transformers' own full-attention decoder layer): its
output at every position of a prefill (what its next step reads) and its drafts' logits by the
target's LM head, fed the same target hidden states; the target's own load leaves the layer out;
a checkpoint without the layer's tensors is refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models import load_model
from models.qwen3_next_mtp import load_qwen_mtp_head
from tests.models.test_mtp import prefill_head
from tests.models.tiny_checkpoints import prompts
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next, save_tiny_qwen3_next_mtp
from tests.qwen_mtp_reference import QwenMtpReference

LENGTH = 21


@pytest.mark.parametrize(
    "architecture",
    [pytest.param(a, marks=pytest.mark.slow) for a in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")],
)  # the fast tier's MTP layer is DeepSeek-V3's (test_mtp.py)
def test_the_layer_computes_vllms_formula(tmp_path, architecture):
    import transformers

    path = save_tiny_qwen3_next_mtp(str(tmp_path / "ckpt"), seed=4, architecture=architecture)
    hf = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    reference = QwenMtpReference(path, hf.eval())
    config, model = load_model(path)  # the target's own load skips the MTP layer's tensors
    assert len(model.model.layers) == config.num_layers == 4
    head = load_qwen_mtp_head(path, config, jnp.float32)
    head.share_embedding(model.model.embed_tokens.embedding[...])
    head.share_lm_head(model)
    (history,) = prompts([LENGTH + 1], seed=9)
    hidden = reference.target_hidden(history)[:-1]  # position p: the target's state at p ...
    tokens = history[1:]  # ... and the token at p + 1
    out, logits = prefill_head(head, config, tokens, hidden.numpy())
    expected = reference.layer(tokens, hidden)
    np.testing.assert_allclose(out, expected.numpy(), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(logits, reference.logits(expected).numpy(), atol=2e-3, rtol=2e-4)


def test_a_checkpoint_without_the_layers_tensors_is_refused_by_name(tmp_path):
    path = save_tiny_qwen3_next(str(tmp_path / "plain"), mtp_num_hidden_layers=1)  # no mtp.* tensors
    config, _ = load_model(path, on_host=True)
    with pytest.raises(ValueError, match=r"holds no mtp\.fc tensor"):
        load_qwen_mtp_head(path, config, jnp.float32)
