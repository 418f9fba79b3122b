# SPDX-License-Identifier: Apache-2.0
"""The runner's configuration (fixed for its lifetime) and its running counters."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tpu_platform.lora_slots import LoraConfig

if TYPE_CHECKING:
    from tpu_platform.pooling import PoolingConfig
    from tpu_platform.speculation import SpeculationConfig

# vLLM `quantization` values the runner serves, as int8, fp8 or int4 weights (`models.quantization`),
# or as a GPT-OSS checkpoint's mxfp4 experts hold them (`models.mxfp4`; vLLM names a GPT-OSS one
# `gpt_oss_mxfp4`).
QUANTIZATION_METHODS = (
    "int8_per_channel_weight_only",
    "compressed-tensors",
    "fp8",
    "fp8_per_channel",
    # 4-bit GPTQ checkpoints (`models.gptq_checkpoint`), under each name vLLM gives the method
    "gptq",
    "auto_gptq",
    "gptq_marlin",
    # a GPTQ checkpoint with activation order (desc_act), which vLLM's own GPTQ refuses: the
    # platform's name for it (`plugin_shim.gptq_act_order`)
    "gptq_act_order",
    # 4-bit AWQ checkpoints (`models.awq_checkpoint`), likewise
    "awq",
    "awq_marlin",
    "mxfp4",
    "gpt_oss_mxfp4",
)

GPTQ_ACT_ORDER = "gptq_act_order"

# Tokens a KV page holds when vLLM's `block_size` is not given (`default_page_size`).
ACCELERATOR_PAGE_SIZE = 16
CPU_PAGE_SIZE = 128


def default_page_size(device_kind: str | None, kv_cache_dtype: str | None) -> int:
    """Tokens a KV page holds on `device_kind` ("tpu", "gpu", "cpu"; None: a TPU) for a cache of
    `kv_cache_dtype` (None: the model's dtype) when vLLM's `block_size` is not set.

    CPU: 128, as vLLM's own CPU backend. Decode attention there reads each sequence's pages from
    memory, scattered, and a 128-token page is one contiguous run a kv head, eight times longer
    than at 16 tokens, which the memory system serves faster (measured on a decode layer).
    TPU and GPU: 16 tokens, 32 in a float8 cache (the bytes of a 16-token bfloat16 page, and on
    TPU one whole `(32, 128)` tile of 8-bit values).
    """
    if device_kind == "cpu":
        return CPU_PAGE_SIZE
    float8 = kv_cache_dtype is not None and kv_cache_dtype.startswith("float8")
    return ACCELERATOR_PAGE_SIZE * (2 if float8 else 1)


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What the runner needs to know, fixed for its lifetime."""

    model_path: str
    dtype: str = "float32"
    # The KV cache's values: None for the model's dtype, or one of `kv_cache.KV_CACHE_DTYPES`
    # (float8_e4m3fn, float8_e5m2: half of bfloat16's bytes, stored unscaled).
    kv_cache_dtype: str | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = ACCELERATOR_PAGE_SIZE
    attention_backend: str = "auto"
    native_dense: bool = True  # dense layers natively on cpu_native (bfloat16; float32 on AVX2 CPUs)
    cache_dir: str | None = None
    # vLLM's `load_format`: "npcache" keeps the prepared weights in `cache_dir` (`weights.cache`).
    load_format: str = "auto"
    strict_compile: bool = False
    seed: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    # Whether host-side logits processors rewrite the logits (`Runner.sample`'s transform): only
    # then does an argmax-only step run a sampler program, so only then is one built.
    logits_processors: bool = False
    # vLLM's `tensor_parallel_size`: local devices the model is split over (`tpu_platform.mesh`).
    tensor_parallel_size: int = 1
    # vLLM's `enable_expert_parallel`: the experts split by index over those devices, each whole
    # (`models.sharding`), instead of inside each expert.
    expert_parallel: bool = False
    # vLLM's `data_parallel_size` with the experts split over the replicas (`expert_parallel`):
    # this process drives one replica of `tensor_parallel_size` devices, and every replica's step
    # is one program over all of them (`tpu_platform.replica_step`), the processes joined in one
    # JAX job beforehand. 1: a replica of its own (no exchange with other replicas, if any).
    data_parallel_size: int = 1
    # vLLM's `quantization`: None, or a method serving int8, fp8, int4 or mxfp4 weights
    # (`QUANTIZATION_METHODS`).
    quantization: str | None = None
    # A pooling engine's pooling (`tpu_platform.pooling`); None: a generating one.
    pooling: PoolingConfig | None = None
    # vLLM's LoRA limits when `enable_lora` (`tpu_platform.lora_slots`); None: no adapters.
    lora: LoraConfig | None = None
    # vLLM's `speculative_config` (`tpu_platform.speculation`); None: no speculative decoding.
    speculation: SpeculationConfig | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; supported: {QUANTIZATION_METHODS}"
            )
        if self.data_parallel_size > 1:
            self._check_replicas()

    def _check_replicas(self) -> None:
        """Replicas in one program: the experts over them, and nothing that runs programs of
        its own beside the step (each would need the replicas in lock step)."""
        if not self.expert_parallel:
            raise ValueError(
                "data-parallel replicas in one step program take expert parallelism "
                "(expert_parallel=True): without it each replica is a program of its own"
            )
        for name, value in (
            ("pooling", self.pooling),
            ("lora", self.lora),
            ("speculation", self.speculation),
        ):
            if value is not None:
                raise ValueError(f"{name} is not served with the experts split over data-parallel replicas")


@dataclasses.dataclass(slots=True)
class RunnerStats:
    """Running totals since start (reported by the worker: `runner_stats`)."""

    steps: int = 0
    partial_prefill_steps: int = 0
    preempted_requests: int = 0
    resumed_requests: int = 0
    prefix_cache_hits: int = 0
    # Host time: batch update to dispatched forward, sampler inputs to dispatched sampler, and
    # sampled tokens to the step's output (the worker adds its translation of vLLM's objects);
    # wall time of the whole step (forward dispatched to tokens recorded on the host).
    host_seconds: float = 0.0
    step_seconds: float = 0.0
    # Of `host_seconds`: handing programs to the runtime (the input transfer and the execute
    # calls), the part a faster host path of ours cannot shorten.
    dispatch_seconds: float = 0.0
    # Steps whose tokens the sampler program drew; the others took the forward's argmax.
    sampler_steps: int = 0
    # Async scheduling: steps dispatched before the previous step's tokens reached the host,
    # that took some of them on the device (fed), and that were dispatched while the previous
    # step still ran (overlapped: the device had the next step queued, no wait for the host).
    fed_steps: int = 0
    overlapped_steps: int = 0
