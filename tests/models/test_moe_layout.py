# SPDX-License-Identifier: Apache-2.0
"""The two layouts of a step's routed experts (`models.moe_layout`): the same sums as the dense
reference and a NumPy loop over the chosen experts, with the other devices' assignments (under
expert parallelism) sent to expert id E at weight 0 and in no tile; each expert's kernels read
in place by the every-token tiles rather than gathered a copy per tile; and the choice between
them by the bytes each reads and a roofline at the planner's chip facts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import MAX_TILE_ROWS, experts_dense_reference, experts_routed, num_tiles, route, tile_rows
from models.moe_layout import every_token_pays, routed_rows
from tpu_platform.planner.targets import TARGETS

D, F, E = 16, 24, 8  # E: one device's experts


def _kernels(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(E, D, F), (E, D, F), (E, F, D)]
    return [jnp.asarray(rng.normal(0.0, 0.5, s), jnp.float32) for s in shapes]


def _one_device_share(tokens, top_k, devices, seed):
    """Routing over `devices * E` experts as device 0 sees it: its own experts' ids, the rest
    sent to expert id E at weight 0 (as `experts_by_index` does)."""
    rng = np.random.default_rng(seed)
    weights, experts = route(jnp.asarray(rng.normal(size=(tokens, devices * E))), top_k, renormalize=True)
    mine = experts < E
    return jnp.where(mine, weights, 0.0), jnp.where(mine, experts, E)


_routed = jax.jit(
    experts_routed,
    static_argnums=6,
    static_argnames=("every_token_tiles", "weights_on_input", "rows", "max_chunk_elements"),
)


# One program a point: the fast tier keeps each layout once, at a shape of its own.
_LAYOUT_FAST = {"every-token-13-4-2", "routed-64-8-8", "chosen-1-8-8"}


@pytest.mark.parametrize(
    "tokens,top_k,devices,every_token_tiles",
    [
        pytest.param(*shape, layout, id=name, marks=() if name in _LAYOUT_FAST else pytest.mark.slow)
        for layout, kind in ((True, "every-token"), (False, "routed"), (None, "chosen"))
        for shape in ((1, 8, 8), (64, 8, 8), (13, 4, 2), (64, 2, 1))
        for name in [f"{kind}-{'-'.join(map(str, shape))}"]
    ],
)
def test_either_layout_equals_the_dense_reference(tokens, top_k, devices, every_token_tiles):
    weights, experts = _one_device_share(tokens, top_k, devices, seed=tokens)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, D)), jnp.float32)
    args = (x, *_kernels(), weights, experts, jax.nn.silu)
    got = _routed(*args, every_token_tiles=every_token_tiles)
    np.testing.assert_allclose(got, experts_dense_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # an eight-device layout's program; the fast tier checks the layouts' results above
def test_other_devices_assignments_take_no_tile_and_the_used_tiles_come_first():
    tokens, top_k, rows = 40, 4, 2
    weights, experts = _one_device_share(tokens, top_k, 4, seed=3)
    tiles = num_tiles(tokens * top_k, E, rows)
    layout = routed_rows(weights, experts, E, rows, tiles, weights_on_input=False)
    own = np.asarray(experts).reshape(-1)
    own = own[own < E]
    used = sum(-(-np.count_nonzero(own == e) // rows) for e in range(E))
    assert 0 < len(own) < tokens * top_k and int(layout.used_tiles) == used
    token = np.asarray(layout.token).reshape(tiles, rows)
    assert (token[used:] == tokens).all()  # past the used tiles: the zero row only
    assert np.count_nonzero(token[:used] != tokens) == len(own)  # every own assignment, once


def test_a_chunk_loop_that_stops_at_the_last_used_chunk_equals_the_dense_reference():
    # Tiles of one row, one a chunk: most chunks hold only other devices' assignments (none).
    tokens, top_k = 24, 4
    weights, experts = _one_device_share(tokens, top_k, 4, seed=8)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(tokens, D)), jnp.float32)
    args = (x, *_kernels(seed=2), weights, experts, jax.nn.silu)
    got = _routed(*args, every_token_tiles=False, rows=1, max_chunk_elements=D * F)
    np.testing.assert_allclose(got, experts_dense_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("tokens", [1, 16, 64, 128])
def test_accelerators_take_every_token_tiles_only_where_compute_stays_under_the_reads(tokens, bits):
    # Qwen3-30B-A3B's experts (128 of 2048 x 768, top-8): the every-token tiles are chosen
    # where they read fewer kernel bytes than the routed ones, and only where their compute at
    # every TPU and GPU target's peak rate takes no longer than their reads at its bandwidth.
    experts, top_k, weights_per_expert = 128, 8, 3 * 2048 * 768
    rows = tile_rows(tokens * top_k, experts)
    tiles = num_tiles(tokens * top_k, experts, rows)
    _, chosen = every_token_pays(tokens, experts, tiles, rows, bits)
    read_bytes = experts * weights_per_expert * bits / 8
    flops = 2 * tokens * experts * weights_per_expert
    under_memory_time = all(
        flops / t.bf16_flops_per_second <= read_bytes / t.hbm_bytes_per_second for t in TARGETS.values()
    )
    assert chosen == (experts < tiles and under_memory_time)
    if (tokens, bits) == (64, 16):
        assert chosen  # the 64-token bfloat16 decode step reads each expert once


def test_cpu_keeps_the_routed_tiles_where_every_token_would_multiply_the_rows():
    # 64 tokens of top-8 over 128 experts: 320 routed tiles of 2 rows against 64 x 128 rows.
    on_cpu, _ = every_token_pays(64, 128, num_tiles(512, 128, 2), 2, 16)
    assert not on_cpu
    # 64 tokens of top-2 over 8 experts: 23 tiles of 8 rows against 64 x 8 rows.
    on_cpu, _ = every_token_pays(64, 8, num_tiles(128, 8, 8), 8, 16)
    assert on_cpu


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


@pytest.mark.parametrize("platform,copies", [("tpu", set()), ("cuda", set()), ("cpu", {"320"})])
def test_the_layout_is_fixed_per_platform_when_the_step_is_lowered(platform, copies):
    # Qwen3-30B-A3B's routing (top-8 of 128 experts) on a 64-token bfloat16 decode, lowered
    # for each platform without its compiler: TPU and GPU programs hold no per-tile copy of a
    # kernel (`[320, D, F]`: 320 routed tiles of 2 rows), the CPU one keeps the routed tiles.
    tokens, experts, top_k = 64, 128, 8
    rng = np.random.default_rng(0)
    weights, ids = route(jnp.asarray(rng.normal(size=(tokens, experts))), top_k, renormalize=True)
    stacks = [jnp.zeros(s, jnp.bfloat16) for s in [(experts, D, F), (experts, D, F), (experts, F, D)]]
    step = jax.jit(lambda *a: experts_routed(*a, jax.nn.silu))
    lowered = step.trace(jnp.zeros((tokens, D), jnp.bfloat16), *stacks, weights, ids)
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    assert set(re.findall(rf"tensor<(\d+)x{D}x{F}xbf16>", text)) - {str(experts)} == copies
