# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 as released (`Gemma4ForConditionalGeneration`): its text model served, its vision
tower not read; logits against transformers' own multimodal class on text-only input."""

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from models import load_model
from models.gemma4_config import Gemma4Config
from models.registry import model_class
from tests.models.tiny_checkpoints import _COMMON, TINY, VOCAB, assert_prefill_matches, spread_parameters
from tests.tiny_models import save_tokenizer

ARCH = "Gemma4ForConditionalGeneration"


def save_tiny_gemma4_multimodal(path: str, *, seed: int = 0) -> str:
    """A random tiny Gemma 4 text model (the tiny `Gemma4ForCausalLM`'s config) under a small
    vision tower, saved by transformers' `Gemma4ForConditionalGeneration`."""
    import torch
    import transformers

    text = transformers.Gemma4TextConfig(**{**_COMMON, **TINY["Gemma4ForCausalLM"][1]})
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, position_embedding_size=64,
    )  # fmt: skip
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    config.architectures = [ARCH]
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32)
    spread_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    import transformers

    path = save_tiny_gemma4_multimodal(str(tmp_path_factory.mktemp("gemma4_mm")))
    config, model = load_model(path)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return path, config, model, hf.eval()


def test_the_text_model_of_the_multimodal_checkpoint_is_served(tiny):
    path, config, model, _ = tiny
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert "text_config" in hf and "vision_config" in hf  # the released layout
    assert isinstance(config, Gemma4Config) and model_class(ARCH) is model_class("Gemma4ForCausalLM")
    assert config.num_layers == 4 and config.layer_head_dims == (16, 32, 16, 32)
    assert config.num_kv_shared_layers == 2 and config.per_layer_input_size == 8
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        embedding = f.get_tensor("model.language_model.embed_tokens.weight")
    assert any(name.startswith("model.vision_tower.") for name in names)  # there, and not read
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.embedding[...]), embedding)


@pytest.mark.slow  # a second Gemma 4 forward (fast: test_architectures.py)
def test_logits_match_transformers_multimodal_class_on_text(tiny):
    _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 24)
