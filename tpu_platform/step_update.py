# SPDX-License-Identifier: Apache-2.0
"""The runner's own per-step input and output types (plain data, no vLLM).

`StepUpdate` is the one door through which per-request data reaches the runner: new requests
with their prompt, pages, sampling or pooling options and LoRA adapter; continuing, finished and
preempted requests; draft tokens. The runner adds and removes everything a request holds in one
place (`Runner._apply`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set

import numpy as np

from tpu_platform.pooling import PoolingOptions
from tpu_platform.sampling import SamplingOptions


@dataclasses.dataclass(frozen=True, slots=True)
class NewRequest:
    """A request scheduled for the first time (or again after being finished by the engine)."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[Sequence[int]]  # one list per KV-cache group
    num_computed_tokens: int
    sampling: SamplingOptions
    lora_id: int = 0  # its LoRA adapter (`tpu_platform.lora_slots`), 0 for the base model
    pooling: PoolingOptions | None = None  # a pooling request's options (None: a generating one)


@dataclasses.dataclass(frozen=True, slots=True)
class CachedRequest:
    """A request the runner already knows; `resumed` means its block table is replaced."""

    req_id: str
    new_block_ids: Sequence[Sequence[int]] | None  # one list per KV-cache group
    resumed: bool
    num_computed_tokens: int
    num_output_tokens: int


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class CachedRequests:
    """Every continuing or resumed request of a step, column by column (index i is one request).

    Columns, not one object per request: a decode step of R requests is read with a few NumPy
    operations. `new_block_ids[i]` is None when request i got no new pages.
    """

    req_ids: Sequence[str]
    new_block_ids: Sequence[Sequence[Sequence[int]] | None]  # one list per KV-cache group
    resumed_req_ids: Set[str]
    num_computed_tokens: Sequence[int]
    num_output_tokens: Sequence[int]

    @classmethod
    def of(cls, requests: Sequence[CachedRequest]) -> CachedRequests:
        """The columns of `requests`."""
        return cls(
            req_ids=[r.req_id for r in requests],
            new_block_ids=[r.new_block_ids for r in requests],
            resumed_req_ids={r.req_id for r in requests if r.resumed},
            num_computed_tokens=[r.num_computed_tokens for r in requests],
            num_output_tokens=[r.num_output_tokens for r in requests],
        )

    def __len__(self) -> int:
        return len(self.req_ids)


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class StepUpdate:
    """One engine step: state changes, then `num_scheduled_tokens` in batch order."""

    new_requests: Sequence[NewRequest]
    cached: CachedRequests
    finished_req_ids: Set[str]
    num_scheduled_tokens: Mapping[str, int]
    # Requests the scheduler preempted since the last step (they come back as `resumed`).
    preempted_req_ids: Set[str] = frozenset()
    # Speculative decoding: request id -> its draft tokens, the last of its scheduled tokens
    # (-1: a placeholder the scheduler pads with, never accepted).
    spec_tokens: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    # The most drafts a request the proposer may propose after this step (vLLM's
    # `num_spec_tokens_to_schedule`, set by speculative_config's
    # `num_speculative_tokens_per_batch_size`; 0: none); None: k.
    num_spec_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepLogprobs:
    """Per request row (batch order): `[N + 1]` ids and logprobs, sampled token first, and its
    rank; with `cu_num_generated` (a step that verified drafts), per output token instead:
    request i's tokens' rows from `cu_num_generated[i]` to `cu_num_generated[i + 1]`."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    cu_num_generated: list[int] | None = None


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class StepResult:
    """Tokens emitted by one step, in batch order; `[]` for a partial prefill chunk."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: StepLogprobs | None = None
    # Requests whose prompt finished this step: (ids [P - 1, N + 1], logprobs, ranks [P - 1]).
    prompt_logprobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict
    )
