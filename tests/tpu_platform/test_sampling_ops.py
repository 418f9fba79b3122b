# SPDX-License-Identifier: Apache-2.0
"""Each jnp transform against hand-computed cases and the NumPy reference (`sampling/reference.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_platform.sampling import (
    apply_grammar_bitmask,
    filters,
    gather_logprobs,
    noise,
    ops,
    pack_token_bitmask,
)
from tpu_platform.sampling import reference as ref
from tpu_platform.sampling.host import BadWords
from tpu_platform.sampling.tensors import KIND_BAN, KIND_BIAS, KIND_PAD, KIND_STOP

INF = np.inf


def _logits(rows, vocab, seed=0):
    return np.random.default_rng(seed).normal(0.0, 2.0, (rows, vocab)).astype(np.float32)


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5)


# -- bitmasks (grammar and allowed_token_ids) -----------------------------------------------------


def test_bitmask_by_hand():
    # Word 0 = 0b101 allows tokens 0 and 2; word 1 = 1 allows token 32.
    logits = np.zeros((1, 40), np.float32)
    out = np.asarray(apply_grammar_bitmask(logits, np.array([[0b101, 1]], np.int32)))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [0, 2, 32]


def test_bitmask_narrower_than_vocab_leaves_the_tail_and_unmasked_rows_alone():
    logits = _logits(3, 80)
    bitmask = np.array([[0, 0], [0, 0], [-1, 7]], np.int32)  # covers tokens [0, 64)
    out = np.asarray(apply_grammar_bitmask(logits, bitmask, np.array([True, False, True])))
    assert np.all(np.isneginf(out[0, :64])) and np.array_equal(out[0, 64:], logits[0, 64:])
    assert np.array_equal(out[1], logits[1])
    assert np.flatnonzero(np.isneginf(out[2])).tolist() == list(range(35, 64))


def test_bitmask_matches_reference_and_pack_roundtrip():
    rng = np.random.default_rng(1)
    vocab = 70
    logits = _logits(4, vocab)
    allowed = [rng.choice(vocab, size=n, replace=False) for n in (1, 5, 33, vocab)]
    bitmask = np.stack([pack_token_bitmask(ids, vocab) for ids in allowed])
    assert bitmask.shape == (4, 3) and bitmask.dtype == np.int32
    out = np.asarray(apply_grammar_bitmask(logits, bitmask))
    for r, ids in enumerate(allowed):
        assert set(np.flatnonzero(np.isfinite(out[r]))) == set(ids.tolist())
        np.testing.assert_array_equal(out[r], ref.bitmask_reference(logits[r], bitmask[r]))


def test_bitmask_matches_xgrammar_kernel():
    torch = pytest.importorskip("torch")
    xgrammar = pytest.importorskip("xgrammar")
    logits = _logits(3, 100)
    bitmask = np.random.default_rng(2).integers(-(2**31), 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    expected = torch.from_numpy(logits.copy())
    xgrammar.apply_token_bitmask_inplace(expected, torch.from_numpy(bitmask))
    np.testing.assert_array_equal(np.asarray(apply_grammar_bitmask(logits, bitmask)), expected.numpy())


# -- bad words (host matcher), min_tokens, logit_bias ------------------------------------------


def test_bad_words_matcher_by_hand():
    words = BadWords.build([(5,), (1, 2, 3), (2, 3), (9, 9), (7, 1, 2, 4)])
    # (5,) always; "1 2 | 3" and "2 | 3" both ban 3; "9 | 9" needs a 9; "7 1 2 | 4" matches too.
    assert sorted(words.banned(np.array([7, 1, 2]))) == [3, 3, 4, 5]
    assert sorted(words.banned(np.array([], np.int32))) == [5]  # prefixes longer than the output skip
    assert sorted(words.banned(np.array([2]))) == [3, 5]
    assert sorted(words.banned(np.array([9, -1]))) == [5]  # a placeholder matches nothing
    for output in ([7, 1, 2], [], [2], [4, 9], [1, 2]):
        row = np.zeros(12, np.float32)
        expected = ref.bad_words_reference(row, [(5,), (1, 2, 3), (2, 3), (9, 9), (7, 1, 2, 4)], output)
        assert set(words.banned(np.array(output, np.int32)).tolist()) == set(
            np.flatnonzero(np.isneginf(expected))
        )


def _sparse(entries, rows, width, vocab):
    """entries[r] = [(id, value, kind)] -> padded (ids, values, kinds)."""
    ids = np.full((rows, width), vocab, np.int32)
    values = np.zeros((rows, width), np.float32)
    kinds = np.full((rows, width), KIND_PAD, np.int8)
    for r, row in enumerate(entries):
        for j, (t, v, k) in enumerate(row):
            ids[r, j], values[r, j], kinds[r, j] = t, v, k
    return ids, values, kinds


def test_sparse_ops_by_hand():
    logits = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, -INF, 0.5, 2.0]], np.float32)
    ids, values, kinds = _sparse(
        [
            [(1, 0, KIND_BAN), (3, 0, KIND_STOP), (0, 1.5, KIND_BIAS)],
            [(1, 7.0, KIND_BIAS), (2, -0.5, KIND_BIAS)],
        ],
        2,
        4,
        4,
    )
    out = ops.apply_bad_words(logits, ids, kinds)
    out = ops.apply_min_tokens(out, ids, kinds, np.zeros(2, bool))
    out = np.asarray(ops.apply_logit_bias(out, ids, values, kinds))
    np.testing.assert_array_equal(out, [[2.5, -INF, 3.0, -INF], [1.0, -INF, 0.0, 2.0]])


def test_min_tokens_restores_stops_only_for_dead_structured_rows():
    # Grammar left only tokens 1 (EOS) and 2 (a bad word); min_tokens masks 1 -> nothing left.
    logits = np.array([[-INF, 0.7, -INF, -INF]] * 3, np.float32)
    ids, _, kinds = _sparse(
        [[(1, 0, KIND_STOP)], [(1, 0, KIND_STOP)], [(1, 0, KIND_STOP), (3, 0, KIND_STOP)]], 3, 2, 4
    )
    out = np.asarray(ops.apply_min_tokens(logits, ids, kinds, np.array([True, False, True])))
    np.testing.assert_array_equal(out[0], logits[0])  # restored
    assert np.all(np.isneginf(out[1]))  # not structured: stays dead
    np.testing.assert_array_equal(out[2], logits[2])  # -inf stop 3 is not "restored"
    expected = ref.min_tokens_reference(logits[2], [1, 3], structured=True)
    np.testing.assert_array_equal(out[2], expected)


def test_sparse_ops_match_reference():
    rng = np.random.default_rng(3)
    vocab, rows = 50, 6
    logits = _logits(rows, vocab, 3)
    logits[0, :45] = -INF  # a row the min-tokens restore applies to
    entries = []
    for r in range(rows):
        row = [(int(t), 0.0, KIND_BAN) for t in rng.choice(vocab, 3, replace=False)]
        row += [(int(t), 0.0, KIND_STOP) for t in range(45, 50)] if r == 0 else [(7, 0.0, KIND_STOP)]
        row += [(int(t), float(rng.normal()), KIND_BIAS) for t in rng.choice(vocab, 4, replace=False)]
        entries.append(row)
    ids, values, kinds = _sparse(entries, rows, 16, vocab)
    restore = np.array([True, False, True, False, True, False])
    out = ops.apply_bad_words(logits, ids, kinds)
    out = ops.apply_min_tokens(out, ids, kinds, restore)
    out = np.asarray(ops.apply_logit_bias(out, ids, values, kinds))
    for r in range(rows):
        expected = logits[r].copy()
        expected[[t for t, _, k in entries[r] if k == KIND_BAN]] = -INF
        expected = ref.min_tokens_reference(
            expected, [t for t, _, k in entries[r] if k == KIND_STOP], restore[r]
        )
        for t, v, k in entries[r]:
            if k == KIND_BIAS:
                expected[t] += np.float32(v)
        _close(out[r], expected)


# -- penalties ----------------------------------------------------------------------------------


def test_penalties_by_hand():
    # prompt [0], outputs [1, 1, 2]; repetition 2, frequency 0.5, presence 0.25.
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    out = ops.apply_penalties(
        logits,
        np.array([[0, 1, 1, 2]]),
        np.array([1]),
        np.array([4]),
        np.array([0.25], np.float32),
        np.array([0.5], np.float32),
        np.array([2.0], np.float32),
    )
    # token 0: prompt only -> 2 / 2 = 1. token 1: -1 * 2 - 0.5 * 2 - 0.25 = -3.25.
    # token 2: 0.5 / 2 - 0.5 - 0.25 = -0.5. token 3: unseen, unchanged.
    np.testing.assert_allclose(np.asarray(out), [[1.0, -3.25, -0.5, 3.0]])


def test_penalties_match_reference():
    rng = np.random.default_rng(4)
    vocab, rows, width = 40, 5, 32
    logits = _logits(rows, vocab, 4)
    ids = np.full((rows, width), -1, np.int32)
    prompt_len, length = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    params = rng.uniform([-2, -2, 0.5], [2, 2, 2.0], (rows, 3)).astype(np.float32)
    params[3] = (0.0, 0.0, 1.0)  # a neutral row
    histories = []
    for r in range(rows):
        prompt, output = (
            rng.integers(0, vocab, rng.integers(0, 12)),
            rng.integers(0, vocab, rng.integers(0, 12)),
        )
        output[: r % 2] = -1  # an async placeholder is ignored
        ids[r, : prompt.size + output.size] = np.concatenate([prompt, output])
        prompt_len[r], length[r] = prompt.size, prompt.size + output.size
        histories.append((prompt, output))
    out = np.asarray(ops.apply_penalties(logits, ids, prompt_len, length, *params.T))
    for r, (prompt, output) in enumerate(histories):
        _close(out[r], ref.penalties_reference(logits[r], prompt, output, *params[r]))
    np.testing.assert_array_equal(out[3], logits[3])


# -- temperature, min_p, top-k, top-p -----------------------------------------------------------


def test_temperature_leaves_greedy_rows_alone():
    logits = _logits(3, 8)
    out = np.asarray(ops.apply_temperature(logits, np.array([0.5, 0.0, 2.0], np.float32)))
    _close(out, logits / np.array([[0.5], [1.0], [2.0]], np.float32))


def test_min_p_by_hand():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]], np.float32))
    out = np.asarray(filters.apply_min_p(logits, np.array([0.2, 0.0], np.float32)))
    assert np.isneginf(out[0]).tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5
    np.testing.assert_array_equal(out[1], logits[1])


@pytest.mark.parametrize(
    ("k", "kept"), [(1, [1, 2]), (2, [1, 2]), (3, [1, 2, 3]), (0, [0, 1, 2, 3, 4]), (9, [0, 1, 2, 3, 4])]
)
@pytest.mark.parametrize("candidates", [1, 256])  # 1: the exact bisection path
def test_top_k_by_hand_keeps_ties(k, kept, candidates):
    logits = np.array([[1.0, 3.0, 3.0, 2.0, 0.0]], np.float32)
    top_p = np.array([1.0], np.float32)
    out = np.asarray(filters.apply_top_k_top_p(logits, np.array([k]), top_p, candidates=candidates))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == kept
    np.testing.assert_array_equal(out[0, kept], logits[0, kept])


@pytest.mark.parametrize(
    ("p", "kept"), [(0.45, [2, 3]), (0.35, [3]), (0.01, [3]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])]
)
@pytest.mark.parametrize("candidates", [1, 256])
def test_top_p_by_hand(p, kept, candidates):
    # Ascending probs 0.1 0.2 0.3 0.4: cumsum 0.1 0.3 0.6 1.0; drop where cumsum <= 1 - p.
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32))
    top_p = np.array([p], np.float32)
    out = np.asarray(filters.apply_top_k_top_p(logits, np.array([0]), top_p, candidates=candidates))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == kept


# rows beyond the candidates use the bisection; one program a count: 16 and 256 are the slow tier's
@pytest.mark.parametrize(
    "candidates", [4, pytest.param(16, marks=pytest.mark.slow), pytest.param(256, marks=pytest.mark.slow)]
)
def test_filters_match_reference(candidates):
    rng = np.random.default_rng(5)
    vocab, rows = 64, 10
    logits = _logits(rows, vocab, 5)
    logits[2, :10] = -INF
    logits[[6, 8]] *= 0.1  # flat rows: wide nuclei
    top_k = np.array([0, 1, 5, 64, 10, 3, 0, 30, 40, -1], np.int32)
    top_p = np.array([1.0, 0.5, 0.9, 0.3, 1.0, 0.99, 0.6, 0.8, 0.97, 0.05], np.float32)
    min_p = rng.choice([0.0, 0.05, 0.2], rows).astype(np.float32)
    min_p[[6, 8]] = 0.0
    masked = filters.apply_min_p(logits, min_p)
    out = np.asarray(filters.apply_top_k_top_p(masked, top_k, top_p, candidates=candidates))
    for r in range(rows):
        expected = ref.top_k_top_p_reference(ref.min_p_reference(logits[r], min_p[r]), top_k[r], top_p[r])
        _close(out[r], expected)
    assert np.isfinite(out[6]).sum() > 16 and np.isfinite(out[8]).sum() > 16  # beyond the candidates


def test_filter_paths_agree_bit_for_bit():
    logits = _logits(6, 300, 8) * 0.3
    top_k = np.array([0, 250, 7, 0, 100, 0], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.999, 0.95, 1.0], np.float32)
    outs = [np.asarray(filters.apply_top_k_top_p(logits, top_k, top_p, candidates=c)) for c in (1, 8, 300)]
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[2])


# -- sampling primitives and logprobs -------------------------------------------------------------


def test_greedy_takes_the_first_max():
    assert np.asarray(ops.greedy_sample(np.array([[1.0, 3.0, 3.0], [-INF, -INF, 0.0]]))).tolist() == [1, 2]


@pytest.mark.parametrize("width", [5, 1024, 3000, 49152])
def test_first_argmax_matches_numpy_with_ties_across_blocks(width):
    rng = np.random.default_rng(width)
    x = rng.integers(-50, 50, (9, width)).astype(np.float32)  # many ties
    x[0] = -INF  # all masked: index 0
    x[1, -1] = 1e9  # the last column, in the padded final block
    x[2, [3, width - 1]] = 1e9  # tie between the first and the last block: the first wins
    x[3, :] = 7.0  # all equal
    np.testing.assert_array_equal(np.asarray(ops.first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_random_sample_never_draws_masked_tokens():
    logits = np.full((64, 10), -INF, np.float32)
    logits[:, [2, 7]] = 0.0
    keys = noise.row_keys(
        np.zeros((64, 2), np.uint32), np.arange(64, dtype=np.uint32), np.zeros(64, np.int32)
    )
    tokens = np.asarray(noise.random_sample(jnp.asarray(logits), keys))
    assert set(tokens.tolist()) == {2, 7}


def test_row_keys_are_prngkey_of_the_seed_folded():
    keys = noise.row_keys(np.array([[0, 1234]], np.uint32), np.array([5], np.uint32), np.array([3], np.int32))
    expected = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(1234), 5), 3)
    np.testing.assert_array_equal(keys[0], jax.random.key_data(expected))


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_gather_logprobs_matches_reference(num_logprobs):
    logits = _logits(4, 30, 6)
    logits[1, [3, 8, 20]] = 5.0  # ties: lower id first, rank counts every tie
    tokens = np.array([0, 8, 29, 11], np.int32)
    logprobs = np.asarray(ops.compute_logprobs(logits))
    ids, values, ranks = (np.asarray(x) for x in gather_logprobs(jnp.asarray(logprobs), tokens, num_logprobs))
    assert ids.shape == values.shape == (4, num_logprobs + 1)
    for r in range(4):
        ref_ids, ref_values, ref_rank = ref.logprobs_reference(
            ref.log_softmax(logits[r]), int(tokens[r]), num_logprobs
        )
        assert ids[r].tolist() == ref_ids
        _close(values[r], ref_values)
        assert ranks[r] == ref_rank
    assert ranks[1] == 3  # token 8 ties with 3 and 20 at the top
