# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5 as released (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`):
its text model served, its vision tower not read; logits against transformers' own multimodal
class on text-only input."""

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from models import load_model
from models.qwen3_next import Qwen3NextConfig
from models.registry import model_class
from tests.models.test_qwen3_next import ATOL, _caches
from tests.models.tiny_checkpoints import RTOL, hf_logits, prompts, run_step
from tests.models.tiny_qwen3_next import RELEASED, save_tiny_qwen3_5_multimodal

# The fast tier loads the dense release (Qwen3-Next's layers under the multimodal checkpoint's
# names); the MoE release is the slow tier's.
_FAST = "Qwen3_5ForConditionalGeneration"


@pytest.fixture(
    scope="module",
    params=[a if a == _FAST else pytest.param(a, marks=pytest.mark.slow) for a in sorted(RELEASED)],
)
def tiny(request, tmp_path_factory):
    import torch
    import transformers

    path = save_tiny_qwen3_5_multimodal(str(tmp_path_factory.mktemp("qwen3_5_mm")), request.param)
    config, model = load_model(path)
    hf = getattr(transformers, request.param).from_pretrained(path, dtype=torch.float32)
    return request.param, path, config, model, hf.eval()


def test_the_text_model_of_the_multimodal_checkpoint_is_served(tiny):
    architecture, path, config, model, _ = tiny
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert "text_config" in hf and "vision_config" in hf  # the released layout
    assert isinstance(config, Qwen3NextConfig) and config.architecture == architecture
    assert model_class(architecture) is model_class("Qwen3NextForCausalLM")
    assert config.state_layers == (0, 1, 2) and config.split_linear_projections
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        embedding = f.get_tensor("model.language_model.embed_tokens.weight")
    assert any(name.startswith("model.visual.") for name in names)  # there, and not read
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.embedding[...]), embedding)


@pytest.mark.slow  # Qwen3-Next's module: its forward is test_qwen3_next.py's fast prefill
def test_logits_match_transformers_multimodal_class_on_text(tiny):
    _, _, config, model, hf = tiny
    (ids,) = prompts([40], seed=40)
    logits, _ = run_step(model, _caches(config, model, 8), [ids], [0], [[5, 1, 2, 3, 4]])
    np.testing.assert_allclose(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)
