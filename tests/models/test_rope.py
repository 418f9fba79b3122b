# SPDX-License-Identifier: Apache-2.0
"""RoPE: the per-position tables against hand-worked values, gathered rotations against
computed ones, and llama3 scaling against transformers."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.rope import Rope, RopeTable, apply_rope, rope_cos_sin, rope_inverse_frequencies, rope_table


def test_table_rows_hold_the_cosines_then_the_sines_of_each_position():
    # head dim 4, base 100: inverse frequencies 1 and 100 ** -0.5 = 0.1.
    table = rope_table(Rope(100.0), 4, 3)
    expected = [[np.cos(p), np.cos(0.1 * p), np.sin(p), np.sin(0.1 * p)] for p in range(3)]
    np.testing.assert_allclose(table, expected, rtol=1e-6, atol=1e-7)
    assert table.dtype == np.float32 and table.shape == (3, 4)


def test_gathered_rotations_equal_computed_ones_at_every_position():
    rope, head_dim = Rope(10000.0), 64
    inv_freq = rope.inverse_frequencies(head_dim)
    positions = jnp.asarray([0, 1, 17, 255, 4000, 8191], jnp.int32)
    table = RopeTable(rope_table(rope, head_dim, 8192))
    gathered = rope_cos_sin(positions, inv_freq, table)
    computed = rope_cos_sin(positions, inv_freq)
    for got, want in zip(gathered, computed, strict=True):
        assert got.shape == (6, 32)
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_rotation_turns_each_pair_by_its_angle():
    # One head of dim 2: (x1, x2) at angle a becomes (x1 cos a - x2 sin a, x2 cos a + x1 sin a).
    x = jnp.asarray([[[1.0, 0.0]], [[0.0, 2.0]]])  # [T=2, 1 head, 2]
    a = np.array([[np.pi / 2], [np.pi]], np.float32)
    out = apply_rope(x, jnp.cos(a), jnp.sin(a))
    np.testing.assert_allclose(out, [[[0.0, 1.0]], [[0.0, -2.0]]], atol=1e-6)


@pytest.mark.parametrize("high_freq_factor", [4.0, 1.0])  # 1.0: no band between (Llama 4 Scout)
def test_llama3_frequencies_match_transformers(high_freq_factor):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
        "high_freq_factor": high_freq_factor, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    config = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    got = rope_inverse_frequencies(128, config.rope_theta, config.rope_scaling)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6)
