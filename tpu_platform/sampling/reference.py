# SPDX-License-Identifier: Apache-2.0
"""A straightforward NumPy reference of vLLM's v1 sampler, one row at a time, for the tests.

Written from vLLM's own code (`vllm/v1/sample/sampler.py`, `ops/penalties.py`, `ops/bad_words.py`,
`ops/topk_topp_sampler.py`, `logits_processor/builtin.py`, xgrammar's bitmask kernel) with loops and
sets instead of scatters. The package never imports this module.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tpu_platform.sampling.options import SAMPLING_EPS, SamplingOptions

NEG_INF = np.float32(-np.inf)


def bitmask_reference(row: np.ndarray, bitmask_row: np.ndarray) -> np.ndarray:
    """xgrammar: token t < min(V, 32 W) with bit t % 32 of word t // 32 clear becomes -inf."""
    out = row.copy()
    for t in range(min(row.size, 32 * bitmask_row.size)):
        if (int(bitmask_row[t // 32]) >> (t % 32)) & 1 == 0:
            out[t] = NEG_INF
    return out


def bad_words_reference(
    row: np.ndarray, bad_words: Sequence[Sequence[int]], output: Sequence[int]
) -> np.ndarray:
    out = row.copy()
    past = list(output)
    for word in bad_words:
        if len(word) > len(past) + 1:
            continue
        prefix_len = len(word) - 1
        actual = past[-prefix_len:] if prefix_len > 0 else []
        if actual == list(word[:prefix_len]):
            out[word[-1]] = NEG_INF
    return out


def min_tokens_reference(row: np.ndarray, stops: Sequence[int], structured: bool) -> np.ndarray:
    out = row.copy()
    before = {t: row[t] for t in stops}
    for t in stops:
        out[t] = NEG_INF
    if structured and np.all(np.isneginf(out)):
        for t, value in before.items():
            if np.isfinite(value):
                out[t] = value
    return out


def penalties_reference(
    row: np.ndarray,
    prompt: Sequence[int],
    output: Sequence[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> np.ndarray:
    out = row.copy()
    counts = Counter(t for t in output if 0 <= t < row.size)
    for t in {t for t in prompt if 0 <= t < row.size} | set(counts):
        out[t] = out[t] / np.float32(repetition) if out[t] > 0 else out[t] * np.float32(repetition)
    for t, count in counts.items():
        out[t] -= np.float32(frequency) * np.float32(count)
        out[t] -= np.float32(presence)
    return out


def softmax(row: np.ndarray) -> np.ndarray:
    shifted = np.exp((row - row.max()).astype(np.float64))
    return (shifted / shifted.sum()).astype(np.float32)


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return (row - row.max() - np.log(np.exp(row - row.max()).sum())).astype(np.float32)


def min_p_reference(row: np.ndarray, min_p: float) -> np.ndarray:
    probs = softmax(row)
    return np.where(probs < probs.max() * np.float32(min_p), NEG_INF, row)


def top_k_top_p_reference(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    out = row.copy()
    if 0 < top_k < row.size:
        kth = np.sort(row)[::-1][top_k - 1]
        out[out < kth] = NEG_INF
    if top_p < 1.0:
        order = np.argsort(out, kind="stable")  # ascending
        cumulative = np.cumsum(softmax(out[order]).astype(np.float64))
        for position, t in enumerate(order[:-1]):  # the most likely token always survives
            if cumulative[position] <= 1.0 - top_p:
                out[t] = NEG_INF
    return out


@dataclasses.dataclass
class RowResult:
    raw_logits: np.ndarray  # after the grammar bitmask only
    raw_logprobs: np.ndarray
    processed: np.ndarray  # after allowed ids, bad words, min_tokens, bias, penalties
    greedy: int
    sampled_logits: np.ndarray  # then temperature (1 for greedy rows), min_p, top-k/top-p
    target: np.ndarray  # softmax(sampled_logits): what a random row draws from


def reference_row(
    logits: np.ndarray,
    options: SamplingOptions,
    prompt: Sequence[int],
    output: Sequence[int],
    grammar_bitmask: np.ndarray | None = None,
) -> RowResult:
    """Everything vLLM's sampler computes for one row, in its order."""
    row = np.asarray(logits, np.float32).copy()
    if grammar_bitmask is not None:
        row = bitmask_reference(row, grammar_bitmask)
    raw_logits = row.copy()
    if options.allowed_token_ids is not None:
        keep = np.zeros(row.size, bool)
        keep[list(options.allowed_token_ids)] = True
        row[~keep] = NEG_INF
    row = bad_words_reference(row, options.bad_words_token_ids, output)
    if len(output) < options.min_tokens:
        stops = [t for t in options.all_stop_token_ids if t < row.size]
        row = min_tokens_reference(row, stops, options.structured_output)
    for t, bias in (options.logit_bias or {}).items():
        row[t] += np.float32(bias)
    row = penalties_reference(
        row, prompt, output, options.presence_penalty, options.frequency_penalty, options.repetition_penalty
    )
    greedy = int(np.argmax(row))
    scaled = row / np.float32(1.0 if options.temperature < SAMPLING_EPS else options.temperature)
    if not options.is_greedy:
        scaled = min_p_reference(scaled, options.min_p)
        scaled = top_k_top_p_reference(scaled, options.top_k, options.top_p)
    return RowResult(
        raw_logits=raw_logits,
        raw_logprobs=log_softmax(raw_logits),
        processed=row,
        greedy=greedy,
        sampled_logits=scaled,
        target=softmax(scaled),
    )


def logprobs_reference(
    logprobs: np.ndarray, token: int, num_logprobs: int
) -> tuple[list[int], np.ndarray, int]:
    """(ids, values, rank): the token then the top N (stable: lower id first among ties), and its rank."""
    order = np.argsort(-logprobs, kind="stable")[:num_logprobs]
    ids = [token, *order.tolist()]
    return ids, logprobs[ids], int(np.sum(logprobs >= logprobs[token]))
