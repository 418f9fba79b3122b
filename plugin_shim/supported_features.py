# SPDX-License-Identifier: Apache-2.0
"""The vLLM features vllm-xla serves, each with the options that ask for it: the supported half of
`docs/features.md` (the refused half is `plugin_shim.refused_features`; `plugin_shim.feature_check`
refuses and renders both)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Supported:
    """A vLLM feature that works on this platform."""

    feature: str
    options: str
    note: str


SUPPORTED: tuple[Supported, ...] = (
    Supported(
        "Text generation",
        "runner='generate'",
        "Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Gemma 4 (text, dense or MoE), Mixtral, Qwen3-MoE, "
        "GPT-OSS (bfloat16, or with its mxfp4 experts as released), DeepSeek-V2/V3, Llama 4 (text; "
        "a multimodal checkpoint with --language-model-only), GLM-4.5/4.6 checkpoints "
        "(safetensors; GGUF through `vllm-xla model-dir`)",
    ),
    Supported(
        "Sampling options",
        "SamplingParams",
        "temperature, top-k/p, min-p, seed, penalties, "
        "logit_bias, allowed_token_ids, bad_words, min_tokens, stop, n; a request with an option "
        "the runner cannot honour is refused by name, as is one with more than 4096 logit_bias / "
        "min_tokens stop / bad-word entries (docs/troubleshooting.md)",
    ),
    Supported(
        "Tensor parallelism on one host",
        "tensor_parallel_size",
        "one worker drives a JAX mesh of the host's devices (models/sharding.py); the Ray executor "
        "is refused",
    ),
    Supported(
        "Expert parallelism on one host or across hosts",
        "enable_expert_parallel with tensor_parallel_size (and nnodes)",
        "each device holds E / N whole experts and runs them on the tokens routed to them, one "
        "sum over the devices a layer (models/moe.py); attention stays tensor-parallel; across "
        "hosts the same placement on the hosts' one mesh, each host holding its own devices' "
        "experts; an expert count the TP size does not divide is refused",
    ),
    Supported(
        "Data parallelism on one host",
        "data_parallel_size, data_parallel_size_local, data_parallel_address, data_parallel_rpc_port",
        "N replicas, each vLLM's engine process driving its own tensor_parallel_size devices "
        "(plugin_shim/data_parallel.py); vLLM's front end spreads the requests",
    ),
    Supported(
        "Expert parallelism over data-parallel replicas",
        "enable_expert_parallel with data_parallel_size (and tensor_parallel_size)",
        "each replica attending to its own requests on its own devices (tensor-parallel over them), "
        "the experts split by index over all replicas' devices; the ranks' processes are one JAX "
        "job and every step one program over them, padded to the largest rank's bucket, idle ranks "
        "taking their part by vLLM's dummy batches (tpu_platform/replica_step.py), on one host or "
        "across hosts",
    ),
    Supported(
        "Data-parallel replicas across hosts",
        "data_parallel_size_local below data_parallel_size, headless, data_parallel_start_rank",
        "each host's replicas on its own devices, joined to host 0's front end; `vllm-xla serve` "
        "links the hosts so that a host that dies ends the others non-zero (docs/multihost.md)",
    ),
    Supported(
        "Data-parallel replicas started one by one",
        "data_parallel_rank, data_parallel_external_lb, data_parallel_hybrid_lb, device_ids",
        "each rank (external load balancing, MoE models) or each host's ranks (hybrid) its own API "
        "server, the engines as when one server starts them (experts over the replicas too); "
        "`vllm-xla serve` links the servers so that one that dies ends the others; an engine "
        "drives the devices vLLM assigns it (its local rank's slice of the host's or of --device-ids)",
    ),
    Supported(
        "Tensor parallelism across hosts",
        "nnodes, node_rank, master_addr, master_port, headless, distributed_timeout_seconds",
        "one worker a host, one JAX mesh over every host's devices (docs/multihost.md); "
        "tensor_parallel_size must be a multiple of nnodes; async scheduling is off across hosts",
    ),
    Supported(
        "Logprobs",
        "logprobs, prompt_logprobs, max_logprobs, logprobs_mode",
        "every width up to max_logprobs served by programs built at warm-up",
    ),
    Supported("Structured outputs", "structured_outputs", "vLLM's grammar bitmasks, applied in the step"),
    Supported(
        "Speculative decoding: n-gram (prompt lookup)",
        "speculative_config method='ngram', num_speculative_tokens, prompt_lookup_min/max, "
        "num_speculative_tokens_per_batch_size",
        "drafts verified in the same ragged step; greedy output equal to no speculation, random "
        "sampling by vLLM's rejection rule (temperature, top-k/p, min-p, seeds); penalties, bad "
        "words, min_tokens, logit_bias, allowed ids, grammars and logprobs at every drafted "
        "position (docs/configuration.md)",
    ),
    Supported(
        "Speculative decoding: draft model, EAGLE, EAGLE-3",
        "speculative_config method='draft_model', 'eagle' or 'eagle3', model, num_speculative_tokens, "
        "num_speculative_tokens_per_batch_size",
        "a draft of the target's vocabulary, an EAGLE head (vLLM's EagleLlamaForCausalLM, one "
        "layer) reading the target's final hidden states, or an EAGLE-3 head (vLLM's "
        "LlamaForCausalLMEagle3 layout) reading those of its three chosen layers; each proposer's "
        "k steps in one compiled program, its KV cache inside the same memory budget; under "
        "tensor parallelism split on the target's mesh as the target is (docs/configuration.md)",
    ),
    Supported(
        "Speculative decoding: MTP",
        "speculative_config method='mtp', num_speculative_tokens, num_speculative_tokens_per_batch_size",
        "the multi-token-prediction layer of a DeepSeek-V3 or GLM-4.5 checkpoint "
        "(num_nextn_predict_layers=1) drafts from the target's final hidden states, applied k "
        "times in one compiled program; its KV cache inside the same memory budget; under tensor "
        "parallelism split on the target's mesh as the target is (docs/configuration.md)",
    ),
    Supported("Logits processors", "logits_processors", "vLLM's logits-processor plugins"),
    Supported(
        "Prefix caching, chunked prefill, preemption",
        "enable_prefix_caching, enable_chunked_prefill, max_num_batched_tokens",
        "",
    ),
    Supported(
        "Async scheduling",
        "async_scheduling",
        "off by default on the CPU device (VLLM_XLA_CPU_ASYNC_SCHEDULING=1 keeps it)",
    ),
    Supported(
        "KV-cache size and dtype",
        "block_size, kv_cache_memory_bytes, gpu_memory_utilization, "
        "num_gpu_blocks_override, kv_cache_dtype (auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)",
        "",
    ),
    Supported("Sliding-window models", "", "each window size gets its own KV-cache group"),
    Supported(
        "Hybrid models: Gated DeltaNet beside full attention (Qwen3-Next, Qwen3.5)",
        "",
        "a state per request in each Gated DeltaNet layer, one block of vLLM's hybrid KV-cache manager "
        "(a Mamba-style spec); chunked prefill and preemption; tensor parallelism (key heads split, "
        "the states with them); speculative decoding with n-gram, MTP, draft-model, EAGLE or EAGLE-3 drafts "
        "(1 + k blocks a request, a state after each draft); prefix caching is turned off for them "
        "(docs/models.md)",
    ),
    Supported("Model dtype", "dtype", "float32, bfloat16, float16"),
    Supported(
        "int8 weights (W8A16)",
        "quantization='int8_per_channel_weight_only', quantization='compressed-tensors'",
        "int8 per output channel, symmetric, activations in the model dtype: every linear layer, "
        "the MoE experts and the LM head (the embedding table and MoE router stay in the model "
        "dtype); quantized at load from a float checkpoint, or a compressed-tensors int8 "
        "checkpoint's weights as they are (a W8A8 one's activations stay in the model dtype; the "
        "layers it left in float stay float)",
    ),
    Supported(
        "fp8 weights (W8A16)",
        "quantization='fp8', quantization='fp8_per_channel', quantization='compressed-tensors' "
        "(FP8 checkpoints), a quant_method 'fp8' checkpoint",
        "float8_e4m3fn weights with float32 scales, activations in the model dtype: every linear "
        "layer and the MoE experts; the LM head, embedding and MoE router stay in the model dtype; "
        "quantized at load from a float checkpoint (per output channel), or a checkpoint's fp8 "
        "weights as they are: per tensor, per channel or in 128x128 blocks (DeepSeek-V3, "
        "Qwen3-FP8, Qwen3.5-FP8), the layers it left in float (ignored_layers, ignore) kept "
        "float; a W8A8 checkpoint's activations (static or dynamic) stay in the model dtype",
    ),
    Supported(
        "4-bit weights (W4A16)",
        "quantization='compressed-tensors' (W4A16 checkpoints), quantization='gptq' or 'awq' (a "
        "quant_method 'gptq' or 'awq' checkpoint), a GGUF whose projections are all Q4_0, Q4_1 or Q4_K",
        "a checkpoint's 4-bit weights as they are, with float32 scales per output channel or per "
        "group of inputs (and float32 offsets for zero points or minimums), activations in the "
        "model dtype: compressed-tensors pack-quantized W4A16 (symmetric or with zero points), "
        "GPTQ (bits 4, desc_act served: vLLM's name for it is gptq_act_order), AWQ (GEMM) and "
        "GGUF Q4 blocks, MoE experts included (zero points and act-order too); Qwen3.5's fused "
        "in_proj_qkv (4-bit or fp8) cut into q, k and v in each format's own layout; int4 two a byte on "
        "TPU and GPU (int8 on CPU); the LM head, embedding and MoE router stay in the model dtype "
        "(on the native CPU kernels a tied head's copy is int8, a GGUF's Q8_0 embedding's own "
        "blocks with their float16 d, and GGUF Q4_0 and Q4_1 blocks keep "
        "their float16 d and minimum as the int4 kernel's scales). Refused by name: act-order with "
        "uneven groups or with an expert's gate and up in different orders, other bit widths, a "
        "fused layer's part that is not whole fp8 blocks or packed words",
    ),
    Supported(
        "mxfp4 experts (GPT-OSS)",
        "quantization='mxfp4' (set by the checkpoint's quantization_config)",
        "a GPT-OSS checkpoint's mxfp4 experts (FP4 values in 32-value blocks with e8m0 scales, "
        "as openai/gpt-oss-20b and -120b ship) stay mxfp4 in memory, dequantized tile by tile "
        "inside the routed matmul; attention, router, embedding and head in the model dtype; a "
        "float checkpoint is not quantized to mxfp4 at load",
    ),
    Supported(
        "LoRA adapters",
        "enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_dtype, LoRARequest, "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter, LoRA resolver plugins",
        "PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) on the q/k/v/o and "
        "dense MLP gate/up/down projections; many adapters and the base model mixed in one batch, "
        "each in one of max_loras device slots preallocated at max_lora_rank (loading one never "
        "recompiles); under tensor parallelism and across hosts too; float32, float16 or bfloat16; "
        "refused by name when loaded: a rank above max_lora_rank, other target modules (embed_tokens, "
        "lm_head, MoE experts), DoRA, biases, modules_to_save, NaN/infinite values or alphas, values "
        "beyond the slot dtype, target_modules patterns with backreferences or lookarounds",
    ),
    Supported("Load formats", "load_format", "auto, safetensors, npcache"),
    Supported(
        "Scheduler options",
        "max_num_seqs, max_model_len, scheduling_policy, scheduler_cls",
        "a scheduler_cls (a subclass of vLLM's v1 Scheduler) runs unchanged; with LoRA on and none "
        "set, vLLM's scheduler extended to fail one request whose adapter cannot be read",
    ),
    Supported(
        "Out-of-tree models",
        "vllm.general_plugins",
        "a package's Flax NNX model, registered with plugin_shim.register_flax_model (docs/models.md); "
        "an architecture neither built in nor registered is refused at start with the served list",
    ),
    Supported(
        "Stat loggers and metrics",
        "disable_log_stats, stat logger plugins",
        "vllm_xla:* gauges beside vLLM's",
    ),
    Supported(
        "Compilation at first use",
        "enforce_eager",
        "no warm-up: each step program (forward per padded shape, sampler variant) compiles when a "
        "step first needs it, or loads from the executable cache; a faster start for development and "
        "notebooks, and the first request of each shape waits for its compile. Without it every "
        "program is built before serving and nothing compiles while serving; refused with "
        "VLLM_XLA_STRICT_COMPILE=1",
    ),
    Supported(
        "Accepted, no effect",
        "compilation_config, cudagraph options, numa_bind",
        "torch compilation and CUDA graphs do not apply: XLA compiles each step program once",
    ),
    Supported(
        "Pooling: embeddings, classification, scoring",
        "runner='pooling', convert='embed' or a *ForSequenceClassification checkpoint, pooler_config "
        "(pooling_type LAST, MEAN or CLS; use_activation, dimensions, logit_mean, logit_sigma), "
        "io_processor_plugin",
        "LLM.embed / classify / score / encode, /v1/embeddings, /classify, /score, /pooling and "
        "IO-processor plugins; the pooled row is computed in a jitted program per step shape; "
        "Llama and Qwen3 classifiers (their score head); token-wise tasks (token_embed, "
        "token_classify) are refused by name at request time",
    ),
    Supported("OpenAI-compatible server", "vllm serve / vllm-xla serve", "completions, chat, streaming"),
)
