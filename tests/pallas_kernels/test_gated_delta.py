# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet ops (pallas_kernels/gated_delta.py): hand-worked cases with the arithmetic in
the comments; the chunkwise ragged form against a NumPy token-by-token loop over a grid of
ragged batches whose lengths cross chunk boundaries (decodes, prefill chunks, padding
sequences, carried and fresh states, grouped key heads); a prompt run in two steps equal to one;
the causal conv1d with its carried inputs against NumPy; bfloat16 inputs; no pool-sized
temporaries in the compiled ops; the bad-shape errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BACKENDS,
    allocate_state_pools,
    causal_conv1d,
    gated_delta_rule,
    state_bytes_per_slot,
)
from pallas_kernels.gated_delta_reference import gated_delta_rule_recurrent, unit_lower_inverse


def numpy_gated_delta(q, k, v, g, beta, state, *, qk_l2norm=True):
    """The rule written out token by token (one sequence): q, k [L, G, K], v [L, H, V]."""
    heads = v.shape[1]
    q = np.repeat(q.astype(np.float64), heads // q.shape[1], axis=1)
    k = np.repeat(k.astype(np.float64), heads // k.shape[1], axis=1)
    if qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q / math.sqrt(q.shape[-1])
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        for h in range(heads):
            s[h] *= math.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] += np.outer(k[t, h], delta)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def _run(q, k, v, g, beta, pool, indices, has_state, q_lens, num_seqs, *, chunk_size, backend="xla", **kw):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    o, pool = gated_delta_rule(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(pool),
        jnp.asarray(indices, jnp.int32), jnp.asarray(has_state), jnp.asarray(cu),
        jnp.asarray([num_seqs], jnp.int32), chunk_size=chunk_size, backend=backend, **kw,
    )  # fmt: skip
    return np.asarray(o), np.asarray(pool)


# One head, K = V = 1, q = k = 1 without the L2 norm (so the scaled q is 1 * 1 ** -0.5 = 1).
# Token 0: g = ln 0.5, beta = 0.5, v = 2. Token 1: g = ln 0.5, beta = 1, v = 4.
# From S = 0: S = 0.5 * 0 = 0; S += 1 * 0.5 * (2 - 0) = 1; o = 1.
#             S = 0.5;          S += 1 * 1 * (4 - 0.5) = 4; o = 4.
# From S = 2: S = 1;            S += 0.5 * (2 - 1) -> 1.5; o = 1.5.
#             S = 0.75;         S += 1 * (4 - 0.75) -> 4;  o = 4.
_HAND = dict(
    q=np.ones((2, 1, 1), np.float32), k=np.ones((2, 1, 1), np.float32),
    v=np.array([[[2.0]], [[4.0]]], np.float32), g=np.full((2, 1), math.log(0.5), np.float32),
    beta=np.array([[0.5], [1.0]], np.float32),
)  # fmt: skip


# Every backend name runs the same form today: one chunk size each is enough, and the fast tier
# runs it under xla's name alone (the other names are the slow tier's).
@pytest.mark.parametrize(
    "backend, chunk_size",
    [
        *(pytest.param(b, 2, marks=() if b == "xla" else pytest.mark.slow) for b in BACKENDS),
        ("xla", 1),
        ("xla", 64),
    ],
)
@pytest.mark.parametrize("start, expected", [(0.0, [1.0, 4.0]), (2.0, [1.5, 4.0])])
def test_hand_worked_two_tokens(backend, chunk_size, start, expected):
    pool = np.full((2, 1, 1, 1), start, np.float32)
    # Two sequence slots so that two rows are not taken for a decode step: the chunked form runs.
    o, pool = _run(**_HAND, pool=pool, indices=[1, 0], has_state=[True, False], q_lens=[2, 0], num_seqs=1,
                   chunk_size=chunk_size, backend=backend, qk_l2norm=False)  # fmt: skip
    np.testing.assert_allclose(o[:, 0, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(pool[:, 0, 0, 0], [start, 4.0], rtol=1e-6)  # slot 0 untouched
    oracle, final = gated_delta_rule_recurrent(
        **_HAND, initial_state=jnp.full((1, 1, 1), start), qk_l2norm=False
    )
    np.testing.assert_allclose(np.asarray(oracle)[:, 0, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(final).ravel(), [4.0], rtol=1e-6)


def _inputs(rng, num_tokens, key_heads, heads, key_dim, value_dim):
    return dict(
        q=rng.standard_normal((num_tokens, key_heads, key_dim)).astype(np.float32),
        k=rng.standard_normal((num_tokens, key_heads, key_dim)).astype(np.float32),
        v=rng.standard_normal((num_tokens, heads, value_dim)).astype(np.float32),
        g=-rng.uniform(0.0, 0.7, (num_tokens, heads)).astype(np.float32),
        beta=rng.uniform(0.0, 1.0, (num_tokens, heads)).astype(np.float32),
    )


# (q_lens of the live sequences, sequence slots, padding rows, chunk size, key heads, value heads)
GRID = [
    ((7,), 1, 0, 4, 1, 1),  # one prefill crossing one chunk boundary
    ((8, 4), 3, 3, 4, 1, 2),  # exact chunk multiples, a padding sequence, padding rows
    ((1, 1, 1), 4, 1, 4, 2, 4),  # decodes only: the recurrent path
    ((9, 1, 0, 17, 1), 6, 2, 8, 2, 2),  # mixed, an empty sequence
    ((20, 3, 33), 3, 0, 16, 1, 2),  # longer chunks, crossed twice
]


# One program a batch: the fast tier keeps the exact multiples, the decodes and the mixed batch (whose
# 9- and 17-token prefills cross one and two chunk boundaries); the other two are the slow tier's.
_SLOW_BATCHES = (GRID[0], GRID[4])


@pytest.mark.parametrize(
    "q_lens, seq_slots, pad_rows, chunk_size, key_heads, heads",
    [pytest.param(*case, marks=pytest.mark.slow) if case in _SLOW_BATCHES else case for case in GRID],
)
def test_ragged_batches_against_token_by_token_numpy(
    q_lens, seq_slots, pad_rows, chunk_size, key_heads, heads
):
    rng = np.random.default_rng(sum(q_lens) + chunk_size)
    key_dim, value_dim, num_slots = 8, 4, seq_slots + 2
    x = _inputs(rng, sum(q_lens) + pad_rows, key_heads, heads, key_dim, value_dim)
    pool = rng.standard_normal((num_slots, heads, key_dim, value_dim)).astype(np.float32)
    indices = rng.permutation(num_slots)[:seq_slots]
    has_state = np.arange(seq_slots) % 2 == 1  # fresh and carried states alternate
    lens = list(q_lens) + [0] * (seq_slots - len(q_lens))
    o, new_pool = _run(**x, pool=pool, indices=indices, has_state=has_state, q_lens=lens,
                       num_seqs=len(q_lens), chunk_size=chunk_size)  # fmt: skip
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    expected_pool = pool.copy()
    for i in range(len(q_lens)):
        rows = slice(cu[i], cu[i + 1])
        start = pool[indices[i]] if has_state[i] else np.zeros_like(pool[0])
        want, final = numpy_gated_delta(*(x[n][rows] for n in ("q", "k", "v", "g", "beta")), start)
        np.testing.assert_allclose(o[rows], want, atol=2e-5, rtol=1e-4, err_msg=f"sequence {i}")
        expected_pool[indices[i]] = final
    np.testing.assert_allclose(new_pool, expected_pool, atol=2e-5, rtol=1e-4)
    assert not np.any(o[cu[-1] :]), "padding rows are zero"


@pytest.mark.slow  # two programs; the fast tier's ragged batches check the rule against NumPy
def test_prompt_in_two_steps_equals_one():
    # Qwen3-Next's chunk of 64, crossed twice; every step padded to the same 150 rows (one compile).
    rng = np.random.default_rng(3)
    x = _inputs(rng, 150, 2, 4, 16, 8)
    pool = np.zeros((3, 4, 16, 8), np.float32)
    run = dict(indices=[2], num_seqs=1, chunk_size=64)
    whole, whole_pool = _run(**x, pool=pool, has_state=[False], q_lens=[150], **run)
    want, _ = numpy_gated_delta(*(x[n] for n in ("q", "k", "v", "g", "beta")), pool[2])
    np.testing.assert_allclose(whole, want, atol=2e-5, rtol=1e-4)
    first = {n: np.concatenate([a[:70], np.zeros_like(a[70:])]) for n, a in x.items()}
    second = {n: np.concatenate([a[70:], np.zeros_like(a[:70])]) for n, a in x.items()}
    o1, pool1 = _run(**first, pool=pool, has_state=[False], q_lens=[70], **run)
    o2, pool2 = _run(**second, pool=pool1, has_state=[True], q_lens=[80], **run)
    np.testing.assert_allclose(np.concatenate([o1[:70], o2[:80]]), whole, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(pool2, whole_pool, atol=2e-5, rtol=1e-4)


def numpy_conv(x, weight, carried):
    """One sequence's causal depthwise conv with silu: x [L, D], weight [W, D], carried [W-1, D]."""
    padded = np.concatenate([carried, x]).astype(np.float64)
    width = weight.shape[0]
    y = np.stack([(padded[t : t + width] * weight).sum(0) for t in range(x.shape[0])])
    return y / (1 + np.exp(-y)), padded[-(width - 1) :]


def _conv(x, weight, pool, indices, has_state, q_lens, num_seqs, **kw):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    y, pool = causal_conv1d(
        jnp.asarray(x), jnp.asarray(weight), jnp.asarray(pool), jnp.asarray(indices, jnp.int32),
        jnp.asarray(has_state), jnp.asarray(cu), jnp.asarray([num_seqs], jnp.int32), **kw,
    )  # fmt: skip
    return np.asarray(y), np.asarray(pool)


def test_conv_hand_worked():
    # Width 3, one channel, taps [1, 2, 3] (3 multiplies the current input). Carried inputs
    # [10, 20], inputs [1, 2]: row 0 = 10 + 2 * 20 + 3 * 1 = 53, row 1 = 20 + 2 + 6 = 28; the
    # slot then holds [1, 2]. A fresh sequence ignores the slot: row 0 = 3, row 1 = 2 + 6 = 8.
    weight = np.array([[1.0], [2.0], [3.0]], np.float32)
    x = np.array([[1.0], [2.0]], np.float32)
    pool = np.array([[[10.0], [20.0]]], np.float32)
    for has_state, want in ((True, [53.0, 28.0]), (False, [3.0, 8.0])):
        y, new = _conv(x, weight, pool, [0], [has_state], [2], 1, activation=False)
        np.testing.assert_allclose(y[:, 0], want)
        np.testing.assert_allclose(new[0, :, 0], [1.0, 2.0])


@pytest.mark.parametrize("q_lens, pad_rows", [((5, 1, 2), 2), ((1, 1), 0), ((3,), 4)])
def test_conv_ragged_against_numpy(q_lens, pad_rows):
    rng = np.random.default_rng(len(q_lens))
    width, channels, seq_slots = 4, 6, len(q_lens) + 1
    x = rng.standard_normal((sum(q_lens) + pad_rows, channels)).astype(np.float32)
    weight = rng.standard_normal((width, channels)).astype(np.float32)
    pool = rng.standard_normal((seq_slots + 1, width - 1, channels)).astype(np.float32)
    indices = rng.permutation(seq_slots + 1)[:seq_slots]
    has_state = np.arange(seq_slots) % 2 == 0
    y, new = _conv(x, weight, pool, indices, has_state, [*q_lens, 0], len(q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    expected = pool.copy()
    for i in range(len(q_lens)):
        carried = pool[indices[i]] if has_state[i] else np.zeros_like(pool[0])
        want, last = numpy_conv(x[cu[i] : cu[i + 1]], weight, carried)
        np.testing.assert_allclose(y[cu[i] : cu[i + 1]], want, atol=1e-5, rtol=1e-5)
        expected[indices[i]] = last  # a sequence shorter than W - 1 keeps some carried inputs
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    assert not np.any(y[cu[-1] :])


def test_state_pools_and_their_bytes():
    conv, state = allocate_state_pools(
        5, conv_width=4, conv_dim=24, num_heads=2, key_dim=8, value_dim=4, dtype=jnp.bfloat16
    )
    assert conv.shape == (5, 3, 24) and conv.dtype == jnp.bfloat16
    assert state.shape == (5, 2, 8, 4) and state.dtype == jnp.float32
    per_slot = state_bytes_per_slot(conv_width=4, conv_dim=24, num_heads=2, key_dim=8, value_dim=4,
                                    dtype=jnp.bfloat16)  # fmt: skip
    assert per_slot * 5 == conv.nbytes + state.nbytes


def test_bad_shapes_are_named():
    x = _inputs(np.random.default_rng(0), 4, 1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"state \(3, 2, 8, 5\)"):
        _run(**x, pool=np.zeros((3, 2, 8, 5), np.float32), indices=[0], has_state=[False], q_lens=[4],
             num_seqs=1, chunk_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="conv_state"):
        _conv(np.zeros((2, 6), np.float32), np.zeros((4, 6), np.float32), np.zeros((1, 2, 6), np.float32),
              [0], [False], [2], 1)  # fmt: skip
    with pytest.raises(ValueError, match="conv_width"):
        allocate_state_pools(
            1, conv_width=1, conv_dim=2, num_heads=1, key_dim=1, value_dim=1, dtype=jnp.float32
        )


def _compiled_memory(num_slots: int, num_tokens: int, columns: int = 1):
    """XLA's memory analysis of the rule and the conv, each compiled with its pool donated
    (`columns` slots a sequence: `test_gated_delta_rows`)."""
    seqs, key_heads, heads, dim, channels = 4, 2, 4, 32, 96
    shapes = {
        "q": (num_tokens, key_heads, dim), "k": (num_tokens, key_heads, dim), "v": (num_tokens, heads, dim),
        "g": (num_tokens, heads), "beta": (num_tokens, heads), "state": (num_slots, heads, dim, dim),
    }  # fmt: skip
    indices = (seqs,) if columns == 1 else (seqs, columns)
    batch_shapes = ((indices, jnp.int32), ((seqs,), bool), ((seqs + 1,), jnp.int32), ((1,), jnp.int32))
    batch = [jax.ShapeDtypeStruct(s, d) for s, d in batch_shapes]
    rule = jax.jit(lambda *a: gated_delta_rule(*a, backend="xla"), donate_argnums=5)
    rule_args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes.values()] + batch
    conv = jax.jit(lambda *a: causal_conv1d(*a, backend="xla"), donate_argnums=2)
    conv_args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
                 ((num_tokens, channels), (4, channels), (num_slots, 3, channels))] + batch  # fmt: skip
    return [f.lower(*args).compile().memory_analysis() for f, args in ((rule, rule_args), (conv, conv_args))]


# A decode step and (slow tier) a prefill step of 4 sequences.
@pytest.mark.parametrize("num_tokens", [4, pytest.param(128, marks=pytest.mark.slow)])
def test_no_pool_sized_temporaries(num_tokens):
    # The pools are updated in place (their donated arrays are the outputs) and the programs'
    # scratch memory does not grow with the pool: only the step's own sequences' states are read.
    small, large = _compiled_memory(8, num_tokens), _compiled_memory(256, num_tokens)
    for few, many in zip(small, large, strict=True):
        assert few.temp_size_in_bytes == many.temp_size_in_bytes
        assert many.alias_size_in_bytes > 30 * few.alias_size_in_bytes  # the pool is aliased, not copied


def test_bfloat16_inputs_and_pools():
    # The rule computes in float32 from bfloat16 inputs, keeps the float32 state pool, returns
    # bfloat16; the conv keeps a bfloat16 pool of the inputs as given.
    rng = np.random.default_rng(5)
    x = _inputs(rng, 40, 2, 4, 16, 8)
    rounded = {n: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for n, a in x.items()}
    pool = np.zeros((2, 4, 16, 8), np.float32)
    o, new_pool = _run(**{n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}, pool=pool, indices=[1],
                       has_state=[False], q_lens=[40], num_seqs=1, chunk_size=16)  # fmt: skip
    want, final = numpy_gated_delta(*(rounded[n] for n in ("q", "k", "v", "g", "beta")), pool[1])
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == np.float32
    np.testing.assert_allclose(o.astype(np.float32), want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(new_pool[1], final, atol=1e-4, rtol=1e-4)
    channels = rng.standard_normal((6, 5)).astype(np.float32)
    bf16_pool = np.zeros((1, 2, 5), jnp.bfloat16)
    y, conv_pool = _conv(jnp.asarray(channels, jnp.bfloat16), np.ones((3, 5), np.float32), bf16_pool,
                         [0], [False], [6], 1, activation=False)  # fmt: skip
    assert y.dtype == jnp.bfloat16 and conv_pool.dtype == jnp.bfloat16
    np.testing.assert_array_equal(conv_pool[0], np.asarray(jnp.asarray(channels[-2:], jnp.bfloat16)))


@pytest.mark.parametrize("size", [1, 2, 5, 16, 64])
def test_unit_lower_inverse_against_numpy(size):
    rng = np.random.default_rng(size)
    strict = np.tril(rng.uniform(-1.0, 1.0, (3, 2, size, size)), -1).astype(np.float32)
    want = np.linalg.inv(np.eye(size) + strict.astype(np.float64))
    # Jitted, as the rule calls it: one compile instead of each round's ops compiled one by one.
    got = jax.jit(unit_lower_inverse)(jnp.asarray(strict))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_rule_calls_no_lapack_solve():
    # LAPACK's batched trsm on CPU waits on the intra-op thread pool it fills: four simulated
    # devices entering it together (after a collective) deadlock, so the rule solves in matmuls.
    x = _inputs(np.random.default_rng(0), 130, 2, 4, 16, 8)
    rule = jax.jit(lambda *a: gated_delta_rule(*a, backend="xla"))
    batch = (jnp.asarray([0], jnp.int32), jnp.asarray([False]), jnp.asarray([0, 130], jnp.int32),
             jnp.asarray([1], jnp.int32))  # fmt: skip
    text = rule.lower(*x.values(), jnp.zeros((2, 4, 16, 8), jnp.float32), *batch).compile().as_text()
    assert "custom-call" not in text or "trsm" not in text.lower(), "a LAPACK triangular solve"
