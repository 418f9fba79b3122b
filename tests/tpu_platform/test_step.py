# SPDX-License-Identifier: Apache-2.0
"""The forward program on a padded step: padding tokens and padding sequence rows come out as
zeros (the CPU's dense kernels skip such rows), and the real rows are those of the same step
padded less; in a verify shape (speculative decoding) it also returns every token row's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model, pack_for_native_dense
from pallas_kernels import allocate_kv_cache
from tests.tiny_models import save_tiny_llama
from tpu_platform.inputs import exercise_inputs, pack_inputs
from tpu_platform.step import make_forward

PAGE, PAGES = 16, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def _forward(path, backend, t_pad, r_pad, num_seqs, packed_dense=False, verify_shapes=None):
    config, model = load_model(path, jnp.bfloat16 if packed_dense else jnp.float32)
    if packed_dense:
        assert pack_for_native_dense(model) > 0
    graphdef, state = nnx.split(model)
    leaves, state_def = jax.tree.flatten(state)
    dtype = jnp.bfloat16 if packed_dense else jnp.float32
    caches = [
        allocate_kv_cache(PAGES, PAGE, config.num_kv_heads, config.head_dim, dtype, backend=backend)
        for _ in range(config.num_layers)
    ]
    inputs = exercise_inputs(t_pad, r_pad, 2, 1, PAGES, page_size=PAGE, num_seqs=num_seqs)
    packed, dims = pack_inputs(inputs)
    forward = make_forward(graphdef, state_def, backend, verify_shapes=verify_shapes)
    logits, greedy, hidden, _, *rows = forward(leaves, caches, packed, jnp.zeros(r_pad, jnp.int32), dims=dims)
    out = np.asarray(logits), np.asarray(greedy), np.asarray(hidden)
    return out if verify_shapes is None else (*out, jax.tree.map(np.asarray, rows[0]))


# On XLA's attention: the slow tier's (the fast tier runs the native kernels, which skip padding rows)
@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.slow), "cpu_native"])
def test_padding_rows_are_zero_and_real_rows_unchanged(tiny, request, backend):
    packed_dense = backend == "cpu_native"
    if packed_dense:
        request.getfixturevalue("dense_kernels")
    # 15 real tokens in 3 sequences; 16 token rows and 8 sequence rows against 15 and 3.
    logits, greedy, hidden = _forward(tiny, backend, 16, 8, 3, packed_dense)
    less_logits, less_greedy, less_hidden = _forward(tiny, backend, 16, 3, 3, packed_dense)
    assert (logits[3:] == 0).all() and (greedy[3:] == 0).all()
    assert (hidden[15:] == 0).all()
    np.testing.assert_allclose(logits[:3], less_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(greedy[:3], less_greedy[:3])
    np.testing.assert_allclose(hidden[:15], less_hidden[:15], rtol=1e-5, atol=1e-5)
    assert np.abs(logits[:3]).max() > 0


def test_a_verify_shapes_step_returns_the_logits_of_every_token_row(tiny, dense_kernels):
    """Speculative decoding's shapes: the head on every token row (the real ones; padding rows
    enter as zeros), the sampled rows' logits and greedy tokens those of the plain program."""
    logits, greedy, hidden = _forward(tiny, "cpu_native", 16, 8, 3, True)
    v_logits, v_greedy, v_hidden, (row_logits, row_greedy) = _forward(
        tiny, "cpu_native", 16, 8, 3, True, verify_shapes=frozenset({(16, 8)})
    )
    np.testing.assert_array_equal(v_hidden, hidden)
    np.testing.assert_allclose(v_logits[:3], logits[:3], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v_greedy[:3], greedy[:3])
    # 15 real tokens in sequences of 5: the sampled rows are each sequence's last token.
    np.testing.assert_allclose(row_logits[[4, 9, 14]], logits[:3], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(row_greedy, row_logits.argmax(axis=1))
    assert (row_logits[15:] == 0).all() and (np.abs(row_logits[:15]).max(axis=1) > 0).all()
    # Another shape's program has no rows to give: its extra output is empty.
    *_, rows = _forward(tiny, "cpu_native", 16, 8, 3, True, verify_shapes=frozenset({(4, 1)}))
    assert rows == ()
