# SPDX-License-Identifier: Apache-2.0
"""The routed mixture-of-experts path (sorted by expert, tiled grouped matmul) against the dense
reference that runs every expert on every token; routing; the work bound; the models use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig, build
from models import moe as moe_lib
from models.moe import (
    SparseMoE,
    experts_dense_reference,
    experts_routed,
    num_tiles,
    route,
    tile_chunks,
    tile_rows,
)
from models.mxfp4 import Mxfp4Stack
from tests.models.tiny_checkpoints import caches, run_step

D, F = 16, 24


def _experts(num_experts, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(num_experts, D, F), (num_experts, D, F), (num_experts, F, D)]
    return [jnp.asarray(rng.normal(0.0, 0.5, s), jnp.float32) for s in shapes]


# Jitted: one compile per shape instead of one per primitive and shape in eager mode.
_dense = jax.jit(experts_dense_reference, static_argnums=6)
_routed = jax.jit(experts_routed, static_argnums=6, static_argnames="rows")


@pytest.mark.parametrize(
    "tokens,top_k,num_experts,renormalize",
    # one program a shape: the fast tier keeps one with and one without renormalization
    [(1, 2, 8, True), (17, 2, 8, False)]
    + [
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [(200, 3, 8, True), (5, 8, 8, False), (33, 4, 64, True)]
    ],
)
def test_routed_matches_dense(tokens, top_k, num_experts, renormalize):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    weights, experts = route(
        jnp.asarray(rng.normal(size=(tokens, num_experts))), top_k, renormalize=renormalize
    )
    args = (x, *_experts(num_experts), weights, experts, jax.nn.silu)
    np.testing.assert_allclose(_routed(*args), _dense(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tokens,top_k,num_experts",
    [(40, 2, 8)] + [pytest.param(*case, marks=pytest.mark.slow) for case in [(1, 1, 16), (17, 1, 4)]],
)
def test_weights_on_the_experts_inputs_match_numpy(tokens, top_k, num_experts):
    # Llama 4: each chosen expert runs on its token scaled by the routing weight, outputs summed.
    rng = np.random.default_rng(tokens)
    x = rng.normal(size=(tokens, D)).astype(np.float32)
    weights, experts = route(jnp.asarray(rng.normal(size=(tokens, num_experts))), top_k, renormalize=False)
    gate, up, down = (np.asarray(w) for w in _experts(num_experts, seed=3))
    expected = np.zeros_like(x)
    for t in range(tokens):
        for w, e in zip(np.asarray(weights[t]), np.asarray(experts[t]), strict=True):
            xs = w * x[t]
            h = xs @ gate[e]
            expected[t] += (h / (1 + np.exp(-h)) * (xs @ up[e])) @ down[e]
    args = (jnp.asarray(x), *_experts(num_experts, seed=3), weights, experts, jax.nn.silu)
    routed = jax.jit(experts_routed, static_argnums=6, static_argnames=("rows", "weights_on_input"))
    dense = jax.jit(experts_dense_reference, static_argnums=6, static_argnames="weights_on_input")
    np.testing.assert_allclose(routed(*args, weights_on_input=True), expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(dense(*args, weights_on_input=True), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rows", [8, pytest.param(1, marks=pytest.mark.slow), pytest.param(128, marks=pytest.mark.slow)]
)
def test_routed_matches_dense_when_one_expert_takes_every_token(rows):
    # Every token's first choice is expert 3: it gets 45 of the 80 rows, the others 4-6 each.
    tokens, top_k, num_experts = 40, 2, 8
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, D)), jnp.float32)
    experts = jnp.stack([jnp.full(tokens, 3), jnp.arange(tokens) % num_experts], axis=1).astype(jnp.int32)
    experts = experts.at[3, 1].set(5)  # keep each token's two experts distinct
    weights = jnp.full((tokens, top_k), 0.5, jnp.float32)
    args = (x, *_experts(num_experts, seed=2), weights, experts, jax.nn.gelu)
    np.testing.assert_allclose(_routed(*args, rows=rows), _dense(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tiles_per_chunk", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)]
)
def test_tiles_run_in_chunks_give_the_same_result(tiles_per_chunk):
    # A prefill's tiles run in a loop of chunks, a chunk's gathered kernels bounded: the same
    # sums as the dense reference, the last chunk padded with empty tiles. (50 tokens would
    # take the every-token tiles: the routed ones are asked for.)
    tokens, top_k, num_experts = 50, 3, 8
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    weights, experts = route(jnp.asarray(rng.normal(size=(tokens, num_experts))), top_k, renormalize=True)
    args = (x, *_experts(num_experts, seed=4), weights, experts, jax.nn.silu)
    routed = jax.jit(
        experts_routed, static_argnums=6, static_argnames=("rows", "max_chunk_elements", "every_token_tiles")
    )
    chunked = routed(*args, rows=4, max_chunk_elements=tiles_per_chunk * D * F, every_token_tiles=False)
    np.testing.assert_allclose(chunked, _dense(*args), atol=1e-5, rtol=1e-5)
    jaxpr = str(
        jax.make_jaxpr(
            lambda *a: experts_routed(
                *a, jax.nn.silu, rows=4, max_chunk_elements=tiles_per_chunk * D * F, every_token_tiles=False
            )
        )(*args[:6])
    )
    assert "while" in jaxpr or "scan" in jaxpr  # the chunks are a loop, not one batched gather


@pytest.mark.slow  # mxfp4 experts: the fast tier serves them whole in test_mxfp4.py
def test_mxfp4_tiles_run_in_chunks_equal_the_dequantized_experts():
    # Each chunk decodes only its own tiles' experts: the same as the whole stacks dequantized.
    num_experts, width, tokens, top_k = 4, 64, 24, 2
    rng = np.random.default_rng(11)

    def stack(inputs, outputs):
        blocks = rng.integers(0, 256, (num_experts, outputs, inputs // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 129, (num_experts, outputs, inputs // 32), dtype=np.uint8)
        return Mxfp4Stack(jnp.asarray(blocks), jnp.asarray(scales))

    stacks = [stack(width, width), stack(width, width), stack(width, width)]
    x = jnp.asarray(rng.normal(size=(tokens, width)), jnp.float32)
    weights, experts = route(jnp.asarray(rng.normal(size=(tokens, num_experts))), top_k, renormalize=True)
    chunked = experts_routed(
        x, *stacks, weights, experts, jax.nn.silu, rows=2, max_chunk_elements=3 * width**2
    )
    dense = _dense(x, *(s.dense(jnp.float32) for s in stacks), weights, experts, jax.nn.silu)
    np.testing.assert_allclose(chunked, dense, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "tiles,elements,expected",
    [(380, 768 * 2880, (13, 30)), (382, 2048 * 64, (1, 382)), (10, 1 << 27, (10, 1)), (5, 1, (1, 5))],
)
def test_tile_chunks_bound_the_gathered_kernels(tiles, elements, expected):
    chunks, per_chunk = tile_chunks(tiles, elements)
    assert (chunks, per_chunk) == expected
    assert chunks * per_chunk >= tiles and chunks * per_chunk - tiles < chunks  # under one tile a chunk
    assert per_chunk == 1 or per_chunk * elements <= 1 << 26


def test_route_is_softmax_top_k():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    weights, experts = route(logits, 2, renormalize=False)
    np.testing.assert_array_equal(experts, [[1, 2], [0, 3]])
    np.testing.assert_allclose(weights, [[probs[0, 1], probs[0, 2]], [probs[1, 0], probs[1, 3]]], rtol=1e-6)
    renormed, _ = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(renormed, weights / weights.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 8, 128), (4, 2, 8), (64, 2, 8), (512, 8, 128)])
def test_routed_work_is_bounded(tokens, top_k, num_experts):
    a = tokens * top_k
    b = tile_rows(a, num_experts)
    rows = num_tiles(a, num_experts, b) * b  # rows multiplied by some expert's weights
    assert rows <= 2 * a + num_experts * b  # routed rows plus under one tile of padding per group
    assert rows < tokens * num_experts  # never the dense every-expert-for-every-token work
    if a <= num_experts:  # decode: one weight tile per routed (token, expert) pair
        assert b == 1 and rows == a


def test_models_run_the_routed_path(monkeypatch):
    config = ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=64, hidden_size=D, intermediate_size=F, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return experts_routed(*args, **kwargs)

    monkeypatch.setattr(moe_lib, "experts_routed", spy)
    monkeypatch.setattr(moe_lib, "experts_dense_reference", None)  # calling it would fail
    model = build(config)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    run_step(model, caches(config, num_pages=4), [[1, 2, 3]], [0], [[1]])
    assert calls == [(3, D), (3, D)]
