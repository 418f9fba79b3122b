# SPDX-License-Identifier: Apache-2.0
"""The vLLM worker: adapts the engine's calls to the JAX runner in `tpu_platform`."""

from __future__ import annotations

import dataclasses
import time

import torch
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, DraftTokenIds
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from plugin_shim import data_parallel, hosts, lora, translate
from plugin_shim.cache_dtype import runner_kv_cache_dtype, spec_dtype
from plugin_shim.hybrid import state_layer_name, state_specs, with_state_specs
from plugin_shim.logits_processors import LogitsProcessorBridge
from plugin_shim.logs import share_vllm_logging
from plugin_shim.parallel import mesh_tensor_parallel_size
from plugin_shim.platform import runner_load_format
from plugin_shim.pooling import execute_pooling, pooling_config, supported_tasks
from plugin_shim.request_failures import with_failures
from plugin_shim.speculative import runner_speculation
from tpu_platform.envs import read_env
from tpu_platform.metrics_file import MetricsPublisher, expert_token_counts, metrics_path
from tpu_platform.runner import InFlightStep, Runner, RunnerConfig
from tpu_platform.speculation.draft_model import kv_share
from tpu_platform.state_cache import block_bytes, kv_budget_share
from tpu_platform.step_program import KVLayout

logger = init_logger("vllm.xla.worker")

_TORCH_TO_JAX_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def kv_layout(
    config: KVCacheConfig, num_layers: int, sources: tuple[int, ...] = (), state_layers: tuple[int, ...] = ()
) -> KVLayout:
    """How the engine's KV-cache groups share caches between the model's layers (`sources[i]`:
    the layer whose cache layer i reads, for KV-shared layers, which are in no group).

    The engine hands every page to one group at a time, so the k-th layer of each group can share
    one array (this is how the engine sized the cache). One group: one array per layer. A layer
    reading another layer's cache (`kv_sources[i] != i`: no spec of its own was reported) takes
    its source's group and array. A hybrid model's `state_layers` have groups of their own
    (`plugin_shim.hybrid`).
    """
    index_of = {layer_name(i): i for i in range(num_layers)}
    index_of.update({state_layer_name(i): i for i in state_layers})
    groups = [[index_of.get(name, -1) for name in group.layer_names] for group in config.kv_cache_groups]
    listed = {layer for group in groups for layer in group}
    owners = [i for i in range(num_layers) if not sources or sources[i] == i]
    missing = [layer_name(i) for i in owners if i not in listed]
    if missing:
        raise ValueError(f"the engine's KV-cache config has no group for layers {missing[:3]}")
    return KVLayout.from_groups(groups, num_layers, sources, state_layers)


def layer_kv_specs(
    windows: tuple[int | None, ...],
    chunks: tuple[int | None, ...] = (),
    sources: tuple[int, ...] = (),
    **common,
) -> dict[str, KVCacheSpec]:
    """Each layer's KV-cache spec for the engine: chunked local attention (`chunks[i]`), a
    sliding window (`windows[i]`) or full attention, all with the `common` page facts; a layer
    reading another layer's cache (`sources[i] != i`) has no pages of its own and no spec."""
    specs: dict[str, KVCacheSpec] = {}
    for i, window in enumerate(windows):
        if sources and sources[i] != i:
            continue
        chunk = chunks[i] if chunks else None
        if chunk:  # vLLM frees the pages of a layer's earlier chunks, as it does outside a window
            specs[layer_name(i)] = ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **common)
        elif window:
            specs[layer_name(i)] = SlidingWindowSpec(sliding_window=window, **common)
        else:
            specs[layer_name(i)] = FullAttentionSpec(**common)
    return specs


def latent_kv_specs(num_layers: int, *, page_bytes: int | None = None, **common) -> dict[str, KVCacheSpec]:
    """vLLM's MLA spec for every layer: one shared row of `head_size` (`kv_lora_rank +
    qk_rope_head_dim`) values a token (no V), whole on every device, as vLLM's own MLA layers
    describe it; `common`: the page facts. `page_bytes`: what a page of a layer takes in the
    attention backend's layout (the TPU kernel pads rows to 128 lanes: 576 values take 640), the
    spec's padded page when it is more, so vLLM counts the blocks the runner allocates."""
    spec = MLAAttentionSpec(num_kv_heads=1, **common)
    if page_bytes is not None and page_bytes != spec.page_size_bytes:
        spec = MLAAttentionSpec(num_kv_heads=1, page_size_padded=page_bytes, **common)
    return {layer_name(i): spec for i in range(num_layers)}


class _AsyncOutput(AsyncModelRunnerOutput):
    """A sampled step's output, resolved when vLLM asks for it (async scheduling)."""

    def __init__(self, worker: XlaWorker, step: InFlightStep, failures: dict[str, str]):
        self._worker = worker
        self._step = step
        self._failures = failures

    def get_output(self):
        return self._worker.step_output(self._step, self._failures)


class XlaWorker(WorkerBase):
    """One process driving the local JAX devices."""

    def init_device(self) -> None:
        import jax

        share_vllm_logging()  # the runner's `vllm_xla.*` log lines print like vLLM's
        env = read_env()
        self.env = env
        self.metrics: MetricsPublisher | None = None  # set once warm-up is done
        self.failures: dict[str, str] = {}  # the executed step's failed requests, until it is sampled
        # The executed step's drafts: its grammar bitmask rows follow them.
        self.spec_tokens: dict[str, list[int]] = {}
        self.drafts: DraftTokenIds | None = None  # the last step's n-gram drafts, until vLLM takes them
        self.device = torch.device("cpu")
        # Before JAX starts a backend: a data-parallel replica's own devices; across hosts, JAX's
        # hosts, then vLLM's (docs/multihost.md).
        replica = data_parallel.replica(self.vllm_config)
        if replica is not None:
            data_parallel.claim_devices(replica, env.platform)
        replicas, agreement = data_parallel.expert_replicas(self.vllm_config), None
        if replicas > 1:  # every replica's step one program: the ranks in one JAX job
            data_parallel.join_replicas(self.vllm_config, env.platform)
            agreement = data_parallel.replica_agreement(self.vllm_config)
        hosts.join(self.vllm_config, self.rank, self.local_rank, self.distributed_init_method)
        self.num_hosts = self.parallel_config.nnodes
        self.replies = hosts.replies(self.vllm_config, self.rank)  # else vLLM drops the outputs
        mc, sc = self.model_config, self.vllm_config.scheduler_config
        dtype = _TORCH_TO_JAX_DTYPE.get(mc.dtype)
        if dtype is None:
            raise ValueError(
                f"dtype {mc.dtype} is not supported by vllm-xla; use float32, bfloat16 or float16"
            )
        self.logits_bridge = LogitsProcessorBridge.load(self.vllm_config)
        self.runner = Runner(
            RunnerConfig(
                model_path=mc.model,
                dtype=dtype,
                kv_cache_dtype=runner_kv_cache_dtype(self.cache_config),
                max_model_len=mc.max_model_len,
                max_num_seqs=sc.max_num_seqs,
                max_num_batched_tokens=sc.max_num_batched_tokens,
                page_size=self.cache_config.block_size,
                attention_backend=env.attention_backend,
                cache_dir=env.cache_dir,
                load_format=runner_load_format(self.vllm_config.load_config),
                strict_compile=env.strict_compile,
                seed=mc.seed or 0,
                max_logprobs=mc.max_logprobs,
                logprobs_mode=str(mc.logprobs_mode),
                logits_processors=self.logits_bridge is not None,
                tensor_parallel_size=mesh_tensor_parallel_size(self.vllm_config),
                expert_parallel=bool(self.vllm_config.parallel_config.enable_expert_parallel),
                data_parallel_size=replicas,
                quantization=mc.quantization,
                pooling=pooling_config(self.vllm_config),
                lora=lora.runner_lora_config(self.vllm_config),
                speculation=runner_speculation(self.vllm_config),
            ),
            agreement=agreement,
        )
        mesh = self.runner.mesh
        used = (
            [self.runner.device]
            if mesh is None
            else [d for d in mesh.devices.flat if d in jax.local_devices()]
        )
        replicas = self.runner.placement.replicas
        if replicas is not None:
            across = f" (replica {jax.process_index()} of {replicas.size}, one step program)"
        else:
            across = f" (of {mesh.size} on {jax.process_count()} hosts)" if jax.process_count() > 1 else ""
        logger.info("vllm-xla worker drives JAX devices: %s%s", ", ".join(str(d) for d in used), across)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("load_format='dummy' is not supported by vllm-xla; load real weights")
        self.runner.load_model()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return supported_tasks(self.runner.config.pooling)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        mc = self.runner.model_config
        dtype = spec_dtype(self.runner.kv_dtype.name)
        if mc.latent_cache_width:
            return self._latent_cache_specs(dtype)
        heads = self.runner.kv_heads_per_device  # pages and their bytes are per device
        common = dict(
            block_size=self.cache_config.block_size, num_kv_heads=heads, head_size=mc.head_dim, dtype=dtype
        )
        logical = 2 * heads * mc.head_dim * self.cache_config.block_size * dtype.itemsize
        actual = self.runner.kv_page_bytes()
        if actual != logical:  # e.g. head_dim padded to 128 for TPU tiling
            common["page_size_padded"] = actual
        sources = tuple(mc.kv_source(i) for i in range(mc.num_layers))
        specs = layer_kv_specs(mc.layer_sliding_windows, mc.layer_attention_chunks, sources, **common)
        if mc.state_layers:  # a hybrid's state layers: Mamba-style specs instead (`plugin_shim.hybrid`)
            states = state_specs(mc, self.vllm_config, self.runner.dtype, actual, self.runner.tp_size)
            specs = with_state_specs(specs, states, mc.num_layers)
        return specs

    def _latent_cache_specs(self, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        mc = self.runner.model_config
        return latent_kv_specs(
            mc.num_layers, page_bytes=self.runner.kv_page_bytes(), block_size=self.cache_config.block_size,
            head_size=mc.latent_cache_width, dtype=dtype, cache_dtype_str=self.cache_config.cache_dtype,
        )  # fmt: skip

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # nominal: the JAX side allocates its own per-layer arrays

    def determine_available_memory(self) -> int:
        # vLLM's `kv_cache_memory_bytes` first, then our CPU budget or `gpu_memory_utilization`;
        # per device under tensor parallelism (each holds its share of every page).
        available = self.runner.available_kv_bytes(
            self.cache_config.gpu_memory_utilization,
            self.env.cpu_kv_cache_gb,
            self.cache_config.kv_cache_memory_bytes,
        )
        draft = self.runner.speculation and self.runner.speculation.draft
        if draft is not None:  # each page also takes a page of the draft's caches
            runner = self.runner
            target = block_bytes(runner.model_config, runner.kv_page_bytes(), runner.dtype, runner.tp_size)
            draft_bytes = draft.page_bytes(self.cache_config.block_size, runner.kv_dtype, runner.backend)
            available = kv_share(target, draft_bytes, available)
        # A hybrid's state pools beside its KV pages: the engine counts neither (`state_cache`).
        runner = self.runner
        share = kv_budget_share(runner.model_config, runner.kv_page_bytes(), runner.dtype, runner.tp_size)
        available = int(available * share)
        if self.runner.tp_size > 1:
            logger.info(
                "KV cache budget %.2f GiB per device on %d devices (each holds %d of the %d KV heads "
                "of every page)", available / (1 << 30), self.runner.tp_size,
                self.runner.kv_heads_per_device, self.runner.kv_heads,
            )  # fmt: skip
        return available

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        mc = self.runner.model_config
        sources = tuple(mc.kv_source(i) for i in range(mc.num_layers))
        layout = kv_layout(kv_cache_config, mc.num_layers, sources, mc.state_layers)
        self.runner.initialize_kv_cache(kv_cache_config.num_blocks, layout)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Builds every step program before serving (`Runner.warm_up`), or none with vLLM's
        `enforce_eager`: then each program compiles when a step first needs it (a faster start,
        and a first request of each step shape that waits for its compile)."""
        start = time.perf_counter()
        if self.model_config.enforce_eager:
            logger.info("enforce_eager: no warm-up; each step program compiles when first needed")
        else:
            self.runner.warm_up()
        self.metrics = MetricsPublisher(
            metrics_path(
                self.env.cache_dir,
                self.vllm_config.instance_id,
                self.vllm_config.parallel_config.data_parallel_index,  # a dense replica's rank is 0
            )
        )
        self.metrics.publish(self.runner_stats(), force=True)
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)

    def execute_model(self, scheduler_output):
        start = time.perf_counter()
        update, failures = translate.step_update(scheduler_output), {}
        self.spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if self.runner.lora is not None:
            update, failures = lora.admit_requested(self.runner, scheduler_output, update)
        self.runner.stats.host_seconds += time.perf_counter() - start
        if self.runner.config.pooling is not None:  # a pooling engine's step output: no sampling
            with hosts.naming_lost_hosts(self.num_hosts):
                output = execute_pooling(self.runner, scheduler_output, update)
            return output if self.replies else None
        with hosts.naming_lost_hosts(self.num_hosts):
            self.runner.execute(update)
        self.failures = failures  # reported with the step's sampled output
        if self.logits_bridge is not None:
            self.logits_bridge.update(scheduler_output, self.runner.table.row_of)
        if not scheduler_output.total_num_scheduled_tokens:
            return with_failures(EMPTY_MODEL_RUNNER_OUTPUT, failures)  # no sample_tokens call follows
        return None

    def sample_tokens(self, grammar_output):
        """The step's output; under async scheduling, a handle vLLM resolves after it has
        scheduled (and we have dispatched) the next step."""
        bridge = self.logits_bridge
        with hosts.naming_lost_hosts(self.num_hosts):
            step = self.runner.sample_async(
                translate.grammar_bitmasks(grammar_output, self.spec_tokens),
                logits_transform=bridge.apply if bridge else None,
            )
        failures, self.failures = self.failures, {}
        if self.vllm_config.scheduler_config.async_scheduling and bridge is None:
            return _AsyncOutput(self, step, failures)
        return self.step_output(step, failures)

    def step_output(self, step: InFlightStep, failures: dict[str, str]):
        """vLLM's `ModelRunnerOutput` for a sampled step, once its tokens are on the host, naming
        the step's failed requests (`plugin_shim.request_failures`)."""
        with hosts.naming_lost_hosts(self.num_hosts):
            result = self.runner.finish(step)
        if self.logits_bridge is not None:
            self.logits_bridge.record(result)
        speculation = self.runner.speculation
        # The next step's drafts, from the tokens just recorded (none under a logits processor,
        # which leaves every step to the sampler: drafts would only be rejected).
        if speculation is not None and self.logits_bridge is None:
            drafts = speculation.propose(self.runner.table, result.req_ids, result.sampled_token_ids)
            self.drafts = DraftTokenIds(result.req_ids, drafts)
        if self.metrics is not None and self.metrics.due():  # the counters' snapshot is not free
            self.metrics.publish(self.runner_stats())
        if not self.replies:  # another host's worker: its tokens are recorded, vLLM reads host 0's
            return None
        start = time.perf_counter()
        output = with_failures(translate.model_runner_output(result), failures)
        self.runner.stats.host_seconds += time.perf_counter() - start
        return output

    def runner_stats(self) -> dict[str, float]:
        """Counters of the runner and the compiler, for stat loggers and tests."""
        programs = self.runner.programs
        return {
            **dataclasses.asdict(self.runner.stats),
            "compiles": programs.count,
            "programs_loaded": programs.loaded,
            "compile_seconds": programs.seconds,
            "compiles_after_warmup": programs.compiles_after_warmup,
            "kv_groups": self.runner.num_groups,
            **(dataclasses.asdict(self.runner.speculation.stats) if self.runner.speculation else {}),
            **expert_token_counts(self.runner.expert_load),
        }

    # vLLM's LoRA calls (`LLM.llm_engine.add_lora`, the server's /v1/load_lora_adapter, resolvers)

    def add_lora(self, lora_request) -> bool:
        return lora.add(self.runner, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return lora.adapters(self.runner).remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return lora.adapters(self.runner).pin(lora_id)

    def list_loras(self) -> set[int]:
        return lora.adapters(self.runner).ids()

    def execute_dummy_batch(self) -> None:
        """vLLM's step for an idle data-parallel replica of an MoE model, which keeps the replicas'
        expert-parallel collectives in line: with the experts split over the replicas, its part
        in their one step program (`Runner.dummy_step`); else nothing (no exchange)."""
        self.runner.dummy_step()

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self.drafts = self.drafts, None
        return drafts

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.remove()
        self.runner = None
