# SPDX-License-Identifier: Apache-2.0
"""The every-token layout of a decode step's experts (`models.moe_layout`, what a device runs
under expert parallelism): the same sums as the dense reference and a NumPy loop over the
chosen experts, with the other devices' assignments sent to expert 0 at weight 0, and each
expert's kernels read in place rather than gathered a copy per tile."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import MAX_TILE_ROWS, experts_dense_reference, experts_routed, num_tiles, route, tile_rows

D, F, E = 16, 24, 8  # E: one device's experts


def _kernels(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(E, D, F), (E, D, F), (E, F, D)]
    return [jnp.asarray(rng.normal(0.0, 0.5, s), jnp.float32) for s in shapes]


def _one_device_share(tokens, top_k, devices, seed):
    """Routing over `devices * E` experts as device 0 sees it: its own experts' ids, the rest
    sent to expert 0 at weight 0 (as `experts_by_index_on_mesh` does)."""
    rng = np.random.default_rng(seed)
    weights, experts = route(jnp.asarray(rng.normal(size=(tokens, devices * E))), top_k, renormalize=True)
    mine = experts < E
    return jnp.where(mine, weights, 0.0), jnp.where(mine, experts, 0)


_routed = jax.jit(experts_routed, static_argnums=6, static_argnames=("every_token_tiles", "weights_on_input"))


@pytest.mark.parametrize("tokens,top_k,devices", [(1, 8, 8), (64, 8, 8), (13, 4, 2)])
def test_every_token_tiles_equal_the_dense_reference(tokens, top_k, devices):
    weights, experts = _one_device_share(tokens, top_k, devices, seed=tokens)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, D)), jnp.float32)
    args = (x, *_kernels(), weights, experts, jax.nn.silu)
    want = experts_dense_reference(*args)
    np.testing.assert_allclose(_routed(*args, every_token_tiles=True), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_routed(*args), want, atol=1e-5, rtol=1e-5)


def test_every_token_tiles_with_weights_on_the_inputs_match_numpy():
    # Llama 4: each chosen expert runs on its token scaled by its weight; the zero-weighted
    # (other devices') assignments add nothing.
    tokens, top_k = 32, 4
    weights, experts = _one_device_share(tokens, top_k, 4, seed=5)
    x = np.random.default_rng(2).normal(size=(tokens, D)).astype(np.float32)
    gate, up, down = (np.asarray(k) for k in _kernels(seed=3))
    want = np.zeros_like(x)
    for t in range(tokens):
        for w, e in zip(np.asarray(weights[t]), np.asarray(experts[t]), strict=True):
            if w != 0:
                h = (w * x[t]) @ gate[e]
                want[t] += (h / (1 + np.exp(-h)) * ((w * x[t]) @ up[e])) @ down[e]
    args = (jnp.asarray(x), *_kernels(seed=3), weights, experts, jax.nn.silu)
    got = _routed(*args, every_token_tiles=True, weights_on_input=True)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def _kernel_copies(tokens, top_k, every_token_tiles):
    """Per-tile copies of the gate kernels the step's program gathers (`[N, D, F]` gathers)."""
    weights, experts = _one_device_share(tokens, top_k, 8, seed=0)
    x = jnp.zeros((tokens, D), jnp.float32)
    jaxpr = str(
        jax.make_jaxpr(lambda *a: experts_routed(*a, jax.nn.silu, every_token_tiles=every_token_tiles))(
            x, *_kernels(), weights, experts
        )
    )
    return [int(n) for n in re.findall(rf":f32\[(\d+),{D},{F}\] = gather", jaxpr)]


def test_a_decode_step_reads_each_expert_once_instead_of_a_copy_per_tile():
    tokens, top_k = 64, 8
    tiles = num_tiles(tokens * top_k, E, tile_rows(tokens * top_k, E))
    assert tiles > E  # the routed bound: many more tiles than the device's experts
    assert sum(_kernel_copies(tokens, top_k, every_token_tiles=False)) >= tiles
    assert _kernel_copies(tokens, top_k, every_token_tiles=True) == []


def test_a_step_longer_than_a_tile_keeps_the_routed_tiles():
    # Past MAX_TILE_ROWS tokens (prefill) the every-token tiles would multiply the work and
    # the temporaries by the experts; the routed tiles run.
    assert _kernel_copies(MAX_TILE_ROWS + 1, 2, every_token_tiles=True) != []
