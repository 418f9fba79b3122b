# SPDX-License-Identifier: Apache-2.0
"""Sampling options that read a request's history (penalties, bad words, min_tokens) or mask its
logits (logit bias, allowed ids, a grammar's bitmask row for each position) at every drafted
position, against the NumPy reference of vLLM's sampler (`sampling.reference`): position j of a
request is sampled as if its history held the j drafts before it
(`SamplingBatch.prepare_positions`), and the verification applies them before the argmax and
before the distribution random rows draw from (`rejection.verify_drafts`); each position's
logprobs are the sampler's for its output token (`rejection.position_logprobs`)."""

import dataclasses

import numpy as np
import pytest

from tpu_platform.sampling import SamplerFlags, SamplingBatch, SamplingOptions
from tpu_platform.sampling.reference import log_softmax, logprobs_reference, reference_row
from tpu_platform.sampling.sampler import process_logits
from tpu_platform.sampling.uniform import with_all_extras
from tpu_platform.speculation.rejection import position_logprobs, verify_drafts
from tpu_platform.speculation.verifier import SpeculativeDecoding

VOCAB = 40
WIDTH = 4  # three drafts a request, then the bonus position
OPTIONS = [
    SamplingOptions(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.6),
    SamplingOptions(
        temperature=0.0,
        bad_words_token_ids=((7, 8), (9,)),
        min_tokens=5,
        eos_token_id=2,
        logit_bias={2: 6.0, 11: -3.0},
    ),
    SamplingOptions(temperature=0.0, allowed_token_ids=tuple(range(3, 30)), repetition_penalty=1.3),
]


@dataclasses.dataclass
class History:
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray


def _requests(seed: int) -> tuple[SamplingBatch, History, np.ndarray, np.ndarray]:
    """A batch of the three requests (rows 2, 0, 5), their histories with three drafts each
    written after their known tokens, and the drafts (one request drafts two)."""
    rng = np.random.default_rng(seed)
    batch = SamplingBatch(8, VOCAB, 64)
    rows = np.array([2, 0, 5])
    history = History(np.zeros((8, 64), np.int32), np.zeros(8, np.int32), np.zeros(8, np.int32))
    drafts = rng.integers(3, 20, (3, WIDTH - 1)).astype(np.int32)
    drafts[1, :2] = [7, 8]  # the bad word (7, 8): 8 is banned after the draft 7
    for row, options, prompt, output, count in zip(
        rows, OPTIONS, (6, 5, 7), (3, 2, 4), (3, 3, 2), strict=True
    ):
        batch.add_request(int(row), options)
        tokens = rng.integers(3, 20, prompt + output)
        history.token_ids[row, : tokens.size] = tokens
        history.token_ids[row, tokens.size : tokens.size + count] = drafts[rows.tolist().index(row), :count]
        history.num_tokens[row], history.num_prompt_tokens[row] = tokens.size, prompt
    return batch, history, rows, drafts


def _expected(history: History, rows, num_drafts, logits: np.ndarray) -> list[list]:
    """The reference's view of each request's position j: its history and the drafts before it."""
    out = []
    for i, row in enumerate(rows):
        n, p = int(history.num_tokens[row]), int(history.num_prompt_tokens[row])
        positions = []
        for j in range(WIDTH):
            seen = history.token_ids[row, : n + min(j, num_drafts[i])].tolist()
            positions.append(reference_row(logits[i * WIDTH + j], OPTIONS[i], seen[:p], seen[p:]))
        out.append(positions)
    return out


def test_each_position_is_processed_with_the_drafts_before_it_in_its_history():
    batch, history, rows, _ = _requests(seed=0)
    num_drafts = np.array([3, 3, 2], np.int32)
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 4, history, step_seed=1)
    assert tensors.temperature.shape == (4 * WIDTH,)
    logits = np.random.default_rng(1).normal(0, 2, (4 * WIDTH, VOCAB)).astype(np.float32)
    got = np.asarray(process_logits(logits, tensors, flags))
    for i, positions in enumerate(_expected(history, rows, num_drafts, logits)):
        for j, want in enumerate(positions):
            np.testing.assert_allclose(got[i * WIDTH + j], want.processed, rtol=1e-6, err_msg=f"{i}, {j}")
    # What the history alone would give (no drafts in it) differs: the drafts count.
    alone, alone_flags = batch.prepare(rows, 4, history, step_seed=1)
    first = np.asarray(process_logits(logits[::WIDTH], alone, alone_flags))
    np.testing.assert_allclose(got[::WIDTH][:3], first[:3], rtol=1e-6)  # position 0: the same
    assert not np.allclose(
        got[2::WIDTH][:3], np.asarray(process_logits(logits[2::WIDTH], alone, alone_flags))[:3]
    )


def _drafts_keeping(history: History, rows, num_drafts, logits, keeps, options) -> np.ndarray:
    """Request i's drafts, written into its history one by one: the reference's processed argmax
    at each of its first `keeps[i]` positions (given the drafts before it), then another token."""
    drafts = np.full((rows.size, WIDTH - 1), -1, np.int32)
    for i, row in enumerate(rows):
        n, p = int(history.num_tokens[row]), int(history.num_prompt_tokens[row])
        for j in range(num_drafts[i]):
            seen = history.token_ids[row, : n + j].tolist()
            greedy = reference_row(logits[i * WIDTH + j], options[i], seen[:p], seen[p:]).greedy
            drafts[i, j] = greedy if j < keeps[i] else (greedy + 1) % VOCAB
            history.token_ids[row, n + j] = drafts[i, j]
    return drafts


def test_verification_keeps_drafts_while_they_equal_the_processed_argmax():
    batch, history, rows, _ = _requests(seed=2)
    num_drafts = np.array([3, 3, 2], np.int32)
    logits = np.random.default_rng(3).normal(0, 2, (3 * WIDTH, VOCAB)).astype(np.float32)
    logits[2 * WIDTH :, 35] += 8.0  # the raw argmax of the third request, outside its allowed ids
    # The second request's bonus position is its fifth output: past min_tokens, EOS and its bias.
    keeps = (3, 3, 0)
    drafts = _drafts_keeping(history, rows, num_drafts, logits, keeps, OPTIONS)
    expected = _expected(history, rows, num_drafts, logits)
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 3, history, step_seed=1)
    tokens, counts = verify_drafts(logits.reshape(3, WIDTH, VOCAB), drafts, num_drafts, tensors, flags=flags)
    assert np.asarray(counts).tolist() == [k + 1 for k in keeps]
    for i, keep in enumerate(keeps):
        want = [*drafts[i, :keep].tolist(), expected[i][keep].greedy]
        assert np.asarray(tokens)[i, : keep + 1].tolist() == want


def test_random_rows_draw_from_each_positions_processed_distribution():
    # top_k=1 makes each position's p one-hot on its processed argmax: a draft equal to it is
    # always kept, any other always rejected and replaced by it.
    batch, history, rows, _ = _requests(seed=4)
    options = [dataclasses.replace(o, temperature=1.0, top_k=1, seed=5) for o in OPTIONS]
    for row, option in zip(rows, options, strict=True):
        batch.add_request(int(row), option)
    num_drafts = np.array([3, 3, 2], np.int32)
    logits = np.random.default_rng(5).normal(0, 2, (3 * WIDTH, VOCAB)).astype(np.float32)
    keeps = (2, 0, 2)
    drafts = _drafts_keeping(history, rows, num_drafts, logits, keeps, options)
    expected = _expected(history, rows, num_drafts, logits)
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 3, history, step_seed=1)
    assert not flags.all_greedy and flags.filters
    tokens, counts = verify_drafts(logits.reshape(3, WIDTH, VOCAB), drafts, num_drafts, tensors, flags=flags)
    assert np.asarray(counts).tolist() == [k + 1 for k in keeps]
    for i, keep in enumerate(keeps):
        want = [*drafts[i, :keep].tolist(), expected[i][keep].greedy]
        assert np.asarray(tokens)[i, : keep + 1].tolist() == want


def test_a_request_without_drafts_samples_its_known_row_as_the_sampler_does():
    batch, history, rows, _ = _requests(seed=6)
    num_drafts = np.zeros(3, np.int32)
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 3, history, step_seed=1)
    logits = np.random.default_rng(7).normal(0, 2, (3 * WIDTH, VOCAB)).astype(np.float32)
    drafts = np.full((3, WIDTH - 1), -1, np.int32)
    tokens, counts = verify_drafts(logits.reshape(3, WIDTH, VOCAB), drafts, num_drafts, tensors, flags=flags)
    assert np.asarray(counts).tolist() == [1, 1, 1]
    expected = _expected(history, rows, num_drafts, logits)
    assert np.asarray(tokens)[:, 0].tolist() == [expected[i][0].greedy for i in range(3)]
    assert flags == SamplerFlags(all_greedy=True, penalties=True, sparse=True, allowed=True)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_each_positions_logprobs_are_the_samplers_for_its_output_token(mode):
    batch, history, rows, _ = _requests(seed=8)
    num_drafts = np.array([3, 3, 2], np.int32)
    logits = np.random.default_rng(9).normal(0, 2, (3 * WIDTH, VOCAB)).astype(np.float32)
    keeps = (1, 3, 0)
    drafts = _drafts_keeping(history, rows, num_drafts, logits, keeps, OPTIONS)
    expected = _expected(history, rows, num_drafts, logits)
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 3, history, step_seed=1)
    flags = dataclasses.replace(flags, num_logprobs=3, logprobs_mode=mode)
    shaped = logits.reshape(3, WIDTH, VOCAB)
    tokens, counts = verify_drafts(shaped, drafts, num_drafts, tensors, flags=flags)
    ids, values, ranks = (np.asarray(x) for x in position_logprobs(shaped, tokens, tensors, flags=flags))
    for i, count in enumerate(np.asarray(counts).tolist()):
        for j in range(count):
            want = expected[i][j]
            source = want.raw_logprobs if mode == "raw_logprobs" else log_softmax(want.sampled_logits)
            want_ids, want_values, want_rank = logprobs_reference(source, int(np.asarray(tokens)[i, j]), 3)
            at = i * WIDTH + j
            assert ids[at].tolist() == want_ids
            np.testing.assert_allclose(values[at], want_values, rtol=1e-5, atol=1e-5)
            assert ranks[at] == want_rank


def test_each_position_is_masked_by_its_own_grammar_row():
    # vLLM's rows for a request with n drafts: the grammar's state before them, then after each.
    batch, history, rows, _ = _requests(seed=10)
    for row, options in zip(rows, OPTIONS, strict=True):
        batch.add_request(int(row), dataclasses.replace(options, structured_output=True))
    num_drafts = np.array([3, 3, 2], np.int32)
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2, (3 * WIDTH, VOCAB)).astype(np.float32)
    words = -(-VOCAB // 32)
    masks = [rng.integers(-(2**31), 2**31, (1 + n, words)).astype(np.int32) for n in num_drafts]
    masks[1] = None  # a request without a grammar beside them
    tensors, flags = batch.prepare_positions(rows, num_drafts, WIDTH, 3, history, step_seed=1)
    tensors, flags = with_all_extras(
        tensors, flags, VOCAB, penalty_width=64, sparse_width=16, logprobs_width=None
    )
    tensors, flags = SpeculativeDecoding.with_position_grammars((tensors, flags), masks, WIDTH)
    # Drafts: each position's masked, processed argmax, so every one is kept.
    drafts = np.full((3, WIDTH - 1), -1, np.int32)
    want = []
    for i, row in enumerate(rows):
        n, p = int(history.num_tokens[row]), int(history.num_prompt_tokens[row])
        for j in range(num_drafts[i] + 1):
            seen = history.token_ids[row, : n + j].tolist()
            mask = None if masks[i] is None else masks[i][j]
            greedy = reference_row(logits[i * WIDTH + j], OPTIONS[i], seen[:p], seen[p:], mask).greedy
            if j < num_drafts[i]:
                drafts[i, j] = history.token_ids[row, n + j] = greedy
        want.append([*drafts[i, : num_drafts[i]].tolist(), greedy])
    tokens, counts = verify_drafts(logits.reshape(3, WIDTH, VOCAB), drafts, num_drafts, tensors, flags=flags)
    assert np.asarray(counts).tolist() == [4, 4, 3]
    assert [np.asarray(tokens)[i, : len(w)].tolist() for i, w in enumerate(want)] == want
