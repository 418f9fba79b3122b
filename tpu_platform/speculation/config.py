# SPDX-License-Identifier: Apache-2.0
"""The speculative-decoding configuration the runner serves."""

from __future__ import annotations

import dataclasses

from models.mtp import BLOCKS
from models.qwen3_next_mtp import ARCHITECTURES as QWEN_MTP_ARCHITECTURES

# Methods built; vLLM's others (suffix, dflash, ...) are refused at start.
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose proposer is read from a checkpoint (`SpeculationConfig.draft_model`): the draft's,
# the EAGLE or EAGLE-3 head's, or for 'mtp' the target's own (its multi-token-prediction layer).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# Targets whose multi-token-prediction layer drafts for method 'mtp'.
MTP_ARCHITECTURES = (*BLOCKS, *QWEN_MTP_ARCHITECTURES)
# Drafts per request per step: the verification's logits are `[max_num_seqs * (1 + k), V]`.
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """vLLM's `speculative_config`: `method`, `num_speculative_tokens` (k), the n-gram
    proposer's `prompt_lookup_min`/`prompt_lookup_max` (the shortest and longest suffix matched)
    and, for `draft_model`, `eagle`, `eagle3` and `mtp`, the checkpoint directory of the draft,
    of the EAGLE or EAGLE-3 head or of the target whose MTP layer drafts (`model`); `schedule_tokens`: the
    smaller k values of vLLM's `num_speculative_tokens_per_batch_size` (each gets verification
    programs of its own, so a step of fewer drafts is not verified on 1 + k rows a request)."""

    num_tokens: int
    min_n: int = 1
    max_n: int = 4
    method: str = "ngram"
    draft_model: str | None = None
    schedule_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported by vllm-xla; use one of {METHODS}"
            )
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={self.num_tokens} is out of range; use 1 to {MAX_SPECULATIVE_TOKENS}"
            )
        if (self.method in MODEL_METHODS) != (self.draft_model is not None):
            raise ValueError(
                "speculative methods 'draft_model', 'eagle', 'eagle3' and 'mtp' take the drafter's "
                f"checkpoint directory (model=...), and only they do; got method={self.method!r}, "
                f"model={self.draft_model!r}"
            )
        if any(not 1 <= t < self.num_tokens for t in self.schedule_tokens):
            raise ValueError(
                f"schedule_tokens={self.schedule_tokens} must lie between 1 and "
                f"num_speculative_tokens={self.num_tokens} - 1"
            )
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"prompt_lookup_min={self.min_n} and prompt_lookup_max={self.max_n} must satisfy "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )
