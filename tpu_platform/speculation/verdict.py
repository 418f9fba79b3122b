# SPDX-License-Identifier: Apache-2.0
"""A step's verdict on its drafts: the programs that reach it and the tokens it keeps.

A step of one of speculative decoding's shapes (`buckets.verify_shapes`) already has the logits
and greedy token of every token row (`step.forward_logits`). Its greedy rows need no program: a
request keeps its drafts while each equals the greedy token before it (`greedy_verdict`, on the
host once the step's tokens are). Its random rows take `make_verify_rows`: the rows' logits
gathered by `draft_rows`, and `rejection.verify_drafts`. A step of another shape (drafts beside
a prefill chunk) has the logits of one row a request only: `make_verify` runs the LM head again
on the hidden states of each request's 1 + k rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplerFlags, SamplerOutput
from tpu_platform.speculation.rejection import position_logprobs, verify_drafts
from tpu_platform.step import pad_tokens
from tpu_platform.step_update import StepLogprobs


@dataclasses.dataclass(slots=True)
class SpeculationStats:
    """Running totals: drafts verified, drafts accepted, steps verified and steps whose drafts
    the ordinary sampler served (all rejected)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verified_steps: int = 0
    unverified_steps: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StepDrafts:
    """A step's drafts in batch order: `drafts[i, :num_drafts[i]]` for request i (-1 padded)."""

    drafts: np.ndarray  # int32[n, K]
    num_drafts: np.ndarray  # int32[n]

    def padded(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafts cut to `k` a request and padded to `rows` requests of none."""
        n = self.num_drafts.size
        drafts = np.full((rows, k), -1, np.int32)
        drafts[:n] = self.drafts[:, :k]
        num_drafts = np.zeros(rows, np.int32)
        num_drafts[:n] = self.num_drafts
        return drafts, num_drafts


@dataclasses.dataclass(frozen=True, slots=True)
class Verification:
    """A verified step's output: each row's first token on the device (the next step's feed) and
    `verdict()`, its kept tokens `[R, K + 1]` and their counts `[R]` on the host, which waits for
    the step; `record` reads them once the step is finished."""

    output: SamplerOutput  # each row's first token, padded to the feed width
    verdict: Callable[[], tuple[np.ndarray, np.ndarray]]
    step_drafts: StepDrafts
    stats: SpeculationStats
    # Every verified position's logprobs (`rejection.position_logprobs`), where the step wants them.
    logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None

    def record(self, table: RequestTable, rows: np.ndarray, emits: np.ndarray) -> list[list[int]]:
        """Writes each row's kept tokens after its first (which the step reserved) into the
        history and returns every row's output tokens (`[]` where the row emits nothing)."""
        n = rows.size
        tokens, counts = self.verdict()
        tokens, counts = tokens[:n], counts[:n]
        self.stats.draft_tokens += int(self.step_drafts.num_drafts.sum())
        self.stats.accepted_tokens += int((counts - 1).sum())
        for i in np.flatnonzero(counts > 1):
            for token in tokens[i, 1 : counts[i]].tolist():
                table.append_token(int(rows[i]), token)
        return [tokens[i, : counts[i]].tolist() if emits[i] else [] for i in range(n)]

    def step_logprobs(self, sampled: list[list[int]]) -> StepLogprobs:
        """The logprobs of each row's output tokens (`record`'s `sampled`), one row a token in
        batch order, request i's from `cu_num_generated[i]` (vLLM's layout for drafted steps)."""
        ids, values, ranks = (np.asarray(x) for x in self.logprobs)
        width = self.verdict()[0].shape[1]  # K + 1 positions a request
        counts = np.fromiter(map(len, sampled), np.int64, len(sampled))
        index = np.flatnonzero(np.arange(width)[None, :] < counts[:, None])  # request i's at i * width + j
        cu = [0, *np.cumsum(counts).tolist()]
        return StepLogprobs(ids[index], values[index], ranks[index], cu_num_generated=cu)


def on_host(tokens: jax.Array, counts: jax.Array) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """The verdict of a verification program's outputs."""
    return lambda: (np.asarray(tokens), np.asarray(counts))


def draft_rows(known: np.ndarray, num_drafts: np.ndarray, k: int, rows: int) -> np.ndarray:
    """`[rows, k + 1]` step rows of each request's last known token and its drafts (`known[i]`
    and the `num_drafts[i]` rows after it; the last one again past them, row 0 past the
    requests): where its logits at each verified position are."""
    index = np.zeros((rows, k + 1), np.int32)
    n = known.size
    index[:n] = known[:, None] + np.minimum(np.arange(k + 1)[None, :], num_drafts[:, None])
    return index


def greedy_verdict(
    row_greedy: jax.Array, index: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification from every row's greedy token (`row_greedy`, `[T]`): a request keeps
    its drafts while each equals the greedy token of the row before it, then that row's greedy
    token follows; so its tokens are the greedy tokens of its rows (`index`, `draft_rows`), the
    first `counts` of them kept. `rejection.verify_drafts` with `all_greedy`, on the host."""
    tokens = np.asarray(row_greedy)[index]
    k = drafts.shape[1]
    agrees = (tokens[:, :k] == drafts) & (np.arange(k)[None, :] < num_drafts[:, None])
    kept = np.cumprod(agrees, axis=1).sum(axis=1)
    return tokens, (kept + 1).astype(np.int32)


def make_verify_rows(feed_width: int) -> Callable:
    """`fn(row_logits[T, V], index[R, K + 1], drafts[R, K], num_drafts[R], tensors, flags=) ->
    (first tokens [feed_width], tokens [R, K + 1], counts [R])`, jitted: the rows' logits at
    `index` (`draft_rows`) through `rejection.verify_drafts`; with `flags.num_logprobs`, every
    position's logprobs (`rejection.position_logprobs`) last."""

    def run(row_logits, index, drafts, num_drafts, tensors, flags: SamplerFlags):
        rows, width = index.shape
        logits = row_logits[index.reshape(-1)].reshape(rows, width, -1)
        tokens, counts = verify_drafts(logits, drafts, num_drafts, tensors, flags=flags)
        out = (pad_tokens(tokens[:, 0], feed_width), tokens, counts)
        if flags.num_logprobs is None:
            return out
        return (*out, position_logprobs(logits, tokens, tensors, flags=flags))

    return jax.jit(run, static_argnames=("flags",))


def make_verify(graphdef: nnx.GraphDef):
    """`fn(state, hidden[R * (K + 1), D], drafts[R, K], num_drafts[R], tensors, flags=, feed_width=)
    -> (first tokens [feed_width], tokens [R, K + 1], counts [R])`, jitted: the LM head on the
    hidden rows, then `rejection.verify_drafts`."""

    def run(state, hidden, drafts, num_drafts, tensors, flags: SamplerFlags, feed_width: int):
        model = nnx.merge(graphdef, state)
        rows, k = drafts.shape
        logits = model.compute_logits(hidden).reshape(rows, k + 1, -1)
        tokens, counts = verify_drafts(logits, drafts, num_drafts, tensors, flags=flags)
        return pad_tokens(tokens[:, 0], feed_width), tokens, counts

    return jax.jit(run, static_argnames=("flags", "feed_width"))
