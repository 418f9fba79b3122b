# SPDX-License-Identifier: Apache-2.0
"""One program for every rarely used option: the "extras" variant at fixed widths.

Penalties, bad words / min_tokens / logit_bias entries, allowed ids and grammars each add a flag
and a bucketed width, so a serving mix of them would compile programs one by one after warm-up.
In uniform mode, a step that uses any of them switches all four on, with neutral values for the
rows (and groups) that do not use them and the widths padded to their largest bucket. The
sampler then has exactly two variants per greedy/filters/logprobs combination, all warmed up.
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

_EXTRAS = ("penalties", "sparse", "allowed", "grammar")


def has_extras(flags: SamplerFlags) -> bool:
    return any(getattr(flags, name) for name in _EXTRAS)


def with_all_extras(
    tensors: SamplingTensors, flags: SamplerFlags, vocab_size: int, *, penalty_width: int, sparse_width: int
) -> tuple[SamplingTensors, SamplerFlags]:
    """`tensors` with every extra group present (neutral where unused) at the fixed widths."""
    rows = tensors.temperature.shape[0]
    all_on = dataclasses.replace(flags, **dict.fromkeys(_EXTRAS, True))
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
    max_logprobs: int | None, *, logprobs_mode: str = "raw_logprobs"
) -> list[SamplerFlags]:
    """The base flag sets, each also with every extra on: all that uniform mode ever runs."""
    base = warmup_flag_sets(max_logprobs, logprobs_mode=logprobs_mode)
    return base + [dataclasses.replace(f, **dict.fromkeys(_EXTRAS, True)) for f in base]


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
