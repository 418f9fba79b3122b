# SPDX-License-Identifier: Apache-2.0
"""The vLLM `Platform` for XLA devices.

torch stays on the host (`device_type = "cpu"`): vLLM builds its sampling metadata and outputs
with CPU tensors, and every device array belongs to JAX inside the worker.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.exceptions import VLLMValidationError
from vllm.platforms.interface import Platform, PlatformEnum

from plugin_shim.cache_dtype import runner_kv_cache_dtype
from plugin_shim.feature_check import SUPPORTED_QUANTIZATION, refuse_quantization, refuse_unsupported
from plugin_shim.flax_models import refuse_unsupported_architecture, register_hybrid_placeholders
from plugin_shim.internals import jax_backends_initialized
from plugin_shim.parallel import configure_parallel
from plugin_shim.speculative import async_scheduling_off_for_draft_model
from tpu_platform.envs import PREFIX, read_env, unknown_variables
from tpu_platform.runner_config import default_page_size

if TYPE_CHECKING:
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

WORKER_CLASS = "plugin_shim.worker.XlaWorker"


class XlaPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "xla"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    ray_device_key = ""
    simple_compile_backend = "eager"
    supported_quantization: list[str] = list(SUPPORTED_QUANTIZATION)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # The first entry is what dtype="auto" falls back to: bfloat16 where the MXU wants it,
        # float32 on CPU (XLA:CPU has no faster bfloat16 matvec, and it keeps exact parity).
        if read_env().platform == "tpu":
            return [torch.bfloat16, torch.float32, torch.float16]
        return [torch.float32, torch.bfloat16, torch.float16]

    def is_cpu(self) -> bool:
        # vLLM calls torch.accelerator.* for non-CPU platforms; our torch side is host-only.
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Sliding-window and full-attention layers get their own KV-cache groups (block tables).
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"xla:{read_env().platform or 'tpu'}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(read_env().cpu_kv_cache_gb * (1 << 30))

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        return None

    @classmethod
    def import_kernels(cls) -> None:
        return None  # no vLLM C++/CUDA ops: every kernel is JAX

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        return 0.0

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        raise RuntimeError(
            "vllm-xla runs attention in JAX; no torch attention backend exists on this platform"
        )

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before vLLM resolves the model: the built-in hybrids vLLM cannot inspect here get a
        placeholder in its registry (`flax_models.register_hybrid_placeholders`); GPTQ checkpoints
        with activation order get our quantization method (`gptq_act_order`)."""
        from plugin_shim.gptq_act_order import register_gptq_act_order

        register_hybrid_placeholders()
        register_gptq_act_order()

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Points vLLM at our worker and turns off torch compilation; safe to call twice."""
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLASS
        if parallel.distributed_executor_backend is None and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"
        async_scheduling_off_for_draft_model(vllm_config)
        refuse_unsupported(vllm_config)  # the one list of features vllm-xla does not implement
        _refuse_strict_compile_without_warm_up(vllm_config.model_config)
        refuse_unsupported_architecture(vllm_config)  # before the worker: with the list we serve
        configure_parallel(vllm_config)  # tensor parallelism: one worker over a mesh
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if vllm_config.load_config is not None:
            runner_load_format(vllm_config.load_config)  # an unsupported one fails here, not in the worker
        cache = vllm_config.cache_config
        if cache is not None:
            kv_dtype = runner_kv_cache_dtype(cache)  # an unsupported one fails here, not in the worker
            if not cache.user_specified_block_size:
                cache.block_size = default_page_size(read_env().platform, kv_dtype)
        from plugin_shim.hybrid import configure_hybrid  # it imports the runner's state caches

        configure_hybrid(vllm_config)  # Gated DeltaNet states: one a request, pages that hold one
        _async_scheduling_off_on_cpu(vllm_config.scheduler_config)
        if vllm_config.lora_config is not None:  # an adapter unreadable at its step fails its request
            from plugin_shim.request_failures import scheduler_fails_requests

            scheduler_fails_requests(vllm_config.scheduler_config)
        _engine_start_method()

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        """vLLM's early quantization check: vLLM's default refuses the methods outside
        `supported_quantization` without naming the others; ours names them and what to do
        (`plugin_shim.feature_check`)."""
        refuse_quantization(quant)

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check of `VLLM_*` variables, knowing ours: a `VLLM_XLA_*` name is checked
        against our knobs (a misspelt one is named with the nearest), any other as vLLM does.
        `hard_fail` (vLLM's `--fail-on-environ-validation`) makes either an error."""
        from vllm import envs
        from vllm.logger import init_logger

        messages = unknown_variables()
        messages += [
            f"Unknown vLLM environment variable detected: {name}"
            for name in os.environ
            if name.startswith("VLLM_")
            and not name.startswith(PREFIX)
            and name not in envs.environment_variables
        ]
        if messages and hard_fail:
            raise ValueError("; ".join(messages))
        for message in messages:
            init_logger("vllm.xla").warning(message)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Rejects, at request time, anything the XLA runner cannot honour (`RequestRefused`)."""
        from vllm.pooling_params import PoolingParams

        from plugin_shim.pooling import pooling_options
        from plugin_shim.translate import refuse_oversized_sampling

        try:
            if isinstance(params, PoolingParams):  # a generating engine's: vLLM refuses its task
                pooling_options(params)  # raises a ValueError naming the unsupported option
            else:
                refuse_oversized_sampling(params)  # also a ValueError naming anything unsupported
        except ValueError as error:
            raise RequestRefused(str(error)) from error


class RequestRefused(VLLMValidationError, ValueError):
    """A request the runner cannot honour: vLLM's server answers 400 with the message (a plain
    ValueError from `validate_request` would be a 500), and offline callers catch a ValueError."""


def _async_scheduling_off_on_cpu(scheduler: SchedulerConfig) -> None:
    """Turns vLLM's async scheduling off on the CPU device, as vLLM's own CPU backend does.

    With a step that takes far longer than its host work there is little to overlap, and
    what overlapping costs is large: vLLM schedules step N+2 while step N+1 runs, so a request
    that arrives waits one more whole step for its first token, and the engine's host thread takes
    a core from the step's compute threads. `VLLM_XLA_CPU_ASYNC_SCHEDULING=1` keeps it (our tests
    of the async path and `benchmarks/host_overhead.py`, which models an accelerator's host).
    """
    env = read_env()
    if env.platform != "cpu" or not scheduler.async_scheduling or env.cpu_async_scheduling:
        return
    scheduler.async_scheduling = False
    from vllm.logger import init_logger

    init_logger("vllm.xla").info(
        "vllm-xla: async scheduling is off on the CPU device (a step's 0.1-3 s leave little to "
        "overlap, and it would delay each new request's first token by a step); "
        "VLLM_XLA_CPU_ASYNC_SCHEDULING=1 keeps it on"
    )


def _refuse_strict_compile_without_warm_up(model_config: ModelConfig | None) -> None:
    """`VLLM_XLA_STRICT_COMPILE=1` makes a compile after warm-up an error; `enforce_eager` skips
    warm-up, so every program compiles while serving: the two cannot both hold."""
    if model_config is not None and model_config.enforce_eager and read_env().strict_compile:
        raise ValueError(
            "enforce_eager skips warm-up (each step program compiles when first needed), and "
            "VLLM_XLA_STRICT_COMPILE=1 makes any compile after warm-up an error: drop one of them"
        )


def _engine_start_method() -> None:
    """Leaves vLLM's way of starting its engine process (fork by default: the engine process
    keeps vLLM, torch and our modules imported, where a spawned one imports them again, a large
    part of a server's start) unless JAX already runs in this process: a fork copies XLA's
    state but not its threads and would deadlock, so then it is spawn. The front end never runs
    JAX itself (`plugin_shim.devices` probes in a subprocess); a notebook or script may have."""
    if not jax_runs_here():
        return
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        from vllm.logger import init_logger

        init_logger("vllm.xla").info(
            "vllm-xla: JAX already runs in this process, so vLLM's engine process is spawned "
            "(VLLM_WORKER_MULTIPROC_METHOD=spawn), not forked"
        )
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def jax_runs_here() -> bool:
    """Whether this process has started a JAX backend (without importing JAX to find out)."""
    return jax_backends_initialized()


# vLLM's load formats we honour: a checkpoint's safetensors (or GGUF, in a model directory), and
# "npcache", which also keeps the prepared weights in our cache directory (`weights.cache`).
LOAD_FORMATS = ("auto", "safetensors", "npcache")


def runner_load_format(load_config) -> str:
    """The runner's `load_format` for vLLM's `load_config`, or a ValueError naming the choices."""
    name = str(getattr(load_config.load_format, "value", load_config.load_format))
    if name == "gguf":
        raise ValueError(
            "load_format='gguf' is not supported by vllm-xla: convert the file with "
            "`vllm-xla model-dir --gguf FILE` and serve the directory it prints"
        )
    if name not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {name!r} is not supported by vllm-xla; use {', '.join(LOAD_FORMATS)} "
            "(npcache also keeps the prepared weights in VLLM_XLA_CACHE_DIR for a faster start)"
        )
    return name
