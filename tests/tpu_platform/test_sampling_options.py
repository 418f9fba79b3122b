# SPDX-License-Identifier: Apache-2.0
"""SamplingOptions: normalization and clear validation errors; flags and warm-up sets."""

import numpy as np
import pytest

from tpu_platform.sampling import (
    MAX_SPARSE_ENTRIES,
    SamplerFlags,
    SamplingBatch,
    SamplingOptions,
    warmup_flag_sets,
)

V = 100


def test_defaults_validate_and_are_random_sampling():
    options = SamplingOptions()
    options.validate(V)
    assert not options.is_greedy
    assert not options.has_penalties
    assert SamplingOptions(temperature=1e-6).is_greedy  # below vLLM's _SAMPLING_EPS


def test_sequences_are_copied_into_tuples():
    bias = {3: 1.5}
    words = [[1, 2], [3]]
    options = SamplingOptions(
        logit_bias=bias, bad_words_token_ids=words, stop_token_ids=[7, 8], allowed_token_ids=[1]
    )
    bias[4] = 2.0
    words[0].append(9)
    assert options.logit_bias == {3: 1.5}
    assert options.bad_words_token_ids == ((1, 2), (3,))
    assert options.stop_token_ids == (7, 8)
    assert options.allowed_token_ids == (1,)


def test_all_stop_token_ids_adds_eos_once():
    assert SamplingOptions(stop_token_ids=(5, 2, 5), eos_token_id=2).all_stop_token_ids == (5, 2)
    assert SamplingOptions(eos_token_id=9).all_stop_token_ids == (9,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0.*use 0 for greedy"),
        ({"temperature": float("nan")}, r"temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0; use 1.0 to disable"),
        ({"top_p": 1.5}, r"top_p"),
        ({"top_k": -2}, r"top_k must be an integer >= -1.*use 0 \(or -1\) to disable"),
        ({"top_k": 2.5}, r"top_k must be an integer"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0.*use 1.0"),
        ({"min_tokens": -1}, r"min_tokens must be an integer >= 0"),
        ({"logit_bias": {V: 1.0}}, r"logit_bias has token ids outside the vocabulary \[0, 100\): \[100\]"),
        ({"logit_bias": {1: float("inf")}}, r"logit_bias values must be finite"),
        ({"allowed_token_ids": ()}, r"allowed_token_ids must not be empty; leave it unset"),
        ({"allowed_token_ids": (1, -3)}, r"allowed_token_ids has token ids outside the vocabulary.*\[-3\]"),
        ({"bad_words_token_ids": ((1,), ())}, r"bad_words_token_ids contains an empty token sequence"),
        ({"bad_words_token_ids": ((1, 500),)}, r"bad_words_token_ids has token ids outside.*\[500\]"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids/eos_token_id must be >= 0"),
        ({"seed": 2**64}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
        ({"logprobs": -2}, r"logprobs must be None, -1 \(whole vocabulary\) or an integer >= 0"),
        ({"prompt_logprobs": -5}, r"prompt_logprobs must be None, -1"),
    ],
)
def test_validate_names_the_option_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=r"SamplingOptions\." + match):
        SamplingOptions(**kwargs).validate(V)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_k": -1},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"stop_token_ids": (V + 5,)},  # ids the model cannot emit are ignored, not rejected
        {"logit_bias": {0: -100.0, V - 1: 100.0}},
    ],
)
def test_validate_accepts_edge_values(kwargs):
    SamplingOptions(**kwargs).validate(V)


def test_sparse_entries_beyond_the_warmed_width_are_refused():
    """logit_bias, stop ids under min_tokens and bad words share one list per row; the widest the
    batch builds is its largest warmed width, and a request that could need more is refused."""
    vocab = 3 * MAX_SPARSE_ENTRIES
    bias = {t: 0.5 for t in range(MAX_SPARSE_ENTRIES)}
    batch = SamplingBatch(2, vocab, 32)
    batch.add_request(0, SamplingOptions(logit_bias=bias))
    tensors, _ = batch.prepare(np.array([0]), 1, _History(), step_seed=0)
    assert tensors.sparse.token_ids.shape == (1, MAX_SPARSE_ENTRIES) == (1, batch.sparse_widths[-1])
    too_many = [
        SamplingOptions(logit_bias={**bias, MAX_SPARSE_ENTRIES: 1.0}),
        SamplingOptions(logit_bias=bias, min_tokens=1, eos_token_id=vocab - 1),
        SamplingOptions(logit_bias=bias, bad_words_token_ids=((7, 8),)),
    ]
    for options in too_many:
        with pytest.raises(ValueError, match=r"SamplingOptions\.logit_bias has .* limit of 4096"):
            batch.add_request(1, options)
    batch.add_request(1, SamplingOptions(logit_bias=bias, eos_token_id=vocab - 1))  # min_tokens 0: no stops


class _History:  # `TokenHistory`: two rows of a 4-token prompt
    def __init__(self):
        self.token_ids = np.full((2, 32), 5, np.int32)
        self.num_prompt_tokens = np.array([4, 4], np.int32)
        self.num_tokens = np.array([4, 4], np.int32)


def test_batch_rejects_more_logprobs_than_max_logprobs():
    batch = SamplingBatch(2, V, 32, max_logprobs=5)
    with pytest.raises(ValueError, match=r"SamplingOptions\.logprobs=6 asks for more than max_logprobs=5"):
        batch.add_request(0, SamplingOptions(logprobs=6))
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 asks for more than max_logprobs=5"):
        batch.add_request(0, SamplingOptions(prompt_logprobs=-1))
    with pytest.raises(ValueError, match=r"SamplingOptions\.top_p"):
        batch.add_request(0, SamplingOptions(top_p=2.0))
    SamplingBatch(2, V, 32, max_logprobs=-1).add_request(0, SamplingOptions(logprobs=-1))


def test_flags_are_hashable_and_checked():
    assert hash(SamplerFlags(num_logprobs=3)) == hash(SamplerFlags(num_logprobs=3))
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplerFlags(logprobs_mode="logits")
    with pytest.raises(ValueError, match=r"filters .* never apply when all rows are greedy"):
        SamplerFlags(all_greedy=True, filters=True)


def test_warmup_flag_sets():
    basic = warmup_flag_sets(20)
    assert len(basic) == len(set(basic)) == 6
    assert {f.num_logprobs for f in basic} == {None, 20}
    assert not any(f.all_greedy and f.filters for f in basic)
    assert len(warmup_flag_sets(None)) == 3
    with_extras = warmup_flag_sets(20, extra_features=("penalties", "sparse"))
    assert len(set(with_extras)) == 24
    assert any(f.penalties and f.sparse and f.filters for f in with_extras)
    with pytest.raises(ValueError, match="unknown extra features"):
        warmup_flag_sets(20, extra_features=("bias",))
