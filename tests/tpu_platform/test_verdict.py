# SPDX-License-Identifier: Apache-2.0
"""A verify shape's verdict from the forward's rows (`speculation.verdict`): the rows each
request's positions take, the greedy verdict on the host against hand-worked cases and against
`rejection.verify_drafts`, and the program for random rows against both."""

import dataclasses

import numpy as np

from tests.speculation_statistics import random_tensors
from tpu_platform.sampling import SamplerFlags
from tpu_platform.speculation.rejection import verify_drafts
from tpu_platform.speculation.verdict import draft_rows, greedy_verdict, make_verify_rows


def test_each_requests_positions_take_its_last_known_row_and_its_drafts_rows():
    # Request 0: last known token at row 0, 4 drafts (rows 1-4); request 1: at row 7, 2 drafts
    # (rows 8-9, then row 9 again); request 2: at row 10, none. Row 0 past the requests.
    index = draft_rows(np.array([0, 7, 10]), np.array([4, 2, 0]), k=4, rows=4)
    assert index.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 9, 9], [10] * 5, [0] * 5]


def test_the_greedy_verdict_keeps_drafts_while_each_equals_the_greedy_token_before_it():
    # Greedy token of each of 11 rows. Request 0 (rows 0-4) drafts 5 6 8 9: 5 and 6 equal the
    # greedy tokens of rows 0 and 1, 8 differs from row 2's 7 -> [5 6 7], count 3. Request 1
    # (rows 5-7) drafts 3 9: 3 kept, 9 is not row 6's 3 -> [3 3], count 2. Request 2 (row 8),
    # no drafts -> [4], count 1. Request 3 (rows 9-10) drafts 2, kept, bonus row 10's 1 -> [2 1].
    row_greedy = np.array([5, 6, 7, 9, 1, 3, 3, 4, 4, 2, 1], np.int32)
    known, num = np.array([0, 5, 8, 9]), np.array([4, 2, 0, 1])
    drafts = np.array([[5, 6, 8, 9], [3, 9, -1, -1], [-1] * 4, [2, -1, -1, -1]], np.int32)
    tokens, counts = greedy_verdict(row_greedy, draft_rows(known, num, 4, 4), drafts, num)
    assert counts.tolist() == [3, 2, 1, 2]
    assert [tokens[i, : counts[i]].tolist() for i in range(4)] == [[5, 6, 7], [3, 3], [4], [2, 1]]


def _step(seed: int, vocab: int = 12):
    """A verify step of 4 requests with up to 3 drafts each: every row's logits, and drafts that
    mostly follow the argmax (so that runs of acceptance end at each position)."""
    rng = np.random.default_rng(seed)
    num = np.array([3, 2, 0, 3], np.int32)
    known = np.concatenate([[0], np.cumsum(num + 1)[:-1]])
    row_logits = rng.normal(size=(16, vocab)).astype(np.float32)
    index = draft_rows(known, num, 3, 4)
    argmax = row_logits.argmax(axis=1)[index]
    drafts = np.where(rng.random((4, 3)) < 0.7, argmax[:, :3], rng.integers(0, vocab, (4, 3)))
    drafts = np.where(np.arange(3) < num[:, None], drafts, -1).astype(np.int32)
    return row_logits, index, drafts, num


def test_the_greedy_verdict_is_verify_drafts_with_greedy_rows():
    for seed in range(8):
        row_logits, index, drafts, num = _step(seed)
        tokens, counts = greedy_verdict(row_logits.argmax(axis=1), index, drafts, num)
        reference = verify_drafts(
            row_logits[index], drafts, num, random_tensors(4, 0.0), flags=SamplerFlags(all_greedy=True)
        )
        np.testing.assert_array_equal(counts, np.asarray(reference[1]))
        for i in range(4):  # the tokens past a row's count are not part of its verdict
            np.testing.assert_array_equal(tokens[i, : counts[i]], np.asarray(reference[0])[i, : counts[i]])


def test_the_rows_program_verifies_the_rows_logits_greedy_and_random_rows_alike():
    verify = make_verify_rows(feed_width=8)
    row_logits, index, drafts, num = _step(3)
    tensors = random_tensors(4, 0.8, seed=5)  # rows 1 and 3 greedy, 0 and 2 random
    tensors = dataclasses.replace(tensors, temperature=np.array([0.8, 0.0, 0.8, 0.0], np.float32))
    first, tokens, counts = verify(row_logits, index, drafts, num, tensors, flags=SamplerFlags())
    reference = verify_drafts(row_logits[index], drafts, num, tensors, flags=SamplerFlags())
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(reference[1]))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(reference[0]))
    np.testing.assert_array_equal(np.asarray(first), np.pad(np.asarray(reference[0])[:, 0], (0, 4)))
    greedy_tokens, greedy_counts = greedy_verdict(row_logits.argmax(axis=1), index, drafts, num)
    for i in (1, 3):
        assert counts[i] == greedy_counts[i]
        assert np.asarray(tokens)[i, : counts[i]].tolist() == greedy_tokens[i, : counts[i]].tolist()
