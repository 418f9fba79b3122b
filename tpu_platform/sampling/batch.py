# SPDX-License-Identifier: Apache-2.0
"""Host-side sampling state: per-row parameters in preallocated NumPy arrays, and `prepare`, which
turns the rows of one step into a `SamplingTensors` pytree plus static `SamplerFlags`.

Rows are the runner's persistent request rows. Token history is not copied here: `prepare` reads the
runner's own history (see `TokenHistory`), so penalties, bad words, min_tokens and seeds always see
the tokens the runner recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tpu_platform.sampling.host import (
    BadWords,
    TokenHistory,
    grammar_rows,
    pack_token_bitmask,
    round_up,
    seed_words,
    width_buckets,
)
from tpu_platform.sampling.options import MAX_SPARSE_ENTRIES, SAMPLING_EPS, SamplingOptions
from tpu_platform.sampling.tensors import (
    KIND_BAN,
    KIND_BIAS,
    KIND_STOP,
    FilterTensors,
    PenaltyTensors,
    RandomTensors,
    SamplerFlags,
    SamplingTensors,
    SparseTensors,
    dummy_tensors,
)

_NO_LOGPROBS = -2
_NONCE_LIMIT = 2**32 - 1


class SamplingBatch:
    """Sampling parameters of every live request, by runner row, and the per-step `prepare`."""

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        max_model_len: int,
        *,
        max_logprobs: int = 20,
        logprobs_mode: str = "raw_logprobs",
    ):
        """`max_logprobs` is vLLM's `max_logprobs` (-1: no limit); the logprobs width N is always
        `max_logprobs` when it covers the request, so one program serves every N."""
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.logprobs_mode = logprobs_mode
        SamplerFlags(logprobs_mode=logprobs_mode)  # validates the mode
        self.bitmask_words = -(-vocab_size // 32)
        self.penalty_widths = width_buckets(16, max_model_len)
        self.sparse_widths = width_buckets(16, MAX_SPARSE_ENTRIES)
        self._fills = {
            "active": (bool, False),
            "temperature": (np.float32, 0.0),
            "top_k": (np.int32, vocab_size),
            "top_p": (np.float32, 1.0),
            "min_p": (np.float32, 0.0),
            "presence": (np.float32, 0.0),
            "frequency": (np.float32, 0.0),
            "repetition": (np.float32, 1.0),
            "seeded": (bool, False),
            "seed_hi": (np.uint32, 0),
            "seed_lo": (np.uint32, 0),
            "nonce": (np.uint32, 0),
            "min_tokens": (np.int32, 0),
            "structured": (bool, False),
            "num_logprobs": (np.int32, _NO_LOGPROBS),
            "has_bias": (bool, False),
            "has_bad": (bool, False),
            "has_stop": (bool, False),
            "has_allowed": (bool, False),
        }
        self._arrays = {
            name: np.full(max_num_reqs, fill, dtype) for name, (dtype, fill) in self._fills.items()
        }
        self._stop_ids: list[np.ndarray | None] = [None] * max_num_reqs
        self._bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_reqs
        self._bad_words: list[BadWords | None] = [None] * max_num_reqs
        self._allowed: np.ndarray | None = None  # int32[capacity, W], allocated on first use
        self._last_nonce = 0
        # What `prepare` derives from the rows' parameters alone, for the last rows prepared;
        # `_version` changes whenever any row's parameters do.
        self._version = 0
        self._rows_key: tuple[bytes, int, int] | None = None
        self._rows_part: _RowsPart | None = None

    @property
    def capacity(self) -> int:
        return self._arrays["active"].shape[0]

    def _grow(self, row: int) -> None:
        old = self.capacity
        new = max(2 * old, row + 1)
        for name, (dtype, fill) in self._fills.items():
            self._arrays[name] = np.concatenate([self._arrays[name], np.full(new - old, fill, dtype)])
        for ragged in (self._stop_ids, self._bias, self._bad_words):
            ragged.extend([None] * (new - old))
        if self._allowed is not None:
            self._allowed = np.concatenate(
                [self._allowed, np.full((new - old, self.bitmask_words), -1, np.int32)]
            )

    # -- request lifetime -------------------------------------------------------------------

    def add_request(self, row: int, options: SamplingOptions) -> None:
        """Validates `options` (ValueError naming the option) and stores them in `row`."""
        options.validate(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            self._check_logprobs(name, getattr(options, name))
        self._version += 1
        if row >= self.capacity:
            self._grow(row)
        self.remove_request(row)
        a = self._arrays
        a["active"][row] = True
        a["temperature"][row] = options.temperature
        if not options.is_greedy:
            top_k = options.top_k if 0 < options.top_k < self.vocab_size else self.vocab_size
            a["top_k"][row], a["top_p"][row], a["min_p"][row] = top_k, options.top_p, options.min_p
        a["presence"][row] = options.presence_penalty
        a["frequency"][row] = options.frequency_penalty
        a["repetition"][row] = options.repetition_penalty
        if options.seed is not None:
            a["seeded"][row] = True
            a["seed_hi"][row], a["seed_lo"][row] = seed_words(options.seed)
        else:
            self._last_nonce = self._last_nonce % _NONCE_LIMIT + 1
            a["nonce"][row] = self._last_nonce
        a["structured"][row] = options.structured_output
        if options.logprobs is not None:
            a["num_logprobs"][row] = options.logprobs
        stops = [t for t in options.all_stop_token_ids if t < self.vocab_size]
        if options.min_tokens > 0 and stops:
            a["min_tokens"][row], a["has_stop"][row] = options.min_tokens, True
            self._stop_ids[row] = np.array(stops, np.int32)
        if options.logit_bias:
            a["has_bias"][row] = True
            ids = np.fromiter(options.logit_bias.keys(), np.int32, len(options.logit_bias))
            self._bias[row] = (ids, np.fromiter(options.logit_bias.values(), np.float32, ids.size))
        if options.bad_words_token_ids:
            a["has_bad"][row] = True
            self._bad_words[row] = BadWords.build(options.bad_words_token_ids)
        if options.allowed_token_ids is not None:
            if self._allowed is None:
                self._allowed = np.full((self.capacity, self.bitmask_words), -1, np.int32)
            a["has_allowed"][row] = True
            self._allowed[row] = pack_token_bitmask(options.allowed_token_ids, self.vocab_size)

    def _check_logprobs(self, name: str, value: int | None) -> None:
        wanted = self.vocab_size if value == -1 else value
        if value is not None and self.max_logprobs != -1 and wanted > self.max_logprobs:
            raise ValueError(
                f"SamplingOptions.{name}={value} asks for more than max_logprobs={self.max_logprobs}; "
                "request fewer or raise the engine's max_logprobs."
            )

    def remove_request(self, row: int) -> None:
        """Resets `row` to neutral values; it may be reused by `add_request`."""
        self._version += 1
        if row >= self.capacity:
            return
        for name, (_, fill) in self._fills.items():
            self._arrays[name][row] = fill
        self._stop_ids[row] = self._bias[row] = self._bad_words[row] = None
        if self._allowed is not None:
            self._allowed[row] = -1

    # -- one step ------------------------------------------------------------------------------

    def prepare(
        self,
        rows: np.ndarray,
        padded_rows: int,
        history: TokenHistory,
        step_seed: int,
        grammar_bitmasks: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """Tensors (leading dim `padded_rows`, output i = `rows[i]`) and static flags for `sample`.

        `step_seed` (a new value each step) seeds unseeded rows. `grammar_bitmasks`, aligned with
        `rows`, holds each row's packed int32 xgrammar bitmask or None.
        """
        rows = np.asarray(rows, np.int64)
        part = self._rows_part_of(rows, padded_rows)
        random = None
        if not part.flags.all_greedy:  # (a greedy step reads no counts: the forward's argmax serves it)
            generated = history.num_tokens[rows] - history.num_prompt_tokens[rows]
            random = self._random(rows, padded_rows, generated, step_seed)
        penalties = sparse = None
        if part.penalties:
            num_prompt = history.num_prompt_tokens[rows].astype(np.int64)
            num_tokens = history.num_tokens[rows].astype(np.int64)
            penalties = self._penalties(rows, padded_rows, history.token_ids, num_prompt, num_tokens)
        if part.sparse:
            num_prompt = history.num_prompt_tokens[rows].astype(np.int64)
            num_tokens = history.num_tokens[rows].astype(np.int64)
            sparse = self._sparse(rows, padded_rows, history.token_ids, num_prompt, num_tokens)
        tensors = SamplingTensors(
            temperature=part.temperature,
            random=random,
            filters=part.filters,
            penalties=penalties,
            sparse=sparse,
            allowed_bitmask=part.allowed_bitmask,
        )
        flags = part.flags if sparse is None else dataclasses.replace(part.flags, sparse=True)
        if grammar_bitmasks is not None:
            return self.with_grammar(tensors, flags, grammar_bitmasks, rows.size)
        return tensors, flags

    def prepare_positions(
        self,
        rows: np.ndarray,
        num_drafts: np.ndarray,
        width: int,
        padded_rows: int,
        history: TokenHistory,
        step_seed: int,
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """`prepare` for each of `rows`' `width` verified positions (a draft's verification):
        row i's position j, at `i * width + j` of `padded_rows * width`, is sampled as if its
        history already held its first j drafts (written after its known tokens: `num_tokens + j`
        tokens), so penalties count them, bad words and min_tokens see them, and its draw is that
        of output token `num_generated + j`. Positions past row i's `num_drafts[i]` (never read)
        repeat its last one. Logprobs and grammar bitmasks are the caller's to add."""
        rows = np.asarray(rows, np.int64)
        offsets = np.minimum(np.arange(width)[None, :], num_drafts[: rows.size, None]).reshape(-1)
        each = np.repeat(rows, width)
        padded = padded_rows * width
        part = self._make_rows_part(each, padded)
        num_prompt = history.num_prompt_tokens[each].astype(np.int64)
        num_tokens = history.num_tokens[each].astype(np.int64) + offsets
        random = None
        if not part.flags.all_greedy:
            random = self._random(each, padded, num_tokens - num_prompt, step_seed)
        penalties = sparse = None
        if part.penalties:
            penalties = self._penalties(each, padded, history.token_ids, num_prompt, num_tokens)
        if part.sparse:
            sparse = self._sparse(each, padded, history.token_ids, num_prompt, num_tokens)
        tensors = SamplingTensors(
            temperature=part.temperature, random=random, filters=part.filters, penalties=penalties,
            sparse=sparse, allowed_bitmask=part.allowed_bitmask,
        )  # fmt: skip
        return tensors, dataclasses.replace(part.flags, sparse=sparse is not None, num_logprobs=None)

    def any_structured(self, rows: np.ndarray) -> bool:
        """Whether some of `rows` follows a grammar (its bitmasks come with the step's sampling)."""
        return bool(self._arrays["structured"][np.asarray(rows, np.int64)].any())

    def reads_history(self, rows: np.ndarray, padded_rows: int) -> bool:
        """Whether `prepare` for `rows` reads their token ids, not only their counts: some row has
        a penalty or sparse entries (bad words, min_tokens stop ids, logit bias)."""
        part = self._rows_part_of(np.asarray(rows, np.int64), padded_rows)
        return part.penalties or part.sparse

    def with_grammar(
        self,
        tensors: SamplingTensors,
        flags: SamplerFlags,
        grammar_bitmasks: Sequence[np.ndarray | None],
        num_rows: int,
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """`prepare`'s result for `num_rows` rows with their structured-output bitmasks added."""
        padded_rows = tensors.temperature.shape[0]
        grammar = grammar_rows(grammar_bitmasks, num_rows, padded_rows, self.bitmask_words)
        if grammar is None:
            return tensors, flags
        tensors = dataclasses.replace(tensors, grammar_bitmask=grammar[0], grammar_rows=grammar[1])
        return tensors, dataclasses.replace(flags, grammar=True)

    def _rows_part_of(self, rows: np.ndarray, padded_rows: int) -> _RowsPart:
        """`_RowsPart` of `rows`, reused while the rows and their parameters stay the same."""
        key = (rows.tobytes(), padded_rows, self._version)
        if key != self._rows_key:
            self._rows_part = self._make_rows_part(rows, padded_rows)
            self._rows_key = key
        return self._rows_part

    def _make_rows_part(self, rows: np.ndarray, padded_rows: int) -> _RowsPart:
        n = rows.size
        if padded_rows < n:
            raise ValueError(f"padded_rows={padded_rows} is smaller than the {n} rows to sample")
        a = self._arrays
        if n and (rows.max() >= self.capacity or not a["active"][rows].all()):
            raise ValueError(f"rows without a request (add_request first): {rows.tolist()}")
        temperature = self._pad(a["temperature"][rows], padded_rows, 0.0)
        all_greedy = not bool(np.any(temperature[:n] >= SAMPLING_EPS))
        filters = None if all_greedy else self._filters(rows, padded_rows)
        penalized = (a["presence"][rows] != 0.0) | (a["frequency"][rows] != 0.0)
        penalties = bool(np.any(penalized | (a["repetition"][rows] != 1.0)))
        allowed = self._allowed_bitmask(rows, padded_rows)
        flags = SamplerFlags(
            all_greedy=all_greedy,
            filters=filters is not None,
            penalties=penalties,
            allowed=allowed is not None,
            num_logprobs=self._num_logprobs(rows),
            logprobs_mode=self.logprobs_mode,
        )
        sparse = bool(np.any(a["has_bias"][rows] | a["has_bad"][rows] | a["has_stop"][rows]))
        return _RowsPart(temperature, filters, allowed, flags, penalties, sparse)

    def dummy_tensors(
        self, flags: SamplerFlags, padded_rows: int, *, penalty_width: int = 16, sparse_width: int = 16
    ) -> SamplingTensors:
        """Neutral tensors for compiling `flags` at `padded_rows` before serving."""
        return dummy_tensors(
            flags, padded_rows, self.vocab_size, penalty_width=penalty_width, sparse_width=sparse_width
        )

    @staticmethod
    def _pad(values: np.ndarray, padded_rows: int, fill) -> np.ndarray:
        out = np.full((padded_rows, *values.shape[1:]), fill, values.dtype)
        out[: values.shape[0]] = values
        return out

    def _random(
        self, rows: np.ndarray, padded: int, num_generated: np.ndarray, step_seed: int
    ) -> RandomTensors:
        a = self._arrays
        seeded = a["seeded"][rows]
        step_hi, step_lo = seed_words(int(step_seed))
        key_data = np.zeros((padded, 2), np.uint32)
        key_data[: rows.size, 0] = np.where(seeded, a["seed_hi"][rows], step_hi)
        key_data[: rows.size, 1] = np.where(seeded, a["seed_lo"][rows], step_lo)
        salt = self._pad(np.where(seeded, 0, a["nonce"][rows]).astype(np.uint32), padded, 0)
        return RandomTensors(key_data, salt, self._pad(num_generated.astype(np.int32), padded, 0))

    def _filters(self, rows: np.ndarray, padded: int) -> FilterTensors | None:
        a = self._arrays
        top_k, top_p, min_p = a["top_k"][rows], a["top_p"][rows], a["min_p"][rows]
        if not (np.any(top_k < self.vocab_size) or np.any(top_p < 1.0) or np.any(min_p > 0.0)):
            return None
        return FilterTensors(
            self._pad(top_k, padded, self.vocab_size),
            self._pad(top_p, padded, 1.0),
            self._pad(min_p, padded, 0.0),
        )

    def _penalties(self, rows, padded, token_ids, num_prompt, num_tokens) -> PenaltyTensors | None:
        a = self._arrays
        presence, frequency, repetition = a["presence"][rows], a["frequency"][rows], a["repetition"][rows]
        idx = np.flatnonzero((presence != 0.0) | (frequency != 0.0) | (repetition != 1.0))
        if idx.size == 0:
            return None
        # Repetition also counts the prompt, so those windows start at column 0.
        start = np.where(repetition[idx] != 1.0, 0, num_prompt[idx])
        length = num_tokens[idx] - start
        width = round_up(int(length.max()), self.penalty_widths)
        column = np.arange(width)[None, :]
        source = np.minimum(start[:, None] + column, token_ids.shape[1] - 1)
        window = np.where(column < length[:, None], token_ids[rows[idx][:, None], source], -1)
        ids = np.full((padded, width), -1, np.int32)
        ids[idx] = window
        prompt_len, lengths = np.zeros(padded, np.int32), np.zeros(padded, np.int32)
        prompt_len[idx], lengths[idx] = num_prompt[idx] - start, length
        return PenaltyTensors(
            ids,
            prompt_len,
            lengths,
            self._pad(presence, padded, 0.0),
            self._pad(frequency, padded, 0.0),
            self._pad(repetition, padded, 1.0),
        )

    def _sparse(self, rows, padded, token_ids, num_prompt, num_tokens) -> SparseTensors | None:
        a = self._arrays
        stop_active = a["has_stop"][rows] & (a["min_tokens"][rows] > num_tokens - num_prompt)
        idx = np.flatnonzero(a["has_bias"][rows] | a["has_bad"][rows] | stop_active)
        if idx.size == 0:
            return None
        per_row = []
        for i in idx:
            row = rows[i]
            parts: list[tuple[np.ndarray, np.ndarray, int]] = []
            if (words := self._bad_words[row]) is not None:
                banned = words.banned(token_ids[row, num_prompt[i] : num_tokens[i]])
                parts.append((banned, np.zeros(banned.size, np.float32), KIND_BAN))
            if stop_active[i]:
                stops = self._stop_ids[row]
                parts.append((stops, np.zeros(stops.size, np.float32), KIND_STOP))
            if (bias := self._bias[row]) is not None:
                parts.append((*bias, KIND_BIAS))
            per_row.append(parts)
        width = round_up(max(sum(p[0].size for p in parts) for parts in per_row), self.sparse_widths)
        ids = np.full((padded, width), self.vocab_size, np.int32)
        values = np.zeros((padded, width), np.float32)
        kinds = np.zeros((padded, width), np.int8)
        for i, parts in zip(idx, per_row, strict=True):
            col = 0
            for part_ids, part_values, kind in parts:
                end = col + part_ids.size
                ids[i, col:end], values[i, col:end], kinds[i, col:end] = part_ids, part_values, kind
                col = end
        return SparseTensors(ids, values, kinds, self._pad(a["structured"][rows], padded, False))

    def _allowed_bitmask(self, rows: np.ndarray, padded: int) -> np.ndarray | None:
        has = self._arrays["has_allowed"][rows]
        if not has.any():
            return None
        out = np.full((padded, self.bitmask_words), -1, np.int32)
        out[: rows.size] = np.where(has[:, None], self._allowed[rows], -1)
        return out

    def _num_logprobs(self, rows: np.ndarray) -> int | None:
        wanted = self._arrays["num_logprobs"][rows]
        if not np.any(wanted != _NO_LOGPROBS):
            return None
        largest = self.vocab_size if np.any(wanted == -1) else int(wanted.max())
        if self.max_logprobs >= 0 and largest <= self.max_logprobs:
            return min(self.max_logprobs, self.vocab_size)
        return min(self.vocab_size, 1 << max(largest - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True, slots=True)
class _RowsPart:
    """What `prepare` derives from the rows' parameters alone (not from their token history)."""

    temperature: np.ndarray
    filters: FilterTensors | None
    allowed_bitmask: np.ndarray | None
    flags: SamplerFlags  # sparse and grammar off: those are decided per step
    penalties: bool  # some row has a penalty
    sparse: bool  # some row may have sparse entries (bad words, min_tokens stop ids, logit bias)
