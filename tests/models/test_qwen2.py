# SPDX-License-Identifier: Apache-2.0
"""Qwen2 against transformers fp32: logits (prefill, ragged mixed batch, sliding-window top layers)
and greedy generation through vLLM on our platform."""

import pytest

from models import ModelConfig
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)

ARCH = "Qwen2ForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("qwen2")))
    return (path, *load_pair(ARCH, path))


def test_prefill_logits_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


def test_vllm_greedy_matches_transformers(tiny):
    path, _, _, hf = tiny
    vllm_greedy_matches(path, hf, [7, 40, 25])


def test_sliding_window_top_layers_match_transformers(tmp_path):
    # use_sliding_window with max_window_layers=1: layer 0 full, layer 1 sliding (window 8 < 37 tokens).
    path = save_tiny(ARCH, str(tmp_path), use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config, model, hf = load_pair(ARCH, path)
    assert config.layer_sliding_windows == (None, 8) and config.sliding_window is None
    assert_prefill_matches(model, config, hf, 37)


def test_unused_sliding_window_is_ignored(tiny):
    _, config, _, _ = tiny
    assert config.layer_sliding_windows == (None, None)
    hf = {"architectures": [ARCH], "model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
          "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 1}  # fmt: skip
    assert ModelConfig.from_hf_dict(hf).layer_sliding_windows == (None, None)
