# SPDX-License-Identifier: Apache-2.0
"""The pooling program's math (`tpu_platform.pooling`) against NumPy: last, first and mean token
of each sequence of a ragged step, Matryoshka truncation, normalization, the classifier head."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_platform.pooling import (
    PoolingConfig,
    PoolingOptions,
    classify_head,
    embed_head,
    pool_hidden,
    pooled_outputs,
    pooling_rows,
)

LENGTHS = [3, 1, 5]  # three sequences of a step, then padding tokens and a padding row
T, R, D = 16, 4, 8


def _step():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(T, D)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(LENGTHS), [sum(LENGTHS)]]).astype(np.int32)  # R + 1
    return hidden, cu


def _rows(options, width=D):
    _, cu = _step()
    return pooling_rows(cu, options, width, R)


@pytest.mark.parametrize("method", ["LAST", "CLS", "MEAN"])
def test_each_sequence_pools_its_own_tokens(method):
    hidden, cu = _step()
    rows = _rows([PoolingOptions()] * 3)
    got = np.asarray(pool_hidden(jnp.asarray(hidden), jnp.asarray(rows), method))
    for i in range(3):
        tokens = hidden[cu[i] : cu[i + 1]]
        expected = {"LAST": tokens[-1], "CLS": tokens[0], "MEAN": tokens.mean(0)}[method]
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6)
    assert got.shape == (R, D)


def test_padding_rows_pool_an_empty_span_to_finite_values():
    hidden, _ = _step()
    rows = _rows([PoolingOptions()] * 3)
    assert np.isfinite(np.asarray(pool_hidden(jnp.asarray(hidden), jnp.asarray(rows), "MEAN"))).all()


def test_embed_head_truncates_then_normalizes_per_row():
    pooled = np.arange(1, R * D + 1, dtype=np.float32).reshape(R, D)
    options = [PoolingOptions(dimensions=3), PoolingOptions(), PoolingOptions(activation=False)]
    got = np.asarray(embed_head(jnp.asarray(pooled), jnp.asarray(_rows(options))))
    np.testing.assert_allclose(got[0, :3], pooled[0, :3] / np.linalg.norm(pooled[0, :3]), rtol=1e-6)
    assert (got[0, 3:] == 0).all()
    np.testing.assert_allclose(got[1], pooled[1] / np.linalg.norm(pooled[1]), rtol=1e-6)
    np.testing.assert_array_equal(got[2], pooled[2])  # no activation: the raw row


def test_normalizing_a_zero_row_gives_zeros_as_torch_does():
    got = np.asarray(embed_head(jnp.zeros((R, D)), jnp.asarray(_rows([PoolingOptions()] * 3))))
    np.testing.assert_array_equal(got, 0.0)


@pytest.mark.parametrize("activation", ["softmax", "sigmoid", "identity"])
def test_classify_head_calibrates_then_activates_where_asked(activation):
    logits = np.random.default_rng(1).normal(size=(R, 3)).astype(np.float32)
    config = PoolingConfig(task="classify", activation=activation, logit_mean=0.5, logit_sigma=2.0)
    options = [PoolingOptions(), PoolingOptions(activation=False), PoolingOptions()]
    got = np.asarray(classify_head(jnp.asarray(logits), jnp.asarray(_rows(options, 3)), config))
    calibrated = (logits - 0.5) / 2.0
    activated = {
        "softmax": np.exp(calibrated) / np.exp(calibrated).sum(1, keepdims=True),
        "sigmoid": 1 / (1 + np.exp(-calibrated)),
        "identity": calibrated,
    }[activation]
    np.testing.assert_allclose(got[0], activated[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], calibrated[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], activated[2], rtol=1e-5)


def test_only_finished_prompts_get_a_row_of_their_dimensions():
    pooled = np.ones((R, D), np.float32)
    options = [PoolingOptions(dimensions=2), PoolingOptions(), PoolingOptions()]
    out = pooled_outputs(pooled, np.array([True, False, True]), options)
    assert out[1] is None and out[0].shape == (2,) and out[2].shape == (D,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(task="token_embed"), "pooling task 'token_embed'"),
        (dict(task="embed", method="ALL"), "pooling type 'ALL'"),
        (dict(task="classify", activation="gelu"), "activation 'gelu'"),
        (dict(task="classify", logit_sigma=0.0), "logit_sigma"),
    ],
)
def test_bad_configuration_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingConfig(**kwargs)
