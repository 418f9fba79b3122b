# SPDX-License-Identifier: Apache-2.0
"""The multi-token-prediction layer of tiny random DeepSeek-V3 and GLM-4.5 checkpoints
(`models.mtp`) against an independent torch computation of vLLM's formula
(`tests/mtp_reference.py`, its block transformers' own decoder layer): its output at every
position of a prefill (what its next step reads) and its drafts' logits, fed the same target
hidden states; the target's own load leaves the layer out; a
checkpoint without the layer's tensors, or of an architecture without MTP, is refused by name."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models import AttentionMetadata, ModelConfig, load_model
from models.fp8 import FP8_DTYPE
from models.mtp import load_mtp_head
from tests.models.fp8_checkpoints import dequantized_weights, write_block_fp8, write_float
from tests.models.tiny_checkpoints import PAGE, caches, prompts
from tests.models.tiny_deepseek import save_tiny_deepseek, save_tiny_deepseek_mtp, with_mtp_layer
from tests.models.tiny_glm4_moe import save_tiny_glm4_moe
from tests.mtp_reference import MtpReference

LENGTH = 21


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    glm = save_tiny_glm4_moe("qk_norm", str(tmp_path_factory.mktemp("glm_mtp")), seed=4, num_hidden_layers=4)
    return {
        "deepseek_v3": save_tiny_deepseek_mtp(str(tmp_path_factory.mktemp("mtp")), seed=4),
        "glm4_moe": with_mtp_layer(glm, seed=4),
    }


def prefill_head(head, config, tokens: list[int], hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The head over one sequence from position 0 (pages out of order): its outputs and logits."""
    n = len(tokens)
    pages = list(range(1, 1 + -(-n // PAGE)))[::-1]
    positions = np.arange(n)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(np.asarray(pages)[positions // PAGE] * PAGE + positions % PAGE, jnp.int32),
        kv_lens=jnp.asarray([n], jnp.int32),
        page_indices=jnp.asarray([pages], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        backend="xla",
    )
    (cache,) = caches(config, num_pages=8)[:1]
    combine = getattr(head, "combine", lambda h: h)  # a Qwen head reads them as they are
    out, _ = head(
        jnp.asarray(tokens, jnp.int32), combine(jnp.asarray(hidden)), jnp.asarray(positions), cache, md
    )
    return np.asarray(out), np.asarray(head.draft_logits(out))


@pytest.mark.parametrize("target", ["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_the_layer_computes_vllms_formula(checkpoints, target):
    import transformers

    path = checkpoints[target]
    with open(os.path.join(path, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    hf = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    reference = MtpReference(path, hf.eval())
    config, model = load_model(path)  # the target's own load skips the MTP layer's tensors
    assert len(model.model.layers) == config.num_layers == 3
    head = load_mtp_head(path, config, jnp.float32)
    head.share_embedding(model.model.embed_tokens.embedding[...])
    (history,) = prompts([LENGTH + 1], seed=9)
    hidden = reference.target_hidden(history)[:-1]  # position p: the target's state at p ...
    tokens = history[1:]  # ... and the token at p + 1
    out, logits = prefill_head(head, config, tokens, hidden.numpy())
    expected = reference.layer(tokens, hidden)
    # What the next step reads: DeepSeek's output after `shared_head.norm`, GLM's before it.
    recycled = reference.recycled(expected)
    np.testing.assert_allclose(out, recycled.numpy(), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(logits, reference.logits(expected).numpy(), atol=2e-3, rtol=2e-4)
    assert np.abs(out[0]).max() > 0  # position 0 reads only the hidden state, not nothing


def test_a_checkpoint_without_the_layers_tensors_is_refused_by_name(tmp_path):
    path = save_tiny_deepseek("v3_noaux_yarn", str(tmp_path / "plain"))  # transformers saved no MTP layer
    config, _ = load_model(path, on_host=True)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1  # transformers' default, tensors or not
    with pytest.raises(ValueError, match=r"holds no model\.layers\.3\.eh_proj"):
        load_mtp_head(path, config, jnp.float32)


def test_a_target_without_mtp_layers_is_refused_by_name(tmp_path):
    path = save_tiny_deepseek("v2_lite_greedy", str(tmp_path / "v2"))
    config, _ = load_model(path, on_host=True)
    with pytest.raises(ValueError, match="not supported by vllm-xla for DeepseekV2ForCausalLM"):
        load_mtp_head(path, config, jnp.float32)


@pytest.mark.slow  # programs of fp8 kernels of their own
def test_an_fp8_checkpoints_layer_loads_as_it_is(tmp_path):
    """DeepSeek-V3 as released: 128x128-block fp8 projections (the MTP layer's `eh_proj` and its
    block's included); the layer loads them as fp8 kernels with their scales and computes what
    the same layer with the dequantized weights does."""
    # Every quantized projection's inputs in whole 128-wide blocks.
    widths = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128,
                  kv_lora_rank=128, v_head_dim=32)  # fmt: skip
    source = save_tiny_deepseek_mtp(str(tmp_path / "source"), seed=2, **widths)
    quantized = write_block_fp8(source, str(tmp_path / "fp8"))
    weights = dequantized_weights(quantized)
    dequantized = write_float(source, str(tmp_path / "float"), weights)
    config = ModelConfig.from_pretrained(quantized)
    embedding = (
        np.random.default_rng(0).normal(size=(config.vocab_size, config.hidden_size)).astype(np.float32)
    )
    heads = [load_mtp_head(path, config, jnp.float32) for path in (quantized, dequantized)]
    for head in heads:
        head.share_embedding(jnp.asarray(embedding))
    assert heads[0].eh_proj.kernel[...].dtype == FP8_DTYPE
    assert heads[0].block.mlp.experts.gate_proj.kernel[...].dtype == FP8_DTYPE
    assert heads[0].block.self_attn.kv_b_proj.kernel[...].dtype == FP8_DTYPE
    (history,) = prompts([LENGTH + 1], seed=3)
    hidden = np.random.default_rng(1).normal(size=(LENGTH, config.hidden_size)).astype(np.float32)
    (got, got_logits), (expected, expected_logits) = [
        prefill_head(h, config, history[1:], hidden) for h in heads
    ]
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(got_logits, expected_logits, atol=2e-3, rtol=2e-4)
