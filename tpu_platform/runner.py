# SPDX-License-Identifier: Apache-2.0
"""The model runner: request state on the host, one jitted forward and one jitted sampler on device."""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig
from models.sharding import kv_heads_on_mesh
from tpu_platform.attention_backend import native_dense_isa, select_backend
from tpu_platform.buckets import StepBuckets
from tpu_platform.collector import collector_paused
from tpu_platform.dispatch import FlatCall, HostViews
from tpu_platform.inputs import StepBuffers, pack_inputs, padding_inputs, prepare_step
from tpu_platform.kv_cache import available_kv_bytes, kv_cache_dtype, page_bytes_per_device
from tpu_platform.pooling import PoolingRequests, pooled_outputs
from tpu_platform.programs import ExecutableCache, Programs, ProgramSpec, enable_persistent_cache
from tpu_platform.replica_step import agreed_tokens, fewest, num_replicas, own_part, side_by_side
from tpu_platform.runner_config import RunnerConfig, RunnerStats
from tpu_platform.runner_state import (
    LoadedModel,
    Placement,
    RecordField,
    StepState,
    build_step_state,
    load_runner_model,
)
from tpu_platform.sampling import SamplerFlags, SamplerOutput, SamplingTensors
from tpu_platform.sampling.uniform import has_extras, with_all_extras
from tpu_platform.state_cache import keep_accepted_states, state_columns
from tpu_platform.step_program import KVLayout
from tpu_platform.step_record import DispatchedStep, InFlightStep, record_step
from tpu_platform.step_update import StepLogprobs, StepResult, StepUpdate
from tpu_platform.warm_up import run_once, warm_up_specs

logger = logging.getLogger(f"vllm_xla.{__name__}")


class Runner:
    """Drives one model on the default JAX device, step by step.

    Built in three phases, each making one record (`runner_state`): the constructor its
    `placement`, `load_model` the `loaded` model, `initialize_kv_cache` the `steps` state. The
    attributes below read through them; read before their phase, they name it (`PhaseNotRun`).
    """

    device = RecordField("placement", "device")
    mesh = RecordField("placement", "mesh")  # None on one device: everything lives on `device`
    _whole = RecordField("placement", "whole")  # step inputs, logits, sampled tokens
    weight_shardings = RecordField("placement", "weight_shardings")
    model_config = RecordField("loaded", "config")
    state = RecordField("loaded", "state")
    _graphdef = RecordField("loaded", "graphdef")
    _state_def = RecordField("loaded", "state_def")
    _state_leaves = RecordField("loaded", "state_leaves")
    lora = RecordField("loaded", "lora")
    speculation = RecordField("loaded", "speculation")
    _prompt_logprobs = RecordField("loaded", "prompt_logprobs_program")
    prompt_logprobs = RecordField("loaded", "prompt_logprobs")
    _pooling = RecordField("loaded", "pooling")
    _sample = RecordField("loaded", "sample")
    _no_feed = RecordField("loaded", "no_feed")
    sampling = RecordField("loaded", "sampling")
    _extra_widths = RecordField("loaded", "extra_widths")
    _logprobs_width = RecordField("loaded", "logprobs_width")
    step_program = RecordField("steps", "program")
    table = RecordField("steps", "table")
    num_pages = RecordField("steps", "num_pages")
    num_groups = RecordField("steps", "num_groups")

    def __init__(self, config: RunnerConfig, agreement: Callable[[int], int] | None = None):
        """`agreement(value)`: the largest of every data-parallel replica's `value` (replicas in
        one program: each step's tokens, to pad to one bucket); default: a gather over the JAX
        job, run once this runner's step in flight is done (a collective program beside the
        step's could interleave their exchanges)."""
        self.config = config
        self._agreement = agreement
        self.placement = Placement.for_config(config)
        self.tp_size = config.tensor_parallel_size
        self.loaded: LoadedModel | None = None
        self.steps: StepState | None = None
        self.backend = select_backend(config.attention_backend, self.device.platform, config.cache_dir)
        # The native dense kernel's instruction set here ("amx", "avx512_bf16", "avx2"), or None:
        # XLA's dots (always on a mesh: XLA splits its dots, not the native kernel's calls).
        one_device = self.mesh is None and self.placement.replicas is None
        native = config.native_dense and one_device
        self.dense_isa = native_dense_isa(self.backend, config.cache_dir) if native else None
        executables = None
        if config.cache_dir:
            enable_persistent_cache(config.cache_dir)
            if one_device:  # serialized executables are loaded for one device
                executables = ExecutableCache(os.path.join(config.cache_dir, "executables"), self.device)
        self.dtype = jnp.dtype(config.dtype)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype or config.dtype)
        self.kv_caches: list[jax.Array] = []  # every step donates them and keeps their successors
        self.buckets = StepBuckets.for_limits(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            page_size=config.page_size,
            min_pages=state_columns(config.speculation),
            spec_tokens=config.speculation.num_tokens if config.speculation else 0,
        )
        self.programs = Programs(strict=config.strict_compile, cache=executables)
        self._pending: DispatchedStep | None = None
        # Sampled steps whose tokens are not recorded yet, oldest first (async scheduling keeps one).
        self._in_flight: collections.deque[InFlightStep] = collections.deque()
        self._step_index = 0
        self.stats = RunnerStats()
        # A MoE model's `[L, E]` tokens routed to each expert of each MoE layer since start.
        self.expert_load: np.ndarray | None = None
        self._flat_forwards: dict[tuple, FlatCall | None] = {}  # by program key, once it ran
        self._buffers = StepBuffers()  # the steps' packed inputs (`prepare_step`)
        self._input_views = HostViews()  # their device arrays, where those read them in place
        self.pooling_requests = PoolingRequests()  # a pooling runner's per-request options

    # -- start-up -----------------------------------------------------------------------------

    @collector_paused()  # start-up's objects outlive it: no full collections while made
    def load_model(self) -> ModelConfig:
        start = time.perf_counter()
        memo = self.programs.cache.directory if self.programs.cache else None  # the code digests' memo
        self.loaded = load_runner_model(
            self.config, self.placement, dtype=self.dtype, dense_isa=self.dense_isa,
            programs=self.programs, buckets=self.buckets, memo_dir=memo,
        )  # fmt: skip
        logger.info(
            "loaded %s (%s) in %.1f s on %s%s from %s, attention backend %s, %d dense kernels on %s",
            self.model_config.architecture, self.dtype.name, time.perf_counter() - start,
            self.device.device_kind, self._split_described(),
            self.loaded.source, self.backend, self.loaded.packed_kernels, self.dense_isa or "XLA",
        )  # fmt: skip
        return self.model_config

    def _split_described(self) -> str:
        """How the model is split over the mesh, for the load's log line ("" on one device)."""
        replicas = self.placement.replicas
        if replicas is not None:
            inside = "" if self.mesh is None else f", each x{self.tp_size} tensor parallel"
            return (
                f" (experts by index over {num_replicas(replicas)} data-parallel replicas{inside}, "
                f"{replicas.size} devices, one program)"
            )
        if self.mesh is None:
            return ""
        experts = ", experts by index" if self.config.expert_parallel and self.loaded.has_experts else ""
        return f" x{self.tp_size} (tensor parallel{experts})"

    @property
    def kv_heads(self) -> int:
        """KV heads of the whole cache: the model's, repeated up to the TP size when fewer; 1 for
        a latent cache (one shared row a token, whole on every device)."""
        mc = self.model_config
        if mc.latent_cache_width:
            return 1
        return kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, self.tp_size)

    @property
    def kv_heads_per_device(self) -> int:
        return 1 if self.model_config.latent_cache_width else self.kv_heads // self.tp_size

    def kv_page_bytes(self) -> int:
        """Bytes one page of one layer takes on one device (`kv_cache.page_bytes_per_device`)."""
        return page_bytes_per_device(
            self.model_config, self.config.page_size, self.kv_heads_per_device, self.kv_dtype, self.backend
        )

    def available_kv_bytes(
        self, memory_utilization: float, cpu_kv_cache_gb: float, explicit_bytes: int | None = None
    ) -> int:
        """Bytes the KV cache may take on this runner's device (`kv_cache.available_kv_bytes`);
        data-parallel replicas in one program take the fewest any of them may (one global cache)."""
        budget = {"memory_utilization": memory_utilization, "cpu_kv_cache_gb": cpu_kv_cache_gb}
        own = available_kv_bytes(self.device, explicit_bytes=explicit_bytes, **budget)
        return own if self.placement.replicas is None else fewest(own)

    @collector_paused()
    def initialize_kv_cache(self, num_pages: int, layout: KVLayout | None = None) -> None:
        """Allocates the caches of `num_pages` pages, shared between the layers as `layout` says
        (default: one cache per layer; a hybrid's groups), and makes the request table and the
        step program over them (`runner_state.build_step_state`), and a draft model's cache."""
        self.steps, self.kv_caches = build_step_state(
            self.loaded, self.config, self.placement, num_pages, layout, buckets=self.buckets,
            kv_heads=self.kv_heads, dtype=self.dtype, kv_dtype=self.kv_dtype, backend=self.backend,
        )  # fmt: skip
        if self.speculation is not None:  # a draft model's cache: as many pages, the same tables
            facts = dict(page_size=self.config.page_size, kv_dtype=self.kv_dtype, backend=self.backend,
                         device=self.device, num_groups=self.num_groups)  # fmt: skip
            self.speculation.initialize(num_pages, facts, self.buckets.shapes(), self._no_feed)

    @collector_paused()
    def warm_up(self, shapes: list[tuple[int, int, int]] | None = None) -> int:
        """Builds the forward for `shapes` (padded T, R, P; default: every bucket) and the sampler.

        Programs come from the executable cache when they are there, else they are compiled;
        both run on a thread per core. Then the sampler programs and the forward programs of
        small steps (decode batches, short prompts: the latency-bound ones) run, the forwards on
        inputs that attend and write only the first pages (no request holds pages yet), because
        on XLA:CPU an executable's first run sets up every YNNPACK fusion it reaches (which would
        otherwise land on the first short request); larger prefill programs pay that on first use.
        Returns the number of programs built.
        """
        start = time.perf_counter()
        specs = warm_up_specs(self, shapes or self.buckets.shapes())
        loaded = self.programs.loaded
        built = self.programs.build_all(specs)
        run_once(self, specs)
        if self.placement.replicas is not None:  # the steps' agreement, made before serving
            self._agree(0)
        logger.info(
            "warm-up built %d programs in %.1f s (%d from the executable cache)",
            built, time.perf_counter() - start, self.programs.loaded - loaded,
        )  # fmt: skip
        self.programs.seal()
        return built

    def _forward_spec(self, packed: np.ndarray | jax.Array, dims: tuple[int, int, int, int]) -> ProgramSpec:
        fed = self._no_feed
        if self.placement.replicas is not None:  # every replica's rows (`replica_step`)
            fed = side_by_side(fed, self.placement.replicas)
        return ProgramSpec(
            key=("forward", *dims),
            jitted=self.step_program.forward,
            args=(self._state_leaves, self.kv_caches, packed, fed),
            static={"dims": dims},
            context=self.step_program.context,
        )

    def _sampler_spec(self, logits, tensors, flags) -> ProgramSpec:
        return ProgramSpec(
            key=("sample", logits.shape[0], flags),
            jitted=self._sample,
            args=(logits, tensors),
            static={"flags": flags},
            context=f"tokens padded to {self.buckets.max_seqs}",  # `make_sampler`'s feed width
        )

    def _run_forward(
        self, packed: np.ndarray, dims: tuple[int, int, int, int], fed_tokens: jax.Array
    ) -> tuple[jax.Array, ...]:
        """Dispatches the forward on packed inputs (one transfer) and the previous step's tokens,
        keeping the donated caches' successors; returns its other outputs (logits, greedy tokens,
        hidden states, and an EAGLE-3 head's hidden states). After its first run a program is
        called on its flat arguments (`FlatCall`)."""
        if self.placement.replicas is not None:
            return self._run_replicas_forward(packed, dims, fed_tokens)
        key = ("forward", *dims)
        flat = self._flat_forwards.get(key)  # None too when the program needs JAX's own call
        if flat is not None:
            leaves = self._state_leaves
            packed = self._input_views.put(flat, len(leaves) + len(self.kv_caches), packed)
            outputs = flat([*leaves, *self.kv_caches, packed, fed_tokens])
            end = 3 + len(self.kv_caches)
            self.kv_caches = outputs[3:end]
            return (*outputs[:3], *outputs[end:])
        logits, greedy, hidden, self.kv_caches, *aux = self.programs.call(
            key,
            lambda: self._forward_spec(packed, dims),
            self._state_leaves,
            self.kv_caches,
            packed,
            fed_tokens,
        )
        aux = jax.tree.leaves(aux)  # as the flat call returns them: a verify shape's pair is two
        if key not in self._flat_forwards:  # decided once per program
            # A hybrid's step read back from the executable cache crashes under the flat call:
            # JAX's own call runs its state pools (`tpu_platform.state_cache`).
            program = None if self.step_program.layout.state_layers else self.programs.get(key)
            num_args = len(self._state_leaves) + len(self.kv_caches) + 2
            self._flat_forwards[key] = program and FlatCall.of(program, num_args)
        return logits, greedy, hidden, *aux

    def _run_replicas_forward(
        self, packed: np.ndarray, dims: tuple[int, int, int, int], fed_tokens: jax.Array
    ) -> tuple[jax.Array, ...]:
        """`_run_forward` as one of the data-parallel replicas of one program
        (`tpu_platform.replica_step`): this replica's inputs and fed tokens as its rows of the
        replicas', its own rows of the outputs back, on its devices."""
        replicas = self.placement.replicas
        packed = jax.make_array_from_process_local_data(self.step_program.inputs_sharding, packed)
        fed_tokens = side_by_side(fed_tokens, replicas)
        logits, greedy, hidden, self.kv_caches, *aux = self.programs.call(
            ("forward", *dims), lambda: self._forward_spec(packed, dims), self._state_leaves, self.kv_caches,
            packed, fed_tokens,
        )  # fmt: skip
        outputs = (logits, greedy, hidden, *jax.tree.leaves(aux))
        return tuple(own_part(out, self.mesh) for out in outputs)

    def dummy_step(self) -> None:
        """vLLM's step for an idle data-parallel replica (its dummy batch): with the replicas in one
        program, it takes its part in the step's shape and, when another replica has tokens, runs
        the step on padding alone (which writes no cache slot). Else nothing."""
        if self.placement.replicas is None:
            return
        tokens = self._agree(0)
        if tokens:
            shape = self.buckets.shape_for(tokens, 1)
            self._run_forward(*pack_inputs(padding_inputs(*shape, self.num_groups)), self._no_feed)

    def _agree(self, tokens: int) -> int:
        """The most tokens any data-parallel replica's step has (`agreement`)."""
        if self._agreement is not None:
            return self._agreement(tokens)
        jax.block_until_ready(self.kv_caches)  # no step of ours in flight beside the gather
        return agreed_tokens(tokens)

    # -- one engine step ------------------------------------------------------------------------

    def execute(self, update: StepUpdate) -> None:
        """Applies the update and dispatches the forward pass (without waiting for it).

        Everything the step needs on the host, the sampler's inputs included, is built before the
        dispatch: once dispatched, the forward runs on every core and host work competes with it.
        A token the previous step is still sampling (async scheduling) goes from that step's
        output to this step's input on the device; the previous step is finished first only when
        this one reads token history on the host (penalties, bad words, min_tokens, logit bias).
        """
        if self._pending is not None:  # never sampled: sample it anyway, the table reserved its tokens
            self.sample_async()
        start = time.perf_counter()
        if len(self._in_flight) > 1:  # only the newest step's tokens may stay on the device
            self._finish_through(self._in_flight[-2])
        self._apply(update)
        if not update.num_scheduled_tokens:
            return
        # The phase records' fields, read once a step (each `RecordField` read is a Python call).
        table, loaded = self.table, self.loaded
        req_ids = list(update.num_scheduled_tokens)
        rows = np.fromiter(map(table.row_of.__getitem__, req_ids), np.int32, len(req_ids))
        num_scheduled = np.fromiter(update.num_scheduled_tokens.values(), np.int32, len(req_ids))
        # Replicas in one program: every replica's step padded to the largest one's bucket.
        least = 0 if self.placement.replicas is None else self._agree(sum(num_scheduled.tolist()))
        if loaded.lora is not None:  # the step's adapters into device slots, each row's slot
            table.lora_slot[rows] = loaded.lora.slots_for(table.lora_id[rows])
        if self._in_flight:
            padded_rows = self.buckets.shape_for(max(sum(num_scheduled.tolist()), least), rows.size)[1]
            if loaded.sampling.reads_history(rows, padded_rows):  # `prepare` then reuses its answer
                self._finish_through(self._in_flight[-1])
        drafts = loaded.speculation and loaded.speculation.write_drafts(table, rows, num_scheduled, update)
        page_size, drafted = self.config.page_size, None if drafts is None else drafts.num_drafts
        plan = prepare_step(
            table, rows, num_scheduled, self.buckets, page_size, self._buffers, drafted, min_tokens=least
        )
        step_seed = self.config.seed * 1_000_003 + self._step_index
        tensors, flags = loaded.sampling.prepare(rows, plan.shape[1], table, step_seed)
        positions = None  # a verify shape's drafted step: its options' tensors per position, if any
        verify_shapes = self.steps.program.verify_shapes
        if drafts is not None and verify_shapes is not None and plan.shape[:2] in verify_shapes:
            positions = loaded.speculation.position_tensors(
                loaded.sampling, table, rows, drafts, plan.shape[1], flags, step_seed, self._extra_widths
            )
        tensors, flags = self._widened(tensors, flags)
        table.reserve(plan.appends)
        self._step_index += 1
        self.stats.steps += 1
        self.stats.partial_prefill_steps += int(not plan.all_emit)
        fed = loaded.no_feed
        if self._in_flight:
            previous = self._in_flight[-1].out.sampled_token_ids
            self.stats.overlapped_steps += not previous.is_ready()
            if plan.fed:
                fed = previous
                self.stats.fed_steps += 1
        dispatch_start = time.perf_counter()
        logits, greedy, hidden, *aux = self._run_forward(plan.packed, plan.dims, fed)
        program = self.steps.program
        load = aux.pop() if program.counts_expert_load else None
        verify_rows = None  # a verify shape's every row: logits and greedy tokens (`step.forward_logits`)
        if program.verify_shapes is not None and plan.shape[:2] in program.verify_shapes:
            verify_rows, aux = tuple(aux[:2]), aux[2:]
        if load is not None:  # read when the step's tokens are (`_finish_through`), copied by then
            load.copy_to_host_async()
        if loaded.speculation is not None:
            loaded.speculation.after_forward(plan, fed, hidden, aux)
        dispatched_at = time.perf_counter()
        self.stats.host_seconds += dispatched_at - start
        self.stats.dispatch_seconds += dispatched_at - dispatch_start
        prompt = None
        if loaded.prompt_logprobs.wanted_in(req_ids):
            compute = functools.partial(
                loaded.prompt_logprobs_program.run, self.programs, self._whole_state()
            )
            prompt = loaded.prompt_logprobs.collect(
                compute, hidden, table, req_ids, rows, plan.inputs().cu_q_lens
            )
        self._pending = DispatchedStep(
            plan, req_ids, logits, greedy, prompt, tensors, flags, dispatched_at,
            hidden=hidden, drafts=drafts, expert_load=load, verify_rows=verify_rows, positions=positions,
        )  # fmt: skip

    def pool(self) -> tuple[list[str], list[np.ndarray | None]]:
        """A pooling runner's step output: the pending step's request ids and, for each, its
        pooled row (`tpu_platform.pooling`) where the step reached the end of its prompt, else
        None. The step's argmax tokens are recorded as a sampled step's (no sampler runs)."""
        pending = self._pending
        if pending is None:
            return [], []
        options = self.pooling_requests.options(pending.req_ids)
        pooled = self._pooling.pool(self.programs, self._state_leaves, pending.hidden, pending.plan, options)
        self.finish(self.sample_async())  # before the step's input buffer is read again
        return pending.req_ids, pooled_outputs(np.asarray(pooled), pending.plan.emits_token, options)

    def sample(
        self,
        grammar_bitmasks: dict[str, np.ndarray] | None = None,
        logits_transform: Callable[[jax.Array, np.ndarray, bool], jax.Array] | None = None,
    ) -> StepResult:
        """Samples the pending step's logits and records the new tokens (`sample_async`, `finish`)."""
        return self.finish(self.sample_async(grammar_bitmasks, logits_transform))

    def sample_async(
        self,
        grammar_bitmasks: dict[str, np.ndarray] | None = None,
        logits_transform: Callable[[jax.Array, np.ndarray, bool], jax.Array] | None = None,
    ) -> InFlightStep:
        """Dispatches the sampling of the pending step's logits; `finish` records its tokens.

        `grammar_bitmasks`: request id -> its packed grammar bitmask, one row, or with drafts
        `[1 + n, W]` rows (its known token's, then the grammar's state after each of its n drafts:
        vLLM's layout). `logits_transform(logits, table_rows, all_greedy)`, when given, rewrites
        the logits before sampling (the hook for host-side logits processors).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return InFlightStep(None, [], None, None, 0.0, StepResult(req_ids=[], sampled_token_ids=[]))
        plan = pending.plan
        start = time.perf_counter()
        tensors, flags = pending.tensors, pending.flags
        if grammar_bitmasks:  # each request's rows: its known token's, then one a draft
            masks = [grammar_bitmasks.get(r) for r in pending.req_ids]
            known = [m if m is None else np.atleast_2d(m)[0] for m in masks]
            tensors, flags = self._widened(*self.sampling.with_grammar(tensors, flags, known, len(masks)))
            if pending.positions is not None:
                width = pending.positions[0].temperature.shape[0] // plan.shape[1]
                pending.positions = self.speculation.with_position_grammars(pending.positions, masks, width)
        logits = pending.logits
        if logits_transform is not None:  # user code: not counted as our host time
            self.stats.host_seconds += time.perf_counter() - start
            logits = logits_transform(logits, plan.rows, flags.all_greedy)
            start = time.perf_counter()
        # A grammar outside the per-position tensors, or a logits processor: the sampler rejects drafts.
        other = logits_transform is not None or (bool(grammar_bitmasks) and pending.positions is None)
        verification = pending.drafts and self.speculation.try_verify(self._whole_state(), pending, other)
        if verification is not None:
            out = verification.output
        elif logits_transform is None and flags.argmax_only:
            out = SamplerOutput(sampled_token_ids=pending.greedy)  # the forward's argmax: no sampler run
        else:
            self.stats.sampler_steps += 1
            dispatch_start = time.perf_counter()
            out = self.programs.call(
                ("sample", plan.shape[1], flags),
                lambda: self._sampler_spec(logits, tensors, flags),
                logits,
                tensors,
            )
            self.stats.dispatch_seconds += time.perf_counter() - dispatch_start
        step = InFlightStep(plan, pending.req_ids, out, pending.prompt_logprobs, pending.dispatched_at)
        step.verification = verification
        step.expert_load = pending.expert_load
        self._in_flight.append(step)
        self.stats.host_seconds += time.perf_counter() - start
        return step

    def finish(self, step: InFlightStep) -> StepResult:
        """Waits for `step`'s tokens and records them (and those of every step before it)."""
        self._finish_through(step)
        return step.result

    def _finish_through(self, step: InFlightStep) -> None:
        while step.result is None:
            oldest = self._in_flight.popleft()
            _wait_for(oldest.out.sampled_token_ids)
            start = time.perf_counter()
            table, layout = self.table, self.steps.program.layout
            oldest.result = record_step(table, oldest)
            if oldest.plan is not None and layout.state_columns > 1:
                keep_accepted_states(table, oldest.plan, layout)
            if oldest.expert_load is not None:
                self._count_expert_load(np.asarray(oldest.expert_load))
            if oldest.plan is not None:  # its forward has finished reading the inputs
                self._buffers.give_back(oldest.plan.packed)
            done = time.perf_counter()
            self.stats.host_seconds += done - start
            self.stats.step_seconds += done - oldest.dispatched_at

    def _count_expert_load(self, step_load: np.ndarray) -> None:
        """Adds a finished step's `[L, E]` tokens per expert to the running totals."""
        if self.expert_load is None:
            self.expert_load = step_load.astype(np.int64)
        else:
            self.expert_load += step_load

    def _widened(self, tensors: SamplingTensors, flags: SamplerFlags) -> tuple[SamplingTensors, SamplerFlags]:
        """The sampler's inputs, with every extra on when any is (see `sampling.uniform`)."""
        if not has_extras(flags):
            return tensors, flags
        return with_all_extras(
            tensors,
            flags,
            self.model_config.vocab_size,
            logprobs_width=self._logprobs_width,
            **self._extra_widths,
        )

    def _whole_state(self) -> nnx.State:
        """The model's state as the forward sees it (LoRA slots rewrite its leaves); as one of
        data-parallel replicas in one program, its replica's part of each weight on its own
        devices (the programs beside the step run there: prompt logprobs need the head and the
        norms, placed as on its own tensor-parallel mesh)."""
        leaves = self._state_leaves
        if self.placement.replicas is not None:
            leaves = [own_part(leaf, self.mesh) for leaf in leaves]
        return jax.tree.unflatten(self._state_def, leaves)

    def _lora_handle(self, lora_id: int) -> int:
        if self.lora is None:
            raise ValueError(f"a request asks for LoRA adapter {lora_id}, but LoRA is not enabled")
        return self.lora.handle(lora_id)

    def _remove_request(self, req_id: str) -> int | None:
        row = self.table.remove(req_id)
        if row is not None and self.lora is not None:
            self.lora.release(self.table.lora_id[row])
            self.table.lora_id[row] = 0
        return row

    def _apply(self, update: StepUpdate) -> None:
        self.stats.preempted_requests += len(update.preempted_req_ids)
        if self.speculation is not None:
            self.speculation.apply(update)
        for req_id in update.finished_req_ids:
            row = self._remove_request(req_id)
            self.prompt_logprobs.remove(req_id)
            self.pooling_requests.remove(req_id)
            if row is not None:
                self.sampling.remove_request(row)
        for request in update.new_requests:
            self.stats.prefix_cache_hits += int(request.num_computed_tokens > 0)
            if request.req_id in self.table.row_of:  # added again: its old row ends first
                self._remove_request(request.req_id)
            row = self.table.add(request)
            if request.lora_id:
                self.table.lora_id[row] = self._lora_handle(request.lora_id)
                self.lora.acquire(self.table.lora_id[row])  # cached while the request lives
            self.sampling.add_request(row, request.sampling)
            if request.pooling is not None:
                self.pooling_requests.add(request.req_id, request.pooling)
            self.prompt_logprobs.add(request.req_id, request.sampling.prompt_logprobs)
        if update.cached.req_ids:
            self.stats.resumed_requests += len(update.cached.resumed_req_ids)
            self.table.update_many(update.cached)


def _wait_for(tokens: jax.Array) -> None:
    """Blocks until `tokens` are computed (an array's own wait: `jax.block_until_ready` first
    flattens its argument as a tree, in Python, at every step)."""
    if isinstance(tokens, jax.Array):
        tokens.block_until_ready()
    else:
        jax.block_until_ready(tokens)


# What a caller of `Runner` sees: its configuration and counters, and the step result types.
__all__ = ["InFlightStep", "Runner", "RunnerConfig", "RunnerStats", "StepLogprobs", "StepResult"]
