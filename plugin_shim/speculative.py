# SPDX-License-Identifier: Apache-2.0
"""vLLM's `speculative_config` for the runner: what is served, what is refused by name at start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_platform.speculation import MAX_SPECULATIVE_TOKENS, SpeculationConfig
from tpu_platform.speculation.config import METHODS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def runner_speculation(config: VllmConfig) -> SpeculationConfig | None:
    """The runner's `SpeculationConfig` for vLLM's `speculative_config` (None when unset)."""
    spec = config.speculative_config
    if spec is None:
        return None
    return SpeculationConfig(
        num_tokens=spec.num_speculative_tokens,
        min_n=spec.prompt_lookup_min or 1,
        max_n=spec.prompt_lookup_max or spec.prompt_lookup_min or 1,
        method=spec.method,
    )


def unsupported_speculation(config: VllmConfig) -> str | None:
    """Why `config`'s speculative decoding cannot be served (None when it can, or is unset)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method not in METHODS:
        return f"method={spec.method!r}"
    if not 1 <= spec.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        return f"num_speculative_tokens={spec.num_speculative_tokens}"
    if config.scheduler_config.async_scheduling:
        return "async_scheduling=True"
    return None


REFUSED_VALUES = (
    f"methods other than {', '.join(METHODS)} (draft_model, eagle, eagle3, mtp, suffix, ...); "
    f"num_speculative_tokens above {MAX_SPECULATIVE_TOKENS}; async scheduling with n-gram drafts "
    "(vLLM's host n-gram proposer reads the tokens of the step before)"
)
INSTEAD = (
    f"use method='ngram' with num_speculative_tokens 1 to {MAX_SPECULATIVE_TOKENS} and "
    "prompt_lookup_min/max, with async scheduling off (--no-async-scheduling), or leave "
    "speculative_config unset"
)
