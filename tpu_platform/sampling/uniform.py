# SPDX-License-Identifier: Apache-2.0
"""One program for every rarely used option: the "extras" variant at fixed widths.

Penalties, bad words / min_tokens / logit_bias entries, allowed ids, grammars and logprobs each
add a flag (and a bucketed width), so a serving mix of them would compile programs one by one
after warm-up. In uniform mode, a step that uses any of them switches all of them on, with
neutral values for the rows (and groups) that do not use them, the widths padded to their largest
bucket and the logprobs width at `max_logprobs` (rows that did not ask for logprobs get them
computed and ignored). The sampler then has exactly two variants per greedy/random/filters
combination, six in all, every one warmed up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpu_platform.sampling.tensors import (
    PenaltyTensors,
    SamplerFlags,
    SamplingTensors,
    SparseTensors,
    dummy_tensors,
    warmup_flag_sets,
)

EXTRAS = ("penalties", "sparse", "allowed", "grammar")


def has_extras(flags: SamplerFlags) -> bool:
    """Whether `flags` turn on any of `EXTRAS` or logprobs (spelled out: asked every step)."""
    return bool(
        flags.num_logprobs is not None or flags.penalties or flags.sparse or flags.allowed or flags.grammar
    )


def warm_logprobs_width(max_logprobs: int | None, vocab_size: int) -> int | None:
    """The logprobs width N of the extras variant (None: no fixed width, vLLM's `max_logprobs=-1`)."""
    if max_logprobs is None or max_logprobs < 0:
        return None
    return min(max_logprobs, vocab_size)


def with_all_extras(
    tensors: SamplingTensors,
    flags: SamplerFlags,
    vocab_size: int,
    *,
    penalty_width: int,
    sparse_width: int,
    logprobs_width: int | None,
) -> tuple[SamplingTensors, SamplerFlags]:
    """`tensors` with every extra group present (neutral where unused) at the fixed widths, and
    logprobs at `logprobs_width` unless the step asks for more."""
    rows = tensors.temperature.shape[0]
    num_logprobs = flags.num_logprobs
    if logprobs_width is not None and (num_logprobs is None or num_logprobs <= logprobs_width):
        num_logprobs = logprobs_width
    all_on = dataclasses.replace(flags, num_logprobs=num_logprobs, **dict.fromkeys(EXTRAS, True))
    neutral = dummy_tensors(all_on, rows, vocab_size, penalty_width=penalty_width, sparse_width=sparse_width)
    penalties = (
        neutral.penalties if tensors.penalties is None else _widen_penalties(tensors.penalties, penalty_width)
    )
    sparse = (
        neutral.sparse if tensors.sparse is None else _widen_sparse(tensors.sparse, sparse_width, vocab_size)
    )
    widened = dataclasses.replace(
        tensors,
        penalties=penalties,
        sparse=sparse,
        allowed_bitmask=neutral.allowed_bitmask
        if tensors.allowed_bitmask is None
        else tensors.allowed_bitmask,
        grammar_bitmask=neutral.grammar_bitmask
        if tensors.grammar_bitmask is None
        else tensors.grammar_bitmask,
        grammar_rows=neutral.grammar_rows if tensors.grammar_rows is None else tensors.grammar_rows,
    )
    return widened, all_on


def uniform_warmup_flag_sets(
    logprobs_width: int | None, *, logprobs_mode: str = "raw_logprobs"
) -> list[SamplerFlags]:
    """Greedy / random / random with filters, each plain and with every extra on (logprobs at
    `logprobs_width`): all that uniform mode ever runs."""
    base = warmup_flag_sets(None, logprobs_mode=logprobs_mode)
    extras = dict.fromkeys(EXTRAS, True)
    return base + [dataclasses.replace(f, num_logprobs=logprobs_width, **extras) for f in base]


def _pad_columns(array: np.ndarray, width: int, fill) -> np.ndarray:
    if array.shape[1] >= width:
        return array
    out = np.full((array.shape[0], width), fill, array.dtype)
    out[:, : array.shape[1]] = array
    return out


def _widen_penalties(p: PenaltyTensors, width: int) -> PenaltyTensors:
    return dataclasses.replace(p, token_ids=_pad_columns(p.token_ids, width, -1))


def _widen_sparse(s: SparseTensors, width: int, vocab_size: int) -> SparseTensors:
    return dataclasses.replace(
        s,
        token_ids=_pad_columns(s.token_ids, width, vocab_size),
        values=_pad_columns(s.values, width, 0.0),
        kinds=_pad_columns(s.kinds, width, 0),
    )
