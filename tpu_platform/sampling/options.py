# SPDX-License-Identifier: Apache-2.0
"""Per-request sampling options: our own frozen copy of what vLLM's `SamplingParams` asks of a sampler.

`plugin_shim` fills one `SamplingOptions` per request from vLLM's `SamplingParams` (`stop_token_ids`
should be vLLM's `all_stop_token_ids`, which already holds the EOS ids; `bad_words_token_ids` is
vLLM's `bad_words_token_ids`, already tokenized). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

# vLLM `_SAMPLING_EPS`: a temperature below this means greedy sampling.
SAMPLING_EPS = 1e-5
# Token entries one request may bring to the sampler's sparse list (logit_bias, stop ids while
# min_tokens holds them back, banned bad-word tokens): the width of the warmed sampler programs.
MAX_SPARSE_ENTRIES = 4096
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64


def _tuple_of_ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Everything the sampler needs to know about one request (vLLM semantics).

    `top_k` 0 or -1 disables top-k; `seed=None` means unseeded; `logprobs`/`prompt_logprobs` are
    None (off), N >= 0, or -1 (whole vocabulary). `stop_token_ids` plus `eos_token_id` are the ids
    suppressed while fewer than `min_tokens` tokens were generated. `structured_output` marks requests
    under a grammar: for them min-tokens suppression is undone when it would leave no token at all.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: bool = False

    def __post_init__(self) -> None:
        # Copies, so that the caller mutating its lists or dict cannot change a frozen object.
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _tuple_of_ints(self.allowed_token_ids))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(_tuple_of_ints(w) for w in self.bad_words_token_ids)
        )
        object.__setattr__(self, "stop_token_ids", _tuple_of_ints(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        """The ids suppressed before `min_tokens` (stop ids and EOS, deduplicated, in order)."""
        ids = self.stop_token_ids + (() if self.eos_token_id is None else (self.eos_token_id,))
        return tuple(dict.fromkeys(ids))

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_sparse_entries(self, bad_word_tokens: int | None = None) -> None:
        """Raises `ValueError` when the request's logit_bias, stop ids under min_tokens and bad
        words could need more than `MAX_SPARSE_ENTRIES` sampler entries in one step (at most one
        banned token per tokenized bad word; `bad_word_tokens` counts them before tokenization)."""
        bias = len(self.logit_bias or ())
        stops = len(self.all_stop_token_ids) if self.min_tokens > 0 else 0
        words = len(self.bad_words_token_ids) if bad_word_tokens is None else bad_word_tokens
        _check(
            bias + stops + words <= MAX_SPARSE_ENTRIES,
            "logit_bias",
            f"has {bias} entries; with {stops} stop ids held back by min_tokens and {words} "
            f"bad-word tokens the request needs {bias + stops + words} sampler entries, more than "
            f"vllm-xla's limit of {MAX_SPARSE_ENTRIES}",
            "send fewer logit_bias entries (to restrict the output to a few tokens, use allowed_token_ids)",
        )

    def validate(self, vocab_size: int) -> None:
        """Raises `ValueError` naming the first option that is out of range, and how to fix it."""
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature}",
            "use 0 for greedy decoding",
        )
        _check(
            0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p}",
            "use 1.0 to disable top-p",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"must be an integer >= -1, got {self.top_k!r}",
            "use 0 (or -1) to disable top-k",
        )
        _check(
            0.0 <= self.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {self.min_p}",
            "use 0 to disable min-p",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}", "use 0 to disable it")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty}",
            "use 1.0 to disable it",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
            "use 0 to disable it",
        )
        self.check_sparse_entries()
        if self.logit_bias:
            _check_ids(self.logit_bias.keys(), vocab_size, "logit_bias")
            bad = [v for v in self.logit_bias.values() if not math.isfinite(v)]
            _check(
                not bad,
                "logit_bias",
                f"values must be finite, got {bad[:5]}",
                "use a large negative bias such as -100 to forbid a token",
            )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "must not be empty",
                "leave it unset (None) to allow every token",
            )
            _check_ids(self.allowed_token_ids, vocab_size, "allowed_token_ids")
        for word in self.bad_words_token_ids:
            _check(
                len(word) > 0,
                "bad_words_token_ids",
                "contains an empty token sequence",
                "drop the empty entry",
            )
            _check_ids(word, vocab_size, "bad_words_token_ids")
        negative = [t for t in self.all_stop_token_ids if t < 0]
        _check(
            not negative,
            "stop_token_ids/eos_token_id",
            f"must be >= 0, got {negative}",
            "drop the negative ids",
        )
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and _SEED_MIN <= self.seed < _SEED_MAX,
                "seed",
                f"must be an integer in [-2**63, 2**64), got {self.seed!r}",
                "use None for an unseeded request",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and value >= -1),
                name,
                f"must be None, -1 (whole vocabulary) or an integer >= 0, got {value!r}",
                "use None to disable it",
            )


def _check(ok: bool, name: str, problem: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"SamplingOptions.{name} {problem}; {fix}.")


def _check_ids(ids, vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    _check(
        not bad,
        name,
        f"has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
        "remove them or check that the tokenizer matches the model",
    )
