# SPDX-License-Identifier: Apache-2.0
"""`models.layer_stacks`: a tiny decoder's packed kernels (bfloat16, int8, affine int4) and norm
weights stacked across its layers give the same logits, bit for bit, as the same model with
per-layer arrays, through fewer state leaves; a model on XLA's dots (as on TPU and GPU) is left
as it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model, pack_for_native_dense
from models.layer_stacks import stack_layer_weights
from models.linear import Linear, PackedKernel
from models.loader import put_on_device
from models.quantization import quantize_int4, quantize_int8
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


def _prepared(path: str, quantize: str) -> tuple:
    config, model = load_model(path, jnp.bfloat16, on_host=True)
    if quantize == "int8":
        quantize_int8(model)
    elif quantize == "int4":
        quantize_int4(model, 32, "cpu_native", affine=True)
    pack_for_native_dense(model, int4=quantize == "int4")
    return config, model


def _logits(config, model) -> np.ndarray:
    put_on_device(model)
    ids_a, ids_b = prompts([9, 5], seed=2)
    return run_step(model, caches(config), [ids_a, ids_b], [0, 0], [[1, 2], [3]])[0]


@pytest.mark.parametrize(
    "quantize",
    ["bfloat16", pytest.param("int8", marks=pytest.mark.slow), pytest.param("int4", marks=pytest.mark.slow)],
)
def test_stacked_layers_give_the_per_layer_logits_through_fewer_arguments(dense_kernels, quantize, tmp_path):
    path = save_tiny("Qwen3ForCausalLM", str(tmp_path / "qwen3"))  # q and k norms in every layer too
    config, per_layer = _prepared(path, quantize)
    _, stacked = _prepared(path, quantize)
    before = len(jax.tree.leaves(nnx.state(stacked)))
    stacks = stack_layer_weights(stacked)
    layers = config.num_layers
    assert layers > 1 and stacks >= 4
    assert len(jax.tree.leaves(nnx.state(stacked))) == before - stacks * (layers - 1)
    projections = [m for p, m in nnx.iter_modules(stacked) if isinstance(m, Linear) and "layers" in p]
    assert all(isinstance(m.kernel, PackedKernel) and m.kernel[...].shape[0] == layers for m in projections)
    assert {m.layer_index for m in projections} == set(range(layers))
    np.testing.assert_array_equal(_logits(config, stacked), _logits(config, per_layer))


def test_a_model_on_xla_dots_keeps_its_per_layer_arrays(tmp_path):
    path = save_tiny("Qwen3ForCausalLM", str(tmp_path / "qwen3"))
    _, model = load_model(path, jnp.bfloat16, on_host=True)
    before = jax.tree.leaves(nnx.state(model))
    assert stack_layer_weights(model) == 0
    after = jax.tree.leaves(nnx.state(model))
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))
