# SPDX-License-Identifier: Apache-2.0
"""Tiny random DeepSeek-V2 and V3 checkpoints against transformers fp32: logits at every position
of a prefill and of a ragged batch (prefills, then decodes and a 2-token chunk), one checkpoint per
routing variant:

- V2-Lite's shape: full-rank queries, softmax greedy top-k, a dense first layer;
- V2 with low-rank queries and group-limited greedy routing (4 groups, the best one kept: the
  top 2 then often differ from the unrestricted top 2) and a routed scaling factor;
- V3: low-rank queries, sigmoid scores with a (random, non-zero) correction bias, group top-k,
  normalized weights, routed scaling, YaRN RoPE with DeepSeek's mscale (both factors differ from
  1), interleaved rope dimensions;
- V3 with rope dimensions rotated as halves (`rope_interleave=False`).

Plus the config's parsing and the MTP layers a checkpoint carries being skipped on load.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from models import ModelConfig, load_model
from models.deepseek_config import DeepseekConfig
from models.rope import YarnScaling
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
)
from tests.models.tiny_deepseek import _COMMON, VARIANTS, YARN, save_tiny_deepseek

# The fast tier builds one variant, V3 (query LoRA, noaux routing, YaRN: the most code paths); the
# others differ in routing, rotation and the query projection, which the slow tier checks.
_FAST = ("v3_noaux_yarn",)


@pytest.fixture(
    scope="module",
    params=[v if v in _FAST else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
    ids=list(VARIANTS),
)
def tiny(request, tmp_path_factory):
    """(variant, path, config, model, hf), built once per variant."""
    import torch
    import transformers

    variant = request.param
    path = save_tiny_deepseek(variant, str(tmp_path_factory.mktemp(variant)))
    config, model = load_model(path)
    hf = getattr(transformers, VARIANTS[variant][0]).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return variant, path, config, model, hf.eval()


# The ragged batch runs on V2-Lite and V3 (every op of a step; V3 alone in the fast tier); the
# other two variants differ in routing and rotation only, which the prefill checks at every position.
_RAGGED = ("v2_lite_greedy", "v3_noaux_yarn")
# The prefill alone, for the variants the fast tier's ragged batch leaves out: the ragged batch
# checks every position of its three prefills (`assert_ragged_matches`).
_PREFILL = [
    v if v in _FAST else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS if v not in _RAGGED
]


@pytest.mark.parametrize("tiny", _PREFILL, indirect=True)
def test_prefill_logits_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


@pytest.mark.parametrize(
    "tiny",
    [v if v in _FAST and v in _RAGGED else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
    ids=list(VARIANTS),
    indirect=True,
)
def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


def test_config_reads_latent_attention_and_routing(tiny):
    variant, path, config, _, _ = tiny
    assert isinstance(config, DeepseekConfig)
    assert config.latent_cache_width == 32 + 8
    assert config.head_dim == 16 + 8
    assert [config.is_moe_layer(i) for i in range(3)] == (
        [True] * 3 if variant == "v3_rope_halves" else [False, True, True]
    )
    expected = {
        "v2_lite_greedy": ("greedy", "softmax", None),
        "v2_group_limited": ("group_limited_greedy", "softmax", 24),
        "v3_noaux_yarn": ("noaux_tc", "sigmoid", 24),
        "v3_rope_halves": ("noaux_tc", "sigmoid", 24),
    }[variant]
    assert (config.topk_method, config.scoring_func, config.q_lora_rank) == expected
    assert (config.yarn is not None) == (variant == "v3_noaux_yarn")
    with open(os.path.join(path, "config.json")) as f:
        assert ModelConfig.from_hf_dict(json.load(f)) == config


def test_yarn_frequencies_and_mscale_match_transformers():
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = DeepseekV3Config(**{**_COMMON, "rope_parameters": YARN})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    hf_dict = {**hf_config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    yarn = DeepseekConfig.from_hf_dict(hf_dict).yarn
    assert isinstance(yarn, YarnScaling)
    np.testing.assert_allclose(yarn.inverse_frequencies(8, 10000.0), inv_freq.numpy(), rtol=1e-6)
    assert yarn.rope_scale == pytest.approx(attention_factor)
    # transformers' softmax scale: qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
    assert yarn.softmax_scale == pytest.approx((0.1 * 0.8 * np.log(4.0) + 1.0) ** 2)


def test_multi_token_prediction_layer_is_skipped_on_load(tmp_path):
    # A checkpoint with one more layer than num_hidden_layers says (as V3's MTP layer is stored).
    import torch
    from safetensors.torch import load_file, save_file

    path = save_tiny_deepseek("v2_lite_greedy", str(tmp_path / "ckpt"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 28, 32)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config, model = load_model(path, on_host=True)
    assert config.num_layers == len(model.model.layers) == 3
    kernel = np.asarray(model.model.layers[2].self_attn.kv_b_proj.kernel[...])
    np.testing.assert_array_equal(kernel, tensors["model.layers.2.self_attn.kv_b_proj.weight"].numpy().T)
