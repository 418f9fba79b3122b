# SPDX-License-Identifier: Apache-2.0
"""`models.serving_passes.use_native_norms`: where a tiny decoder's dense layers run on the native
CPU kernels, every RMSNorm (a pre-norm block's residual add and second norm as one call) runs as
the native call, and the logits equal those of the same prepared model on XLA's norms up to
bfloat16's rounding, with the same greedy tokens; a model on XLA's dots keeps XLA's norms."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model, pack_for_native_dense
from models.layer_stacks import stack_layer_weights
from models.layers import RMSNorm
from models.serving_passes import use_native_norms
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


def _prepared(path: str) -> tuple:
    config, model = load_model(path, jnp.bfloat16, on_host=True)
    pack_for_native_dense(model)
    stack_layer_weights(model)
    return config, model


def _logits(config, model) -> np.ndarray:
    from models.loader import put_on_device

    put_on_device(model)
    ids_a, ids_b = prompts([9, 5], seed=3)
    return np.asarray(run_step(model, caches(config), [ids_a, ids_b], [0, 0], [[1, 2], [3]])[0], np.float32)


def _norms(model: nnx.Module) -> list[RMSNorm]:
    return [module for _, module in nnx.iter_modules(model) if isinstance(module, RMSNorm)]


@pytest.mark.parametrize(
    "architecture",
    [
        "Qwen3ForCausalLM",  # pre-norm blocks, q and k norms over each head, stacked norm weights
        pytest.param("Gemma2ForCausalLM", marks=pytest.mark.slow),  # (1 + w) norms around each block
    ],
)
def test_native_norms_give_xla_norms_logits(dense_kernels, architecture, tmp_path):
    path = save_tiny(architecture, str(tmp_path / "model"))
    config, on_xla = _prepared(path)
    _, native = _prepared(path)
    assert use_native_norms(native) == len(_norms(native)) > 2 * config.num_layers
    assert all(norm.native for norm in _norms(native)) and not any(norm.native for norm in _norms(on_xla))
    want, got = _logits(config, on_xla), _logits(config, native)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_a_model_on_xla_dots_keeps_xla_norms(tmp_path):
    path = save_tiny("Qwen3ForCausalLM", str(tmp_path / "qwen3"))
    _, model = load_model(path, jnp.bfloat16, on_host=True)
    assert use_native_norms(model) == 0
    assert not any(norm.native for norm in _norms(model))
