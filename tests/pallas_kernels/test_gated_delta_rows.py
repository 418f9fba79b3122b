# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet ops with P slots a sequence (`state_indices [R, P]`, speculative decoding): a
sequence of at most P rows leaves the state after its row j in its slot of column j, a longer
one its final state in column 0, every sequence starting from column 0. Hand-worked cases with
the arithmetic in the comments; ragged batches (verifications beside prefill chunks, decodes
alone, chunks smaller and larger than P) against the NumPy token-by-token loop over each
sequence's rows up to j; the pools still updated in place."""

from __future__ import annotations

import numpy as np
import pytest

from tests.pallas_kernels.test_gated_delta import (
    _HAND,
    _compiled_memory,
    _conv,
    _inputs,
    _run,
    numpy_conv,
    numpy_gated_delta,
)

_NAMES = ("q", "k", "v", "g", "beta")


# One sequence slot: chunks of `chunk_size` rows; two: the two rows are taken one a round.
# (64, 1) runs the one-slot path as (2, 1) does, with the rows padded in a longer chunk: the slow
# tier's.
@pytest.mark.parametrize(
    "chunk_size, seq_slots", [(2, 1), pytest.param(64, 1, marks=pytest.mark.slow), (64, 2)]
)
def test_hand_worked_state_after_each_row(chunk_size, seq_slots):
    # `_HAND`'s two tokens from S = 2 (test_gated_delta): S = 1.5 after row 0, 4 after row 1.
    # Slots [1, 2, 3] (P = 3) hold 2: the rule starts from slot 1, leaves 1.5 in slot 1 and 4 in
    # slot 2; slot 3 (no third row) and slot 0 (no sequence's) keep their values.
    pool = np.array([7.0, 2.0, 2.0, 2.0], np.float32).reshape(4, 1, 1, 1)
    batch = dict(indices=[[1, 2, 3], [0, 0, 0]][:seq_slots], has_state=[True, False][:seq_slots],
                 q_lens=[2, 0][:seq_slots], num_seqs=1)  # fmt: skip
    o, pool = _run(**_HAND, pool=pool, **batch, chunk_size=chunk_size, qk_l2norm=False)
    np.testing.assert_allclose(o[:, 0, 0], [1.5, 4.0], rtol=1e-6)
    np.testing.assert_allclose(pool.ravel(), [7.0, 1.5, 4.0, 2.0], rtol=1e-6)


def test_hand_worked_longer_sequence_leaves_its_final_state_first():
    # Three rows, P = 2: no state after each row; the final state goes to column 0 (slot 1).
    # From S = 2 with `_HAND`'s rows then a third (g = ln 0.5, beta = 1, v = 0): S = 4 after two
    # rows, then S = 2, S += 1 * (0 - 2) -> 0.
    x = {n: np.concatenate([a, a[1:]]) for n, a in _HAND.items()}
    x["v"][2] = 0.0
    pool = np.array([7.0, 2.0, 5.0], np.float32).reshape(3, 1, 1, 1)
    o, pool = _run(**x, pool=pool, indices=[[1, 2], [0, 0]], has_state=[True, False], q_lens=[3, 0],
                   num_seqs=1, chunk_size=2, qk_l2norm=False)  # fmt: skip
    np.testing.assert_allclose(o[:, 0, 0], [1.5, 4.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(pool.ravel(), [7.0, 0.0, 5.0], atol=1e-6)


def test_conv_hand_worked_inputs_after_each_row():
    # Width 3: a slot holds the last 2 inputs. Carried [10, 20], inputs [1, 2], slots [0, 1, 2]:
    # after row 0 the last inputs are [20, 1] (slot 0), after row 1 [1, 2] (slot 1); slot 2 stays.
    # The outputs are the one-slot conv's: 10 + 2 * 20 + 3 * 1 = 53 and 20 + 2 + 6 = 28.
    weight = np.array([[1.0], [2.0], [3.0]], np.float32)
    x = np.array([[1.0], [2.0]], np.float32)
    pool = np.array([[[10.0], [20.0]], [[0.0], [0.0]], [[8.0], [9.0]]], np.float32)
    y, new = _conv(x, weight, pool, [[0, 1, 2]], [True], [2], 1, activation=False)
    np.testing.assert_allclose(y[:, 0], [53.0, 28.0])
    np.testing.assert_allclose(new[:, :, 0], [[20.0, 1.0], [1.0, 2.0], [8.0, 9.0]])


# (q_lens of the live sequences, sequence slots, padding rows, chunk size, P)
GRID = [
    ((3, 1, 3), 3, 1, 64, 3),  # verifications of 2 drafts, one of none
    ((1, 1, 1), 4, 1, 4, 3),  # decodes alone: chunks of one row, a round a row
    ((5, 2, 9, 1), 5, 2, 2, 5),  # chunks smaller than P: two rounds hold a short sequence's rows
    ((6, 2, 0, 4), 5, 0, 4, 4),  # a prefill chunk longer than P, an empty sequence
]


# One program a batch: the fast tier keeps the verifications and the prefill chunk longer than P;
# decodes alone (test_gated_delta.py's fast decodes) and the short chunks are the slow tier's.
@pytest.mark.parametrize(
    "q_lens, seq_slots, pad_rows, chunk_size, positions",
    [pytest.param(*case, marks=pytest.mark.slow) if case in (GRID[1], GRID[2]) else case for case in GRID],
)
def test_ragged_states_after_each_row_against_numpy(q_lens, seq_slots, pad_rows, chunk_size, positions):
    rng = np.random.default_rng(sum(q_lens) + positions)
    heads, key_dim, value_dim = 2, 8, 4
    num_slots = seq_slots * positions + 1
    x = _inputs(rng, sum(q_lens) + pad_rows, 1, heads, key_dim, value_dim)
    pool = rng.standard_normal((num_slots, heads, key_dim, value_dim)).astype(np.float32)
    indices = rng.permutation(num_slots)[: seq_slots * positions].reshape(seq_slots, positions)
    has_state = np.arange(seq_slots) % 2 == 0
    lens = list(q_lens) + [0] * (seq_slots - len(q_lens))
    o, new_pool = _run(**x, pool=pool, indices=indices, has_state=has_state, q_lens=lens,
                       num_seqs=len(q_lens), chunk_size=chunk_size)  # fmt: skip
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    expected = pool.copy()
    for i, n in enumerate(q_lens):
        start = pool[indices[i, 0]] if has_state[i] else np.zeros_like(pool[0])
        rows = [x[name][cu[i] : cu[i + 1]] for name in _NAMES]
        want, final = numpy_gated_delta(*rows, start)
        np.testing.assert_allclose(o[cu[i] : cu[i + 1]], want, atol=2e-5, rtol=1e-4, err_msg=f"sequence {i}")
        if 1 <= n <= positions:
            for j in range(n):
                expected[indices[i, j]] = numpy_gated_delta(*(r[: j + 1] for r in rows), start)[1]
        else:
            expected[indices[i, 0]] = final
    np.testing.assert_allclose(new_pool, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("q_lens, positions", [((3, 6, 1), 3), ((1, 1), 2)])
def test_conv_ragged_inputs_after_each_row_against_numpy(q_lens, positions):
    rng = np.random.default_rng(len(q_lens) + positions)
    width, channels, seq_slots = 4, 5, len(q_lens)
    x = rng.standard_normal((sum(q_lens) + 1, channels)).astype(np.float32)
    weight = rng.standard_normal((width, channels)).astype(np.float32)
    pool = rng.standard_normal((seq_slots * positions + 1, width - 1, channels)).astype(np.float32)
    indices = rng.permutation(pool.shape[0])[: seq_slots * positions].reshape(seq_slots, positions)
    has_state = np.arange(seq_slots) % 2 == 0
    y, new = _conv(x, weight, pool, indices, has_state, q_lens, len(q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    expected = pool.copy()
    for i, n in enumerate(q_lens):
        carried = pool[indices[i, 0]] if has_state[i] else np.zeros_like(pool[0])
        want, last = numpy_conv(x[cu[i] : cu[i + 1]], weight, carried)
        np.testing.assert_allclose(y[cu[i] : cu[i + 1]], want, atol=1e-5, rtol=1e-5)
        if n <= positions:
            for j in range(n):
                expected[indices[i, j]] = numpy_conv(x[cu[i] : cu[i] + j + 1], weight, carried)[1]
        else:
            expected[indices[i, 0]] = last
    np.testing.assert_allclose(new, expected, rtol=1e-6)


@pytest.mark.slow  # two compiles of each op; the one-slot ops' sibling runs in the fast tier
def test_states_after_each_row_update_the_pools_in_place():
    # A verification step's programs (4 sequences of 3 rows, P = 3) alias their donated pools
    # and their scratch memory does not grow with the pool.
    small, large = _compiled_memory(16, 12, columns=3), _compiled_memory(256, 12, columns=3)
    for few, many in zip(small, large, strict=True):
        assert few.temp_size_in_bytes == many.temp_size_in_bytes
        assert many.alias_size_in_bytes > 10 * few.alias_size_in_bytes
