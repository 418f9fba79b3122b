# SPDX-License-Identifier: Apache-2.0
"""Prompt logprobs: per-position logprobs of each next prompt token, accumulated over chunks.

The forward step always returns the hidden states of every scheduled token; only for requests
that ask for prompt logprobs does a second program turn the rows of their prompt positions into
logits and gather the top N (vLLM's format: the prompt token first, then the top N, and its rank).

That program has one shape whatever the step: the prompt rows are taken from the hidden states on
the host and fed `rows` at a time, and N is the engine's `max_logprobs` (a request's own N is a
prefix of those columns). Warm-up builds it through the runner's program registry, so a request
with any prompt_logprobs value compiles nothing while serving (with `max_logprobs=-1` the width
follows the request, and a new width is a compile that the registry counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from models import ModelConfig
from models.registry import architecture_fingerprint
from tpu_platform.programs import Programs, ProgramSpec, structure_text
from tpu_platform.request_table import RequestTable
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.sampling.sampler import prompt_logprobs

# Prompt positions per program call: bounds its `[rows, V]` logits (a long prompt takes several calls).
MAX_ROWS = 256

# (ids [n, N + 1], logprobs [n, N + 1], ranks [n]) for n prompt positions.
Gathered = tuple[np.ndarray, np.ndarray, np.ndarray]


def make_prompt_logprobs(graphdef: nnx.GraphDef) -> Callable:
    """`fn(state, hidden[C, D], targets[C], num_logprobs=N) -> (ids, logprobs, ranks)`, jitted."""

    def run(state: nnx.State, hidden: jax.Array, targets: jax.Array, num_logprobs: int):
        model = nnx.merge(graphdef, state)
        return prompt_logprobs(model.compute_logits(hidden), targets, num_logprobs=num_logprobs)

    return jax.jit(run, static_argnames=("num_logprobs",))


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobsShape:
    """The fixed shape of the prompt-logprobs program."""

    rows: int  # prompt positions per call
    hidden_size: int
    dtype: np.dtype  # the hidden states' dtype
    vocab_size: int
    width: int | None  # N of the warmed program; None: the request's own (`max_logprobs=-1`)

    @classmethod
    def for_engine(
        cls,
        *,
        max_num_batched_tokens: int,
        hidden_size: int,
        dtype,
        vocab_size: int,
        max_logprobs: int | None,
    ) -> PromptLogprobsShape:
        width = None if max_logprobs is None or max_logprobs < 0 else min(max_logprobs, vocab_size)
        return cls(min(MAX_ROWS, max_num_batched_tokens), hidden_size, np.dtype(dtype), vocab_size, width)

    def width_for(self, wanted: int) -> int:
        """The program width serving a request for `wanted` logprobs: the warmed one when it covers
        it, else the next power of two (at most the vocabulary)."""
        if self.width is not None and wanted <= self.width:
            return self.width
        return min(self.vocab_size, 1 << max(wanted - 1, 0).bit_length())


class PromptLogprobsProgram:
    """The prompt-logprobs function as programs of the runner's registry, one per width."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        shape: PromptLogprobsShape,
        *,
        sharding: jax.sharding.Sharding | None,
        context: str,
    ):
        self.shape = shape
        self._jitted = make_prompt_logprobs(graphdef)
        self._sharding = sharding
        self._context = context

    @classmethod
    def for_model(
        cls,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        config: RunnerConfig,
        dtype: np.dtype,
        sharding: jax.sharding.Sharding | None,
    ) -> PromptLogprobsProgram:
        """The program of a runner's model (`sharding`: where whole arrays go on its mesh)."""
        mc = model_config
        shape = PromptLogprobsShape.for_engine(
            max_num_batched_tokens=config.max_num_batched_tokens,
            hidden_size=mc.hidden_size,
            dtype=dtype,
            vocab_size=mc.vocab_size,
            max_logprobs=config.max_logprobs,
        )
        fingerprint = architecture_fingerprint(mc.architecture)  # a plugin model's code
        context = repr((mc, structure_text(graphdef), config.tensor_parallel_size, fingerprint))
        return cls(graphdef, shape, sharding=sharding, context=context)

    def key(self, width: int, dtype: np.dtype) -> tuple:
        return ("prompt_logprobs", self.shape.rows, width, dtype.name)

    def spec(self, state: nnx.State, width: int, dtype: np.dtype) -> ProgramSpec:
        s = self.shape
        hidden = jax.ShapeDtypeStruct((s.rows, s.hidden_size), dtype, sharding=self._sharding)
        targets = jax.ShapeDtypeStruct((s.rows,), np.int32, sharding=self._sharding)
        return ProgramSpec(
            key=self.key(width, dtype),
            jitted=self._jitted,
            args=(state, hidden, targets),
            static={"num_logprobs": width},
            context=self._context,
        )

    def warm_up_specs(self, state: nnx.State) -> list[ProgramSpec]:
        """The program warm-up builds (none when the width follows each request)."""
        s = self.shape
        return [] if s.width is None else [self.spec(state, s.width, s.dtype)]

    def run(
        self, programs: Programs, state: nnx.State, hidden: np.ndarray, targets: np.ndarray, wanted: int
    ) -> Gathered:
        """The logprobs of `hidden[n, D]`'s rows and their `targets[n]`, at least `wanted` wide
        (hidden states of another dtype than the warmed one make a program of their own)."""
        s, dtype = self.shape, hidden.dtype
        width = s.width_for(wanted)
        key, parts = self.key(width, dtype), []
        for start in range(0, hidden.shape[0], s.rows):
            count = min(s.rows, hidden.shape[0] - start)
            rows = np.zeros((s.rows, s.hidden_size), dtype)
            rows[:count] = hidden[start : start + count]
            padded_targets = np.zeros(s.rows, np.int32)
            padded_targets[:count] = targets[start : start + count]
            out = programs.call(key, lambda: self.spec(state, width, dtype), state, rows, padded_targets)
            parts.append([np.asarray(a)[:count] for a in out])
        if not parts:
            empty = np.zeros((0, width + 1))
            return empty.astype(np.int32), empty.astype(np.float32), np.zeros(0, np.int32)
        ids, logprobs, ranks = (np.concatenate(p) for p in zip(*parts, strict=True))
        return ids, logprobs, ranks


@dataclasses.dataclass(slots=True)
class _InProgress:
    ids: np.ndarray  # [num_prompt - 1, N + 1]
    logprobs: np.ndarray
    ranks: np.ndarray  # [num_prompt - 1]


class PromptLogprobs:
    """Tracks requests that want prompt logprobs and fills their arrays chunk by chunk."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._wanted: dict[str, int] = {}
        self._progress: dict[str, _InProgress] = {}

    def add(self, req_id: str, num_logprobs: int | None) -> None:
        if num_logprobs is not None:
            self._wanted[req_id] = self.vocab_size if num_logprobs < 0 else num_logprobs

    def remove(self, req_id: str) -> None:
        self._wanted.pop(req_id, None)
        self._progress.pop(req_id, None)

    def wanted_in(self, req_ids: list[str]) -> bool:
        return bool(self._wanted) and any(r in self._wanted for r in req_ids)

    def collect(
        self,
        compute: Callable[[np.ndarray, np.ndarray, int], Gathered],
        hidden: jax.Array,
        table: RequestTable,
        req_ids: list[str],
        rows: np.ndarray,
        cu_q_lens: np.ndarray,
    ) -> dict[str, Gathered]:
        """Runs this step's prompt positions through `compute(hidden_rows, targets, width)`;
        returns the finished requests' complete arrays."""
        positions, targets, spans = [], [], []
        first = 0  # each span's first row in the gathered positions
        for i, req_id in enumerate(req_ids):
            if req_id not in self._wanted:
                continue
            row, start = int(rows[i]), int(table.num_computed[rows[i]])
            num_prompt = int(table.num_prompt_tokens[row])
            q_len, offset = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(cu_q_lens[i])
            count = max(0, min(q_len, num_prompt - 1 - start))
            positions.append(np.arange(offset, offset + count))
            targets.append(table.token_ids[row, start + 1 : start + 1 + count])
            spans.append((req_id, num_prompt, start, count, first, start + q_len >= num_prompt))
            first += count
        width = max(self._wanted[s[0]] for s in spans)
        # The step's hidden states come to the host whole: slicing them on the device would be
        # a program per token bucket.
        index = np.concatenate(positions)
        gathered = np.asarray(hidden)[index] if index.size else np.zeros((0, hidden.shape[1]), hidden.dtype)
        ids, logprobs, ranks = compute(gathered, np.concatenate(targets).astype(np.int32), width)
        finished = {}
        for req_id, num_prompt, start, count, first, complete in spans:
            n = self._wanted[req_id]
            progress = self._progress.get(req_id)
            if progress is None:
                shape = (num_prompt - 1, n + 1)
                progress = self._progress[req_id] = _InProgress(
                    np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.zeros(shape[0], np.int32)
                )
            if count > 0:
                progress.ids[start : start + count] = ids[first : first + count, : n + 1]
                progress.logprobs[start : start + count] = logprobs[first : first + count, : n + 1]
                progress.ranks[start : start + count] = ranks[first : first + count]
            if complete:
                finished[req_id] = (progress.ids, progress.logprobs, progress.ranks)
                self.remove(req_id)
        return finished
