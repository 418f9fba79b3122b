# SPDX-License-Identifier: Apache-2.0
"""`sample` end to end: vLLM pipeline vs the NumPy reference, logprobs, seeds, no recompiles, export."""

import dataclasses

import jax
import numpy as np
import pytest
from jax import export

from tpu_platform.sampling import (
    LOGPROBS_MODES,
    SamplerFlags,
    SamplingBatch,
    SamplingOptions,
    dummy_tensors,
    greedy_sample,
    pack_token_bitmask,
    prompt_logprobs,
    sample,
    uniform,
    warmup_flag_sets,
)
from tpu_platform.sampling import reference as ref

V = 96


@dataclasses.dataclass
class History:
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray

    @classmethod
    def empty(cls, rows=16, max_len=64):
        return cls(np.zeros((rows, max_len), np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32))

    def set(self, row, prompt, output=()):
        tokens = list(prompt) + list(output)
        self.token_ids[row, : len(tokens)] = tokens
        self.num_prompt_tokens[row], self.num_tokens[row] = len(prompt), len(tokens)

    def append(self, row, token):
        self.token_ids[row, self.num_tokens[row]] = token
        self.num_tokens[row] += 1

    def prompt(self, row):
        return self.token_ids[row, : self.num_prompt_tokens[row]].tolist()

    def output(self, row):
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()


def _logits(rows, vocab, seed):
    return np.random.default_rng(seed).normal(0.0, 2.0, (rows, vocab)).astype(np.float32)


# Every option at least once; rows 0-2 greedy, the rest random.
MIXED = [
    SamplingOptions(temperature=0.0, repetition_penalty=1.5, logprobs=2),
    SamplingOptions(temperature=0.0, logit_bias={5: 30.0}, bad_words_token_ids=((5,),)),
    SamplingOptions(temperature=0.0, allowed_token_ids=tuple(range(10, 40)), min_tokens=5, eos_token_id=12),
    SamplingOptions(temperature=0.7, top_k=8, seed=11, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingOptions(temperature=1.2, top_p=0.6, bad_words_token_ids=((1, 2, 3), (7,)), logprobs=4),
    SamplingOptions(temperature=0.9, min_p=0.2, min_tokens=3, stop_token_ids=(4, 9), structured_output=True),
    SamplingOptions(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05, logit_bias={0: -5.0, 1: 2.0}),
    SamplingOptions(temperature=0.5, repetition_penalty=0.8, allowed_token_ids=(3, 4, 5, 6, 90)),
]


def _mixed_batch(logprobs_mode="raw_logprobs"):
    history = History.empty()
    batch = SamplingBatch(8, V, 64, max_logprobs=6, logprobs_mode=logprobs_mode)
    rng = np.random.default_rng(0)
    rows = np.array([6, 0, 3, 7, 1, 5, 2, 4])  # output order differs from row order
    for i, options in enumerate(MIXED):
        batch.add_request(int(rows[i]), options)
        history.set(int(rows[i]), rng.integers(0, V, 6), rng.integers(0, V, i))
    history.set(int(rows[4]), [8, 8], [1, 2])  # bad word "1 2 | 3" is live
    grammar = [None] * 8
    grammar[5] = pack_token_bitmask(range(0, V, 2), V)  # row 5: even tokens only
    return batch, history, rows, grammar


# One program a mode: the fast tier keeps processed logprobs (the sampler's filters and penalties
# before the log-softmax); the other modes are the slow tier's.
@pytest.mark.parametrize(
    "logprobs_mode",
    [m if m == "processed_logprobs" else pytest.param(m, marks=pytest.mark.slow) for m in LOGPROBS_MODES],
)
def test_mixed_batch_matches_reference(logprobs_mode):
    batch, history, rows, grammar = _mixed_batch(logprobs_mode)
    tensors, flags = batch.prepare(rows, 10, history, step_seed=3, grammar_bitmasks=grammar)
    assert flags == SamplerFlags(False, True, True, True, True, True, 6, logprobs_mode)
    logits = _logits(10, V, 1)
    out = jax.tree.map(np.asarray, sample(logits, tensors, flags=flags))
    assert out.sampled_token_ids.shape == (10,) and out.logprob_token_ids.shape == (10, 7)
    for i, options in enumerate(MIXED):
        row = int(rows[i])
        expected = ref.reference_row(logits[i], options, history.prompt(row), history.output(row), grammar[i])
        token = int(out.sampled_token_ids[i])
        if options.is_greedy:
            assert token == expected.greedy, f"row {i}"
        else:
            assert expected.target[token] > 0, f"row {i} drew token {token} outside the support"
        source = {
            "raw_logprobs": expected.raw_logprobs,
            "raw_logits": expected.raw_logits,
            "processed_logits": expected.sampled_logits,
            "processed_logprobs": ref.log_softmax(expected.sampled_logits),
        }[logprobs_mode]
        ids, values, rank = ref.logprobs_reference(source, token, 6)
        assert out.logprob_token_ids[i].tolist() == ids, f"row {i}"
        np.testing.assert_allclose(out.logprobs[i], values, rtol=1e-4, atol=1e-4)
        assert out.sampled_token_ranks[i] == rank


def test_all_greedy_batch_matches_reference_exactly():
    history = History.empty()
    batch = SamplingBatch(8, V, 64)
    options = [
        SamplingOptions(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
        SamplingOptions(temperature=0.0, bad_words_token_ids=((3, 4), (9,)), logit_bias={9: 50.0}),
        SamplingOptions(temperature=0.0, logprobs=3),
    ]
    for row, opt in enumerate(options):
        batch.add_request(row, opt)
        history.set(row, [1, 2], [3, 3, 5, 3])
    logits = _logits(4, V, 2)
    logits[0] = np.clip(logits[0], -3.5, 3.5)
    logits[0, [3, 5]] = 5.0  # penalties push them below 3.5: 5 - 2 * count - 1
    tensors, flags = batch.prepare(np.arange(3), 4, history, step_seed=0)
    assert flags.all_greedy and flags.num_logprobs == 20
    out = sample(logits, tensors, flags=flags)
    for row, opt in enumerate(options):
        expected = ref.reference_row(logits[row], opt, history.prompt(row), history.output(row))
        assert int(out.sampled_token_ids[row]) == expected.greedy
    assert int(out.sampled_token_ids[0]) not in (3, 5) and int(out.sampled_token_ids[1]) != 9


def test_argmax_only_means_the_sampler_returns_the_greedy_argmax():
    # Each option that keeps a greedy batch from being the plain argmax, and none.
    cases = {
        "plain": SamplingOptions(temperature=0.0),
        "penalty": SamplingOptions(temperature=0.0, repetition_penalty=1.5),
        "bias": SamplingOptions(temperature=0.0, logit_bias={7: 9.0}),
        "allowed": SamplingOptions(temperature=0.0, allowed_token_ids=(1, 2, 3)),
        "logprobs": SamplingOptions(temperature=0.0, logprobs=2),
        "random": SamplingOptions(temperature=1.0),
    }
    history = History.empty()
    history.set(0, [1, 2], [7, 7])
    logits = _logits(2, V, 4)
    for name, options in cases.items():
        batch = SamplingBatch(2, V, 64)
        batch.add_request(0, options)
        tensors, flags = batch.prepare(np.arange(1), 2, history, step_seed=0)
        assert flags.argmax_only == (name == "plain"), name
        if flags.argmax_only:
            out = sample(logits, tensors, flags=flags).sampled_token_ids
            np.testing.assert_array_equal(out, greedy_sample(logits))
            np.testing.assert_array_equal(out, np.argmax(logits, axis=-1))


def _run(batch, history, rows, padded, steps, logits_for, step_seed=0):
    """Samples `steps` tokens for `rows`, appending them to the history; returns [steps, len(rows)]."""
    tokens = []
    for step in range(steps):
        tensors, flags = batch.prepare(np.asarray(rows), padded, history, step_seed=step_seed + step)
        out = np.asarray(sample(logits_for(step, rows, padded), tensors, flags=flags).sampled_token_ids)
        for i, row in enumerate(rows):
            history.append(row, int(out[i]))
        tokens.append(out[: len(rows)].tolist())
    return np.array(tokens)


def _row_logits(step, row_key):
    return _logits(1, V, 1000 * step + row_key)[0]


def test_seeded_request_is_batch_invariant():
    seeded = SamplingOptions(temperature=0.9, top_k=30, top_p=0.95, seed=1234)

    def logits_for(seeded_row):
        def make(step, rows, padded):
            out = _logits(padded, V, 77 + step)  # the other rows change with the step
            out[list(rows).index(seeded_row)] = _row_logits(step, 0)
            return out

        return make

    history = History.empty()
    alone = SamplingBatch(8, V, 64)
    alone.add_request(0, seeded)
    history.set(0, [1, 2, 3])
    solo_tokens = _run(alone, history, [0], 1, 6, logits_for(0), step_seed=100)[:, 0]

    history = History.empty()
    crowd = SamplingBatch(16, V, 64)
    others = [
        SamplingOptions(temperature=t, min_p=0.1, presence_penalty=0.5, seed=s)
        for t, s in [(0.0, None), (1.0, None), (0.5, 1234), (1.5, 99), (0.0, None)]
    ]
    rows = [9, 3, 12, 4, 7, 11]  # the seeded request sits at batch position 5, runner row 11
    for row, opt in zip(rows[:5], others, strict=True):
        crowd.add_request(row, opt)
        history.set(row, [5, 6], [7])
    crowd.add_request(11, seeded)
    history.set(11, [1, 2, 3])
    crowd_tokens = _run(crowd, history, rows, 8, 6, logits_for(11), step_seed=555)[:, 5]
    np.testing.assert_array_equal(solo_tokens, crowd_tokens)
    assert len(set(solo_tokens.tolist())) > 1


def test_four_seeded_siblings_are_reproducible():
    # vLLM gives the n=4 children of a seeded request the seeds seed + index.
    flat = lambda step, rows, padded: np.zeros((padded, V), np.float32)  # noqa: E731

    def run(step_seed):
        history = History.empty()
        batch = SamplingBatch(4, V, 64)
        for index in range(4):
            batch.add_request(index, SamplingOptions(temperature=1.0, seed=42 + index))
            history.set(index, [1])
        return _run(batch, history, [0, 1, 2, 3], 4, 5, flat, step_seed=step_seed)

    first, second = run(11), run(999)  # the step seed only feeds unseeded rows
    np.testing.assert_array_equal(first, second)
    assert len({tuple(first[:, i]) for i in range(4)}) == 4  # siblings differ


def test_unseeded_rows_differ_across_rows_and_steps():
    history = History.empty()
    batch = SamplingBatch(8, 4096, 64)
    for row in range(8):
        batch.add_request(row, SamplingOptions(temperature=1.0))
        history.set(row, [1])
    flat = lambda step, rows, padded: np.zeros((padded, 4096), np.float32)  # noqa: E731
    tokens = _run(batch, history, list(range(8)), 8, 2, flat)
    assert len(set(tokens[0].tolist())) == 8 and tokens[0].tolist() != tokens[1].tolist()


STAT_CASES = {
    "temperature": SamplingOptions(temperature=0.6),
    "top_k": SamplingOptions(temperature=1.0, top_k=4),
    "top_p": SamplingOptions(temperature=1.0, top_p=0.7),
    "min_p": SamplingOptions(temperature=1.0, min_p=0.3),
    "all_filters": SamplingOptions(temperature=1.3, top_k=7, top_p=0.85, min_p=0.05),
}


@pytest.mark.parametrize("case", STAT_CASES)
def test_sampled_frequencies_match_the_target_distribution(case):
    scipy_stats = pytest.importorskip("scipy.stats")
    options, vocab, rows = STAT_CASES[case], 12, 2048
    row_logits = np.random.default_rng(7).normal(0.0, 1.0, vocab).astype(np.float32)
    target = ref.reference_row(row_logits, options, [], []).target.astype(np.float64)
    history = History.empty(rows=rows, max_len=8)
    batch = SamplingBatch(rows, vocab, 8)
    for row in range(rows):
        batch.add_request(row, options)
        history.set(row, [0])
    counts = np.zeros(vocab)
    logits = np.broadcast_to(row_logits, (rows, vocab))
    for step in range(3):
        tensors, flags = batch.prepare(np.arange(rows), rows, history, step_seed=step)
        tokens = np.asarray(sample(logits, tensors, flags=flags).sampled_token_ids)
        counts += np.bincount(tokens, minlength=vocab)
    support = target > 0
    assert counts[~support].sum() == 0, f"drew masked tokens {np.flatnonzero(counts * ~support)}"
    assert support.sum() >= 2
    expected = target[support] / target[support].sum() * counts.sum()
    result = scipy_stats.chisquare(counts[support], expected)
    assert result.pvalue > 1e-3, (counts, expected)


def test_new_parameter_values_never_recompile():
    # The compile cache is shared by every jax.jit(sample) wrapper, so count what this test adds.
    jitted = jax.jit(sample, static_argnames="flags")
    history = History.empty()
    seen_flags = set()
    cache_sizes = []
    for trial in range(4):
        rng = np.random.default_rng(trial)
        batch = SamplingBatch(8, V, 64, max_logprobs=5)
        for row in range(6):
            batch.add_request(
                row,
                SamplingOptions(
                    temperature=float(rng.uniform(0.1, 2.0)) if row else 0.0,
                    top_k=int(rng.integers(1, V)),
                    top_p=float(rng.uniform(0.3, 1.0)),
                    min_p=float(rng.uniform(0.0, 0.3)),
                    presence_penalty=float(rng.uniform(-2, 2)),
                    frequency_penalty=float(rng.uniform(-2, 2)),
                    repetition_penalty=float(rng.uniform(0.5, 2)),
                    logit_bias={int(t): float(rng.normal()) for t in rng.integers(0, V, 3)},
                    bad_words_token_ids=((int(rng.integers(V)),),),
                    min_tokens=int(rng.integers(0, 4)),
                    eos_token_id=int(rng.integers(V)),
                    seed=int(rng.integers(1 << 62)) if row % 2 else None,
                    logprobs=int(rng.integers(0, 6)),
                ),
            )
            history.set(row, rng.integers(0, V, 5), rng.integers(0, V, 3))
        rows = rng.permutation(6)[: 4 + trial % 2]
        tensors, flags = batch.prepare(rows, 8, history, step_seed=trial)
        seen_flags.add(flags)
        out = jitted(_logits(8, V, trial), tensors, flags=flags)
        assert np.asarray(out.sampled_token_ids).shape == (8,)
        cache_sizes.append(jitted._cache_size())
    assert len(seen_flags) == 1
    assert cache_sizes == [cache_sizes[0]] * 4


@pytest.mark.slow  # a program a flag set; the fast tier's mixed batch runs the sampler's paths
def test_warmup_flag_sets_cover_plain_batches():
    jitted = jax.jit(sample, static_argnames="flags")
    for flags in warmup_flag_sets(4):
        jitted(np.zeros((4, V), np.float32), dummy_tensors(flags, 4, V), flags=flags)
    compiled = jitted._cache_size()
    history = History.empty()
    batch = SamplingBatch(4, V, 64, max_logprobs=4)
    plain = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(seed=3, logprobs=2),
        SamplingOptions(top_p=0.5),
    ]
    for row, opt in enumerate(plain):
        batch.add_request(row, opt)
        history.set(row, [1, 2])
    for rows in ([0], [0, 1], [1, 0], [2, 1, 0], [0, 2]):
        tensors, flags = batch.prepare(np.array(rows), 4, history, step_seed=1)
        jitted(_logits(4, V, 0), tensors, flags=flags)
    assert jitted._cache_size() == compiled


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_prompt_logprobs_match_reference(num_logprobs):
    logits = _logits(5, V, 9)
    targets = np.array([3, 0, 95, 17, 17], np.int32)
    ids, values, ranks = (np.asarray(x) for x in prompt_logprobs(logits, targets, num_logprobs=num_logprobs))
    for t in range(5):
        ref_ids, ref_values, ref_rank = ref.logprobs_reference(
            ref.log_softmax(logits[t]), targets[t], num_logprobs
        )
        assert ids[t].tolist() == ref_ids and ranks[t] == ref_rank
        np.testing.assert_allclose(values[t], ref_values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sampler_lowers_for_accelerators(platform):
    flags = SamplerFlags(
        filters=True, penalties=True, sparse=True, allowed=True, grammar=True, num_logprobs=5
    )
    tensors = dummy_tensors(flags, 8, V)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tensors)
    fn = jax.jit(lambda logits, t: sample(logits, t, flags=flags))
    exported = export.export(fn, platforms=[platform])(jax.ShapeDtypeStruct((8, V), np.float32), specs)
    assert exported.platforms == (platform,)


@pytest.mark.parametrize("extra", [*uniform.EXTRAS, "num_logprobs"])
def test_every_extra_turns_the_widened_variant_on(extra):
    value = 2 if extra == "num_logprobs" else True
    assert not uniform.has_extras(SamplerFlags())
    assert uniform.has_extras(SamplerFlags(**{extra: value}))
