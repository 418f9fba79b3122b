# SPDX-License-Identifier: Apache-2.0
"""vLLM's `speculative_config` for the runner: what is served, what is refused by name at start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugin_shim.parallel import mesh_tensor_parallel_size
from tpu_platform.speculation import MAX_SPECULATIVE_TOKENS, SpeculationConfig
from tpu_platform.speculation.config import METHODS, MODEL_METHODS, MTP_ARCHITECTURES, QWEN_MTP_ARCHITECTURES

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def runner_speculation(config: VllmConfig) -> SpeculationConfig | None:
    """The runner's `SpeculationConfig` for vLLM's `speculative_config` (None when unset)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "mtp":  # the target's own checkpoint holds the layer
        draft = config.model_config.model
    else:
        draft = spec.draft_model_config.model if spec.method in MODEL_METHODS else None
    k, schedule = spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size or ()
    return SpeculationConfig(
        num_tokens=spec.num_speculative_tokens,
        min_n=spec.prompt_lookup_min or 1,
        max_n=spec.prompt_lookup_max or spec.prompt_lookup_min or 1,
        method=spec.method,
        draft_model=draft,
        # vLLM caps each range's k at num_speculative_tokens (`build_dynamic_sd_schedule_lookup`).
        schedule_tokens=tuple(sorted({min(t, k) for _, _, t in schedule} - {0, k})),
    )


def async_scheduling_off_for_draft_model(config: VllmConfig) -> None:
    """Turns async scheduling off for a draft model, an EAGLE or EAGLE-3 head or an MTP layer, as
    vLLM does for its proposers that read the step before's tokens on the host: vLLM turns it on
    by default for 'draft_model', 'eagle', 'eagle3' and 'mtp', whose drafts our runner proposes
    from the recorded tokens."""
    spec, scheduler = config.speculative_config, config.scheduler_config
    if spec is None or spec.method not in MODEL_METHODS:
        return
    if scheduler is None or not scheduler.async_scheduling:
        return
    scheduler.async_scheduling = False
    from vllm.logger import init_logger

    init_logger("vllm.xla").warning(
        "vllm-xla: async scheduling is off with speculative method %r (drafts follow the step)", spec.method
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
    if spec.method in MODEL_METHODS and (why := _unsupported_draft_tp(config)):
        return why
    if spec.method == "draft_model":
        return _unsupported_draft(config)
    if spec.method == "mtp":
        return _unsupported_mtp(config)
    return None


def _unsupported_mtp(config: VllmConfig) -> str | None:
    """Why the target's checkpoint has no MTP layer to draft with (None when it has one)."""
    hf = config.model_config.hf_config
    architecture = (getattr(hf, "architectures", None) or ["?"])[0]
    if architecture not in MTP_ARCHITECTURES:
        return f"method='mtp' with {architecture} (no multi-token-prediction layer served)"
    field = "mtp_num_hidden_layers" if architecture in QWEN_MTP_ARCHITECTURES else "num_nextn_predict_layers"
    layers = getattr(hf, field, 0) or 0
    if layers != 1:
        return f"method='mtp' on a checkpoint with {field}={layers}"
    return None


def _unsupported_draft(config: VllmConfig) -> str | None:
    """Why a draft model cannot serve `config`'s target (None when it can)."""
    spec = config.speculative_config
    if spec.use_heterogeneous_vocab:
        return "use_heterogeneous_vocab=True"
    draft_vocab, target_vocab = spec.draft_model_config.get_vocab_size(), config.model_config.get_vocab_size()
    if draft_vocab != target_vocab:
        return f"a draft model of vocab_size={draft_vocab} (the target's is {target_vocab})"
    return None


def _unsupported_draft_tp(config: VllmConfig) -> str | None:
    """Why the drafter cannot run at its `draft_tensor_parallel_size` (None when it can): it is
    split on the target's mesh, as the target is, so only the target's size is served. Across
    hosts that is the mesh's size, not vLLM's one rank a host (`plugin_shim.parallel`)."""
    draft_tp = getattr(config.speculative_config, "draft_tensor_parallel_size", None)
    target_tp = mesh_tensor_parallel_size(config)
    if draft_tp is not None and draft_tp != target_tp:
        return f"draft_tensor_parallel_size={draft_tp} with tensor_parallel_size={target_tp}"
    return None


REFUSED_VALUES = (
    f"methods other than {', '.join(METHODS)} (suffix, dflash, ...); "
    f"num_speculative_tokens above {MAX_SPECULATIVE_TOKENS}; async scheduling with drafts "
    "(the proposers read the tokens of the step before); a draft model of another vocabulary "
    "(use_heterogeneous_vocab, or another vocab_size); a draft model, EAGLE head or MTP layer "
    "at a draft_tensor_parallel_size other than the target's tensor_parallel_size; 'mtp' on a "
    "checkpoint without exactly one "
    f"multi-token-prediction layer, or of an architecture other than {', '.join(MTP_ARCHITECTURES)}"
)
INSTEAD = (
    f"use method='ngram' (prompt_lookup_min/max), 'draft_model' (a draft of the target's "
    "tokenizer), 'eagle' or 'eagle3' (a head of vLLM's EagleLlamaForCausalLM or "
    "LlamaForCausalLMEagle3 layout made for the target) or 'mtp' (a DeepSeek-V3 or GLM-4.5 "
    "checkpoint with its MTP layer), the last four with "
    "draft_tensor_parallel_size unset or equal to tensor_parallel_size (the drafter is split "
    f"as the target is), with num_speculative_tokens 1 to {MAX_SPECULATIVE_TOKENS}, with "
    "async scheduling off (--no-async-scheduling), or leave speculative_config unset"
)
