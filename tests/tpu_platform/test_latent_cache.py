# SPDX-License-Identifier: Apache-2.0
"""The latent KV cache of multi-head latent attention (DeepSeek) in the runner's allocation and
the planner's arithmetic: one row of `kv_lora_rank + qk_rope_head_dim` values a token a layer,
stacked like every cache, whole on every chip of a mesh; the shipped DeepSeek configurations
have their published sizes."""

import jax
import jax.numpy as jnp
import pytest

from models.deepseek_config import DeepseekConfig
from tpu_platform.kv_cache import allocate_stacked_caches, model_kv_bytes_per_token
from tpu_platform.planner.abstract_weights import abstract_model
from tpu_platform.planner.kv import kv_bytes_read
from tpu_platform.planner.plan import StepSetup, kv_page_bytes, model_config


def test_latent_caches_stack_one_row_a_token():
    # 3 layers, 5 pages of 16 tokens, rows of 576 bfloat16 values; head arguments unused.
    arrays = jax.eval_shape(
        lambda: allocate_stacked_caches(3, 5, 16, 8, 192, jnp.bfloat16, "xla", latent_width=576)
    )
    assert [a.shape for a in arrays] == [(15, 16 * 576)]
    assert sum(a.size * a.dtype.itemsize for a in arrays) == 5 * 16 * 3 * 576 * 2


def test_deepseek_v3_token_costs_576_values_a_layer_whole_on_every_chip():
    config = model_config("deepseek-v3")
    assert isinstance(config, DeepseekConfig) and config.latent_cache_width == 512 + 64
    assert model_kv_bytes_per_token(config, 2) == 61 * 576 * 2
    setup = StepSetup(config, "v6e-8", tp_size=8, page_size=16)
    assert setup.kv_heads == 1 and setup.kv_heads_per_chip == 1
    # Every layer's page, on each chip, in the TPU kernel's layout: rows padded to 640 lanes.
    assert kv_page_bytes(setup) == 61 * 16 * 640 * 2
    assert kv_bytes_read(setup, 4, 1000) == 4 * 1000 * 61 * 576 * 2


def test_deepseek_v3_latent_page_is_576_values_a_token_on_gpu():
    # The Triton kernel's layout stores latent 512 and rope 64 as they are (powers of two).
    setup = StepSetup(model_config("deepseek-v3"), "h100x8", tp_size=8, page_size=16)
    assert kv_page_bytes(setup) == 61 * 16 * 576 * 2


@pytest.mark.slow  # the abstract shapes of 671B-class models take seconds to trace
def test_shipped_deepseek_configs_have_their_published_parameter_counts():
    # Model cards: DeepSeek-V2-Lite 15.7B, DeepSeek-V3 671B (without its 14B MTP module).
    for name, billions in (("deepseek-v2-lite", 15.7), ("deepseek-v3", 671.0)):
        weights = abstract_model(model_config(name), "bfloat16", 2048).weight_bytes
        assert abs(weights / 2e9 - billions) / billions < 0.005, (name, weights)
