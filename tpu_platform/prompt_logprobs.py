# SPDX-License-Identifier: Apache-2.0
"""Prompt logprobs: per-position logprobs of each next prompt token, accumulated over chunks.

The forward step always returns the hidden states of every scheduled token; only for requests
that ask for prompt logprobs does a second jitted program turn those rows into logits and gather
the top N (vLLM's format: the prompt token first, then the top N, and its rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from tpu_platform.request_table import RequestTable
from tpu_platform.sampling.sampler import prompt_logprobs


def make_prompt_logprobs(graphdef: nnx.GraphDef) -> Callable:
    """`fn(state, hidden[T, D], targets[T], num_logprobs=N) -> (ids, logprobs, ranks)`, jitted."""

    def run(state: nnx.State, hidden: jax.Array, targets: jax.Array, num_logprobs: int):
        model = nnx.merge(graphdef, state)
        return prompt_logprobs(model.compute_logits(hidden), targets, num_logprobs=num_logprobs)

    return jax.jit(run, static_argnames=("num_logprobs",))


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
        fn: Callable,
        state: nnx.State,
        hidden: jax.Array,
        table: RequestTable,
        req_ids: list[str],
        rows: np.ndarray,
        cu_q_lens: np.ndarray,
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Runs this step's prompt positions; returns the finished requests' complete arrays."""
        targets = np.zeros(hidden.shape[0], np.int32)
        spans = []
        for i, req_id in enumerate(req_ids):
            if req_id not in self._wanted:
                continue
            row, start = int(rows[i]), int(table.num_computed[rows[i]])
            num_prompt = int(table.num_prompt_tokens[row])
            q_len, offset = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(cu_q_lens[i])
            count = min(q_len, num_prompt - 1 - start)
            if count > 0:
                targets[offset : offset + count] = table.token_ids[row, start + 1 : start + 1 + count]
            spans.append((req_id, num_prompt, start, count, offset, start + q_len >= num_prompt))
        width = max(self._wanted[s[0]] for s in spans)
        ids, logprobs, ranks = (np.asarray(a) for a in fn(state, hidden, targets, num_logprobs=width))
        finished = {}
        for req_id, num_prompt, start, count, offset, complete in spans:
            n = self._wanted[req_id]
            progress = self._progress.get(req_id)
            if progress is None:
                shape = (num_prompt - 1, n + 1)
                progress = self._progress[req_id] = _InProgress(
                    np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.zeros(shape[0], np.int32)
                )
            if count > 0:
                progress.ids[start : start + count] = ids[offset : offset + count, : n + 1]
                progress.logprobs[start : start + count] = logprobs[offset : offset + count, : n + 1]
                progress.ranks[start : start + count] = ranks[offset : offset + count]
            if complete:
                finished[req_id] = (progress.ids, progress.logprobs, progress.ranks)
                self.remove(req_id)
        return finished
