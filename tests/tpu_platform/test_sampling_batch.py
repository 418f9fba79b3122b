# SPDX-License-Identifier: Apache-2.0
"""SamplingBatch.prepare on the host: flags, padding, compact id arrays, seeds (no device work)."""

import dataclasses

import jax
import numpy as np
import pytest

from tpu_platform.sampling import SamplingBatch, SamplingOptions
from tpu_platform.sampling.tensors import KIND_BAN, KIND_BIAS, KIND_PAD, KIND_STOP

V = 64


@dataclasses.dataclass
class History:
    """The runner's token history: prompt then outputs per row."""

    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray

    @classmethod
    def empty(cls, rows=8, max_len=128):
        return cls(np.zeros((rows, max_len), np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32))

    def set(self, row, prompt, output=()):
        tokens = list(prompt) + list(output)
        self.token_ids[row, : len(tokens)] = tokens
        self.num_prompt_tokens[row], self.num_tokens[row] = len(prompt), len(tokens)


def _batch(requests, history, **kwargs):
    batch = SamplingBatch(8, V, 128, **kwargs)
    for row, (options, prompt, output) in requests.items():
        batch.add_request(row, options)
        history.set(row, prompt, output)
    return batch


def test_all_greedy_batch_sends_only_temperatures():
    history = History.empty()
    batch = _batch({3: (SamplingOptions(temperature=0.0, top_k=5), [1, 2], [])}, history)
    tensors, flags = batch.prepare(np.array([3]), 4, history, step_seed=0)
    assert flags.all_greedy and not flags.filters and flags.num_logprobs is None
    assert tensors.random is tensors.filters is tensors.penalties is tensors.sparse is None
    assert tensors.temperature.tolist() == [0.0] * 4  # padding rows are greedy too


def test_mixed_batch_pads_with_neutral_rows():
    history = History.empty()
    requests = {
        5: (SamplingOptions(temperature=0.8, top_k=10, top_p=0.9, min_p=0.1, seed=7), [1], [2, 3]),
        2: (SamplingOptions(temperature=1.0, top_k=V + 10), [4], []),
    }
    tensors, flags = _batch(requests, history).prepare(np.array([5, 2]), 4, history, step_seed=99)
    assert not flags.all_greedy and flags.filters and not flags.penalties
    np.testing.assert_allclose(tensors.temperature, [0.8, 1.0, 0.0, 0.0])
    assert tensors.filters.top_k.tolist() == [10, V, V, V]  # top_k >= V is off
    np.testing.assert_allclose(tensors.filters.top_p, [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(tensors.filters.min_p, [0.1, 0.0, 0.0, 0.0])
    assert tensors.random.num_generated.tolist() == [2, 0, 0, 0]


def test_seeded_keys_depend_only_on_the_seed_and_unseeded_rows_get_distinct_nonces():
    history = History.empty()
    seeded = SamplingOptions(seed=2**40 + 5)
    batch = _batch(
        {0: (seeded, [1], [9]), 1: (SamplingOptions(), [1], []), 2: (SamplingOptions(), [1], [])}, history
    )
    rnd = batch.prepare(np.array([2, 0, 1]), 4, history, step_seed=1234)[0].random
    assert rnd.key_data[1].tolist() == [256, 5]  # all 64 bits of the seed: (2**40 + 5) >> 32, low word
    assert rnd.salt[1] == 0 and rnd.num_generated[1] == 1
    np.testing.assert_array_equal(rnd.key_data[[0, 2]], [[0, 1234], [0, 1234]])
    assert rnd.salt[0] != rnd.salt[2] and 0 not in rnd.salt[[0, 2]]
    alone = batch.prepare(np.array([0]), 1, history, step_seed=555)[0].random  # another step seed
    np.testing.assert_array_equal(alone.key_data[0], rnd.key_data[1])
    # Negative seeds wrap modulo 2**64 like torch.Generator.manual_seed.
    batch.add_request(4, SamplingOptions(seed=-1))
    history.set(4, [1])
    key_data = batch.prepare(np.array([4]), 1, history, 0)[0].random.key_data[0]
    assert key_data.tolist() == [2**32 - 1, 2**32 - 1]
    # Below 2**32 this is exactly jax.random.PRNGKey(seed).
    batch.add_request(5, SamplingOptions(seed=77))
    history.set(5, [1])
    key_data = batch.prepare(np.array([5]), 1, history, 0)[0].random.key_data[0]
    np.testing.assert_array_equal(key_data, jax.random.key_data(jax.random.PRNGKey(77)))


def test_penalty_windows_include_the_prompt_only_for_repetition():
    history = History.empty()
    requests = {
        0: (SamplingOptions(repetition_penalty=1.3), [5, 6, 7], [8, 9]),
        1: (SamplingOptions(presence_penalty=0.5, frequency_penalty=0.1), [10, 11], [12]),
        2: (SamplingOptions(), [13], [14]),
    }
    pen = _batch(requests, history).prepare(np.array([1, 2, 0]), 4, history, 0)[0].penalties
    assert pen.token_ids.shape == (4, 16)
    assert pen.token_ids[0, :2].tolist() == [12, -1] and pen.prompt_len[0] == 0 and pen.length[0] == 1
    assert pen.length[1] == 0 and np.all(pen.token_ids[1] == -1)
    assert (
        pen.token_ids[2, :6].tolist() == [5, 6, 7, 8, 9, -1] and pen.prompt_len[2] == 3 and pen.length[2] == 5
    )
    np.testing.assert_allclose(pen.repetition, [1.0, 1.0, 1.3, 1.0])
    np.testing.assert_allclose(pen.presence, [0.5, 0.0, 0.0, 0.0])


def test_penalty_width_is_bucketed():
    history = History.empty()
    batch = _batch({0: (SamplingOptions(repetition_penalty=1.1), list(range(50)), [1] * 30)}, history)
    assert batch.penalty_widths == (16, 64, 128)
    assert batch.prepare(np.array([0]), 1, history, 0)[0].penalties.token_ids.shape == (1, 128)


def test_sparse_entries_bad_words_min_tokens_and_bias():
    history = History.empty()
    options = SamplingOptions(
        bad_words_token_ids=((3,), (1, 2), (7, 8)),
        min_tokens=3,
        stop_token_ids=(20,),
        eos_token_id=21,
        logit_bias={30: 2.5, 31: -1.0},
        structured_output=True,
    )
    batch = _batch({6: (options, [1, 1], [1])}, history)
    tensors, flags = batch.prepare(np.array([6]), 2, history, 0)
    sparse = tensors.sparse
    assert flags.sparse and sparse.token_ids.shape == (2, 16)
    entries = [
        (int(t), float(v), int(k))
        for t, v, k in zip(sparse.token_ids[0], sparse.values[0], sparse.kinds[0], strict=True)
    ]
    assert entries[:6] == [
        (3, 0.0, KIND_BAN),
        (2, 0.0, KIND_BAN),
        (20, 0.0, KIND_STOP),
        (21, 0.0, KIND_STOP),
        (30, 2.5, KIND_BIAS),
        (31, -1.0, KIND_BIAS),
    ]
    assert all(k == KIND_PAD and t == V for t, _, k in entries[6:])
    assert sparse.restore_stops.tolist() == [True, False]
    # Once min_tokens outputs exist, the stop ids are no longer sent; "1 | 2" no longer matches.
    history.set(6, [1, 1], [1, 5, 5])
    kinds = batch.prepare(np.array([6]), 1, history, 0)[0].sparse.kinds[0]
    assert sorted(kinds[kinds != KIND_PAD].tolist()) == [KIND_BAN, KIND_BIAS, KIND_BIAS]


def test_min_tokens_alone_stops_mattering_after_enough_tokens():
    history = History.empty()
    batch = _batch({0: (SamplingOptions(min_tokens=2, eos_token_id=1), [4], [5])}, history)
    assert batch.prepare(np.array([0]), 1, history, 0)[1].sparse
    history.set(0, [4], [5, 6])
    assert not batch.prepare(np.array([0]), 1, history, 0)[1].sparse


def test_allowed_and_grammar_bitmasks():
    history = History.empty()
    batch = _batch(
        {0: (SamplingOptions(allowed_token_ids=(1, 33)), [1], []), 1: (SamplingOptions(), [1], [])}, history
    )
    grammar = [None, np.array([5, 0, 0, 0, 0, 0], np.int32)]  # wider than V / 32 = 2 words: cut
    tensors, flags = batch.prepare(np.array([0, 1]), 4, history, 0, grammar_bitmasks=grammar)
    assert flags.allowed and flags.grammar
    assert tensors.allowed_bitmask.tolist() == [[2, 2], [-1, -1], [-1, -1], [-1, -1]]
    assert tensors.grammar_bitmask.tolist() == [[-1, -1], [5, 0], [-1, -1], [-1, -1]]
    assert tensors.grammar_rows.tolist() == [False, True, False, False]
    assert not batch.prepare(np.array([0, 1]), 4, history, 0, grammar_bitmasks=[None, None])[1].grammar
    with pytest.raises(ValueError, match="grammar_bitmasks has 1 entries for 2 rows"):
        batch.prepare(np.array([0, 1]), 4, history, 0, grammar_bitmasks=[grammar[1]])


def test_logprobs_width_is_max_logprobs_or_a_power_of_two():
    history = History.empty()
    batch = _batch(
        {0: (SamplingOptions(logprobs=3), [1], []), 1: (SamplingOptions(logprobs=0), [1], [])}, history
    )
    assert batch.prepare(np.array([0]), 1, history, 0)[1].num_logprobs == 20
    assert batch.prepare(np.array([1]), 1, history, 0)[1].num_logprobs == 20
    unlimited = _batch(
        {0: (SamplingOptions(logprobs=5), [1], []), 1: (SamplingOptions(logprobs=-1), [1], [])},
        history,
        max_logprobs=-1,
    )
    assert unlimited.prepare(np.array([0]), 1, history, 0)[1].num_logprobs == 8
    assert unlimited.prepare(np.array([0, 1]), 2, history, 0)[1].num_logprobs == V


def test_remove_resets_the_row_and_unknown_rows_are_rejected():
    history = History.empty()
    batch = _batch(
        {0: (SamplingOptions(temperature=0.5, presence_penalty=1.0, logit_bias={1: 1.0}), [1], [])}, history
    )
    batch.remove_request(0)
    with pytest.raises(ValueError, match=r"rows without a request \(add_request first\): \[0\]"):
        batch.prepare(np.array([0]), 1, history, 0)
    batch.add_request(0, SamplingOptions(temperature=0.0))
    tensors, flags = batch.prepare(np.array([0]), 1, history, 0)
    assert flags.all_greedy and tensors.penalties is None and tensors.sparse is None
    with pytest.raises(ValueError, match="padded_rows=1 is smaller than the 2 rows"):
        batch.prepare(np.array([0, 0]), 1, history, 0)


def test_rows_beyond_capacity_grow_the_batch():
    history = History.empty(rows=40)
    batch = SamplingBatch(2, V, 128)
    batch.add_request(0, SamplingOptions(allowed_token_ids=(3,)))
    batch.add_request(33, SamplingOptions(seed=1, logit_bias={2: 1.0}))
    history.set(33, [1])
    assert batch.capacity >= 34
    tensors, flags = batch.prepare(np.array([33, 0]), 2, history, 0)
    assert flags.sparse and flags.allowed and tensors.random.key_data[0].tolist() == [0, 1]
