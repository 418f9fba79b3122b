# SPDX-License-Identifier: Apache-2.0
"""The vLLM options vllm-xla does not implement, each with the check that finds it in a config and
what to do instead: the refused half of `docs/features.md` (the supported half is
`plugin_shim.supported_features`; `plugin_shim.feature_check` refuses and renders both). A feature
that lands moves from `REFUSED` to `SUPPORTED` and gets its own tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from plugin_shim import speculative
from plugin_shim.data_parallel import LINK_KEY
from plugin_shim.internals import model_default_attention_backend
from tpu_platform.runner_config import QUANTIZATION_METHODS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A vLLM option the worker does not implement."""

    option: str  # vLLM's name (`EngineArgs` field / CLI flag without dashes)
    feature: str  # what it is, in a few words
    refused: str  # which values are refused
    detect: Callable[[VllmConfig], bool]  # whether the config asks for it
    instead: str  # what to do instead
    # The values the config asks for, named before the message (None: the option says it all).
    asked: Callable[[VllmConfig], str] | None = None


def _model(config: VllmConfig) -> Any:
    return config.model_config


def _parallel(config: VllmConfig) -> Any:
    return config.parallel_config


def _asked_attention_backend(config: VllmConfig) -> Any:
    """The attention backend the user asked for: the config's, unless it is the one vLLM's own
    config step for the model sets by itself (`internals.model_default_attention_backend`)."""
    backend = config.attention_config.backend
    if backend is None or backend == model_default_attention_backend(config):
        return None
    return backend


def _uva_offload_gb(config: VllmConfig) -> float:
    offload = getattr(config, "offload_config", None)
    return float(offload.uva.cpu_offload_gb) if offload is not None else 0.0


def _prefetch_offload(config: VllmConfig) -> bool:
    offload = getattr(config, "offload_config", None)
    return offload is not None and offload.prefetch.offload_group_size > 0


def _multimodal_inputs_open(config: VllmConfig) -> bool:
    """Whether a multimodal model's engine would take inputs other than text: vLLM's own
    `supports_multimodal_inputs`, false with `language_model_only` or every modality the model
    supports limited to 0 a prompt."""
    model = _model(config)
    if not model.is_multimodal_model:
        return False
    return model.multimodal_config is None or bool(model.supports_multimodal_inputs)


def _unsupported_pooling(config: VllmConfig) -> bool:
    from plugin_shim.pooling import unsupported_pooling  # it imports torch and vllm

    model = _model(config)
    if model.runner_type != "pooling" and model.convert_type not in ("none", None):
        return True
    return unsupported_pooling(model) is not None


def _pooling_asked(config: VllmConfig) -> str:
    """What vLLM resolved (a pooling architecture, or `runner="auto"`, resolves to pooling), and
    why it is refused."""
    from plugin_shim.pooling import unsupported_pooling

    model = _model(config)
    why = unsupported_pooling(model)
    return f"runner={model.runner_type!r}, convert={model.convert_type!r}" + (f" ({why})" if why else "")


def _has_link(config: VllmConfig) -> bool:
    extra = config.additional_config
    return isinstance(extra, dict) and LINK_KEY in extra


def _dp_across_hosts(parallel) -> bool:
    size = parallel.data_parallel_size
    if size <= 1:
        return False
    started_alone = parallel.data_parallel_external_lb or parallel.data_parallel_hybrid_lb
    return bool(started_alone) or parallel.nnodes > 1 or parallel.data_parallel_size_local != size


def _experts_over_replicas(config: VllmConfig) -> bool:
    parallel = _parallel(config)
    return bool(parallel.enable_expert_parallel) and parallel.data_parallel_size > 1


def _replicas_with_others(config: VllmConfig) -> bool:
    pooling = getattr(_model(config), "runner_type", "generate") == "pooling"
    return bool(config.lora_config or config.speculative_config or pooling or _hybrid(config))


_NO_PARALLELISM = (
    "use --tensor-parallel-size to split the model over this host's devices (one process per "
    "host behind a load balancer scales out)"
)

# vLLM `quantization` values served (int8, fp8 or int4 weights, `models.quantization`); anything else
# is refused.
SUPPORTED_QUANTIZATION: tuple[str, ...] = QUANTIZATION_METHODS


def _other_quantization(config: VllmConfig) -> bool:
    method = _model(config).quantization
    return method is not None and method not in SUPPORTED_QUANTIZATION


def _online_patterns(config: VllmConfig) -> bool:
    """Whether vLLM's online-quantization options name layers to skip or to quantize otherwise."""
    args = _model(config).quantization_config
    return bool(getattr(args, "ignore", None) or getattr(args, "targets", None))


def _hybrid(config: VllmConfig) -> bool:
    """Whether the model mixes Gated DeltaNet (state) layers with attention (Qwen3-Next, Qwen3.5)."""
    return bool(_model(config).is_hybrid)


REFUSED: tuple[Refusal, ...] = (
    Refusal(
        "fully_sharded_loras",
        "LoRA computation sharded over tensor-parallel devices",
        "True",
        lambda c: c.lora_config is not None and bool(c.lora_config.fully_sharded_loras),
        "leave it off: under tensor parallelism each adapter's update follows its projection's split, "
        "and so do its slot arrays (B split on a column-parallel projection's outputs, A on a "
        "row-parallel one's inputs)",
    ),
    Refusal(
        "lora_target_modules",
        "restricting LoRA to some modules at deployment",
        "any value",
        lambda c: c.lora_config is not None and bool(c.lora_config.target_modules),
        "leave it unset: every q/k/v/o and gate/up/down projection can carry an adapter, and each "
        "adapter adapts the modules it has weights for",
    ),
    Refusal(
        "enable_mixed_moe_lora_format",
        "LoRA adapters on MoE experts",
        "True",
        lambda c: c.lora_config is not None and bool(c.lora_config.enable_mixed_moe_lora_format),
        "leave it off: on MoE models adapters may target the attention projections only",
    ),
    Refusal(
        "enable_moe_shared_loras",
        "LoRA adapters on MoE experts",
        "True",
        lambda c: c.lora_config is not None and bool(c.lora_config.enable_moe_shared_loras),
        "leave it off: on MoE models adapters may target the attention projections only",
    ),
    Refusal(
        "enable_prompt_embeds",
        "prompt embeddings as input",
        "True",
        lambda c: bool(_model(c).enable_prompt_embeds),
        "send token ids or text prompts",
    ),
    Refusal(
        "quantization",
        "other quantized weights (also a checkpoint's quantization_config)",
        f"anything but {', '.join(SUPPORTED_QUANTIZATION)}",
        _other_quantization,
        "quantization='int8_per_channel_weight_only' quantizes a float checkpoint's weights to int8 "
        "at load (a GGUF's Q8_0 weights load as they are), quantization='fp8' or 'fp8_per_channel' "
        "to fp8 with a scale per output channel (for 'fp8_per_tensor' and 'fp8_per_block' use "
        "'fp8_per_channel': at least as precise); a compressed-tensors int8 checkpoint (8-bit "
        "symmetric weights, per channel, per tensor or per group), a compressed-tensors FP8 one "
        "(per channel, per tensor or per block), a quant_method 'fp8' one (per tensor or in "
        "weight_block_size blocks), a compressed-tensors W4A16 one (4-bit, pack-quantized, per "
        "channel or per group, zero points or not), a 4-bit GPTQ one (desc_act or not), a 4-bit "
        "AWQ one (GEMM) and a GGUF's Q4_0, Q4_1 and Q4_K blocks load as they are, and so do "
        "GPT-OSS's mxfp4 experts (quantization='mxfp4', the "
        "released checkpoints); otherwise "
        "serve an unquantized checkpoint (a GGUF file converts "
        "with `vllm-xla model-dir --gguf FILE`)",
    ),
    Refusal(
        "quantization_config",
        "per-layer online quantization",
        "ignore or targets patterns",
        _online_patterns,
        "leave them out: quantization at load covers every projection and the MoE experts, "
        "never the LM head, embedding or router",
    ),
    Refusal(
        "speculative_config",
        "speculative decoding beyond n-gram, draft-model, EAGLE, EAGLE-3 and MTP drafts",
        speculative.REFUSED_VALUES,
        lambda c: speculative.unsupported_speculation(c) is not None,
        speculative.INSTEAD,
        speculative.unsupported_speculation,
    ),
    Refusal(
        "enable_lora with a hybrid model",
        "LoRA adapters on hybrid models",
        "True",
        lambda c: _hybrid(c) and c.lora_config is not None,
        "merge the adapter into the checkpoint: adapters on the Gated DeltaNet and gated attention "
        "projections are not built",
    ),
    Refusal(
        "runner with a hybrid model",
        "pooling with hybrid models",
        "'pooling' (or a convert)",
        lambda c: _hybrid(c) and _model(c).runner_type == "pooling",
        "serve the model for generation; pooling runs attention-only models",
    ),
    Refusal(
        "mamba_cache_dtype / mamba_ssm_cache_dtype",
        "another dtype for Gated DeltaNet states",
        "anything but 'auto' (conv inputs in the model's dtype, the recurrent state in float32)",
        lambda c: (
            c.cache_config.mamba_cache_dtype != "auto"
            or c.cache_config.mamba_ssm_cache_dtype not in ("auto", "float32")
        ),
        "leave mamba_cache_dtype and mamba_ssm_cache_dtype 'auto'",
    ),
    Refusal(
        "cpu_offload_gb",
        "offloading weights to host memory",
        "> 0",
        lambda c: _uva_offload_gb(c) > 0,
        "leave it 0: the weights stay on the device (a smaller max_num_seqs or max_model_len leaves "
        "them more room)",
    ),
    Refusal(
        "offload_group_size",
        "prefetched layer offloading",
        "> 0",
        _prefetch_offload,
        "leave it 0: the weights stay on the device",
    ),
    Refusal(
        "pipeline_parallel_size",
        "pipeline parallelism",
        "> 1",
        lambda c: _parallel(c).pipeline_parallel_size > 1,
        _NO_PARALLELISM,
    ),
    Refusal(
        "data_parallel_size with nnodes",
        "data-parallel replicas of a multi-host tensor-parallel model",
        "nnodes > 1 with data_parallel_size > 1",
        lambda c: _parallel(c).data_parallel_size > 1 and _parallel(c).nnodes > 1,
        "spread replicas over hosts with vLLM's data-parallel options instead (--data-parallel-size-local, "
        "--data-parallel-address, --data-parallel-rpc-port, the other hosts --headless with "
        "--data-parallel-start-rank), each replica on one host's devices",
    ),
    Refusal(
        "data_parallel_size_local below data_parallel_size, or data_parallel_rank "
        "(external / hybrid load balancing), without vllm-xla serve",
        "data-parallel replicas across hosts or started one by one without the replicas' liveness "
        "link (`vllm serve` or vllm.LLM: a replica that died would not end the others)",
        "a replica in another process group",
        lambda c: _dp_across_hosts(_parallel(c)) and _parallel(c).nnodes <= 1 and not _has_link(c),
        "start every host (every rank) with `vllm-xla serve` and the same options: it joins the "
        "replicas' liveness link (docs/multihost.md)",
    ),
    Refusal(
        "decode_context_parallel_size",
        "decode context parallelism",
        "> 1",
        lambda c: _parallel(c).decode_context_parallel_size > 1,
        _NO_PARALLELISM,
    ),
    Refusal(
        "enable_expert_parallel with data_parallel_size, with LoRA, speculative decoding or pooling",
        "LoRA adapters, speculative decoding, pooling or a hybrid model's state layers with the "
        "experts split over data-parallel replicas (each runs programs of its own beside the "
        "replicas' one step)",
        "enable_lora, speculative_config, runner='pooling' or a hybrid model",
        lambda c: _experts_over_replicas(c) and _replicas_with_others(c),
        "leave them off, or split the experts inside each replica (without --enable-expert-parallel "
        "over --data-parallel-size)",
    ),
    Refusal(
        "enable_eplb / expert_placement_strategy",
        "expert load balancing (redundant experts) or round-robin expert placement",
        "enable_eplb=True; expert_placement_strategy='round_robin'",
        lambda c: bool(_parallel(c).enable_eplb) or _parallel(c).expert_placement_strategy != "linear",
        "leave them off and linear: device i holds experts i * E / N to (i + 1) * E / N - 1, once",
    ),
    Refusal(
        "runner / convert",
        "pooling beyond sequence embeddings and classification (a pooling architecture of its own, "
        "convert='classify' on a checkpoint without a score head), or generating with a classifier",
        "runner='pooling' other than convert='embed' or a *ForSequenceClassification checkpoint's "
        "convert='classify'; runner='generate' on a *ForSequenceClassification checkpoint",
        _unsupported_pooling,
        "embed with a causal LM's checkpoint (runner='pooling', convert='embed'), or classify with a "
        "Llama or Qwen3 *ForSequenceClassification checkpoint",
        asked=_pooling_asked,
    ),
    Refusal(
        "kv_offloading_size",
        "KV-cache offloading to host memory",
        "any value",
        lambda c: c.cache_config.kv_offloading_size is not None,
        "leave it unset; size the device's KV cache with kv_cache_memory_bytes or gpu_memory_utilization",
    ),
    Refusal(
        "kv_transfer_config",
        "KV-cache transfer connectors (disaggregated prefill)",
        "any value",
        lambda c: c.kv_transfer_config is not None,
        "serve prefill and decode in one engine",
    ),
    Refusal(
        "ec_transfer_config",
        "encoder-cache transfer connectors",
        "any value",
        lambda c: c.ec_transfer_config is not None,
        "leave it unset (vllm-xla serves text-only models)",
    ),
    Refusal(
        "multimodal inputs",
        "a multimodal model's image, audio or video inputs",
        "a multimodal model with any modality allowed",
        lambda c: _multimodal_inputs_open(c),
        "serve a text-only checkpoint, or the text model of one vllm-xla serves "
        "(Llama4ForConditionalGeneration, Gemma4ForConditionalGeneration) with --language-model-only "
        "(or every modality's --limit-mm-per-prompt at 0)",
    ),
    Refusal(
        "hf_overrides",
        "overriding the checkpoint's config.json",
        "any value",
        lambda c: bool(_model(c).hf_overrides),
        "copy the model directory and edit its config.json",
    ),
    Refusal(
        "hf_config_path",
        "a config.json from another path",
        "any value",
        lambda c: bool(_model(c).hf_config_path),
        "put the config.json into the model directory",
    ),
    Refusal(
        "model_loader_extra_config",
        "options for vLLM's weight loaders",
        "any value",
        lambda c: bool(c.load_config.model_loader_extra_config),
        "leave it unset: vllm-xla reads the checkpoint itself (load_format chooses how)",
    ),
    Refusal(
        "disable_sliding_window",
        "ignoring the model's sliding window",
        "True",
        lambda c: bool(_model(c).disable_sliding_window),
        "leave it off: layers with a sliding window attend within it",
    ),
    Refusal(
        "model_impl",
        "another model implementation",
        "anything but 'auto'",
        lambda c: str(getattr(_model(c).model_impl, "value", _model(c).model_impl)) != "auto",
        "leave it 'auto': vllm-xla runs its own Flax models",
    ),
    Refusal(
        "attention_backend",
        "vLLM's torch attention backends",
        "any value",
        lambda c: _asked_attention_backend(c) is not None,
        "choose the JAX attention kernel with VLLM_XLA_ATTENTION_BACKEND (one vLLM itself sets "
        "for a model, e.g. Gemma 4's, is not the user's and is left unused)",
    ),
    Refusal(
        "watermark_config",
        "text watermarking",
        "any value",
        lambda c: getattr(c, "watermark_config", None) is not None,
        "leave it unset",
    ),
    Refusal(
        "enable_return_routed_experts",
        "returning MoE routing decisions",
        "True",
        lambda c: bool(c.aux_output_config.enabled),
        "leave it off",
    ),
    Refusal(
        "weight_transfer_config",
        "in-place weight updates",
        "any value",
        lambda c: getattr(c, "weight_transfer_config", None) is not None,
        "restart the engine on the new checkpoint",
    ),
)
