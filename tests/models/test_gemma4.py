# SPDX-License-Identifier: Apache-2.0
"""Gemma 4's config facts on the tiny checkpoint (logit and greedy parity: test_architectures.py):
per-layer head dims and KV heads, the cache shape, KV-shared layers' sources, both spellings of
the full layers' shapes in config.json, proportional RoPE against transformers, and the variants
not built refused by name (the MoE block: test_gemma4_moe.py)."""

import json
import os

import numpy as np
import pytest

from models import ModelConfig
from models.gemma4_config import Gemma4Config
from models.registry import model_class
from models.rope import ProportionalRope
from tests.models.tiny_checkpoints import save_tiny

ARCH = "Gemma4ForCausalLM"


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("gemma4")))
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_layers_have_their_kind_s_shape_and_the_cache_the_widest(hf_config):
    config = ModelConfig.from_hf_dict(hf_config)
    assert isinstance(config, Gemma4Config)
    assert config.layer_sliding_windows == (10, None, 10, None)
    assert config.layer_head_dims == (16, 32, 16, 32)
    assert config.layer_kv_heads == (2, 1, 2, 1)
    assert (config.head_dim, config.num_kv_heads) == (32, 2)  # every layer's cache
    # The last two layers share: each reads the last earlier layer of its kind.
    assert [config.kv_source(i) for i in range(4)] == [0, 1, 0, 1]
    assert [config.mlp_size(i) for i in range(4)] == [128, 128, 256, 256]
    assert config.full_rope == ProportionalRope(20000.0, 0.5)


def test_global_head_dim_spelling_reads_as_per_layer_config(hf_config):
    """A config.json naming `global_head_dim` / `num_global_key_value_heads` (as released
    checkpoints do) describes the same layers as transformers' `per_layer_config`."""
    legacy = {k: v for k, v in hf_config.items() if k != "per_layer_config"}
    legacy.update(global_head_dim=32, num_global_key_value_heads=1)
    assert ModelConfig.from_hf_dict(legacy) == ModelConfig.from_hf_dict(hf_config)


@pytest.mark.parametrize("fraction,factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_proportional_rope_frequencies_match_transformers(fraction, factor):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "proportional",
        "partial_rotary_factor": fraction,
        "rope_theta": 1e6,
        "factor": factor,
    }
    hf = transformers.Gemma4TextConfig(
        head_dim=32, global_head_dim=64, rope_parameters={"full_attention": rope, "sliding_attention": None}
    )
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](hf, layer_type="full_attention")
    ours = ProportionalRope(1e6, fraction, factor).inverse_frequencies(64)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
    assert (ours == 0).sum() == 32 - int(fraction * 64 // 2)  # the pairs left unrotated


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}), "yarn"),
    ],
)
def test_variants_not_built_are_refused_by_name(hf_config, change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict({**hf_config, **change})


def test_multimodal_checkpoint_serves_the_text_model_class():
    """Gemma 4 is released as Gemma4ForConditionalGeneration; its text model is what we serve
    (tests/models/test_gemma4_multimodal.py checks the logits against transformers)."""
    assert model_class("Gemma4ForConditionalGeneration") is model_class("Gemma4ForCausalLM")


def test_lora_is_refused_at_start_by_name(hf_config):
    from models import build
    from models.lora import attach_lora

    model = build(ModelConfig.from_hf_dict(hf_config))
    with pytest.raises(ValueError, match="LoRA adapters are not supported on Gemma 4"):
        attach_lora(model, max_loras=1, max_rank=4, dtype=np.float32)


def test_shipped_planner_config_has_gemma_4_e2b_s_layers_and_parameters():
    """tpu_platform/planner/model_configs/gemma-4-e2b.json: 35 layers (every fifth full), the last 20
    reading layers 13 (sliding) and 14 (full), and the parameters its shapes add up to."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import build
    from tpu_platform.planner.plan import model_config

    config = model_config("gemma-4-e2b")
    assert sum(config.is_full(i) for i in range(35)) == 7 and config.is_full(34)
    assert {config.kv_source(i) for i in range(15, 35)} == {13, 14}
    assert (config.head_dim, config.num_kv_heads) == (512, 1)
    d, v, p, layers, f = 1536, 262_144, 256, 35, 6144
    expected = v * d + v * layers * p + d * layers * p + p + d  # embeddings, per-layer inputs, norm
    for i in range(layers):
        h = config.layer_head_dims[i]
        attention = 2 * d * 8 * h + h + (2 * d * h + h if i < 15 else 0)  # q, o, q_norm; k, v, k_norm
        mlp = 3 * d * f * (2 if i >= 15 else 1)  # double-wide on the KV-shared layers
        expected += attention + mlp + 5 * d + 2 * d * p + 1  # norms, per-layer gate/projection, scalar
    model = nnx.eval_shape(lambda: build(config, jnp.bfloat16))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(x.size for x in params) == expected  # about 5.03e9
