# SPDX-License-Identifier: Apache-2.0
"""What a runner's start-up phases make: one frozen record a phase, each made in one function.

The constructor makes a `Placement` (`Placement.for_config`); `Runner.load_model` a `LoadedModel`
(the model placed on its device or mesh, its LoRA slots, speculation, and the programs and
per-request host state sized by it: `load_runner_model`); `Runner.initialize_kv_cache` a
`StepState` (the request table and the step program over the caches it allocates:
`build_step_state`). Until its phase has run a record is None, and the runner's attributes that
live in it (`RecordField`) raise `PhaseNotRun` naming the phase, so a runner is never half built.
The caches themselves stay on the runner: every step donates them and keeps their successors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig, PackedKernel, attach_rope_tables
from models.expert_load import has_experts
from models.layer_stacks import stack_layer_weights
from models.lora import attach_lora
from models.moe import use_expert_parallel
from models.serving_passes import use_native_norms
from models.sharding import parameter_sharding, place_state
from tpu_platform.buckets import StepBuckets
from tpu_platform.kv_cache import allocate_stacked_caches
from tpu_platform.lora_slots import LoraSlots
from tpu_platform.mesh import replicated, tensor_parallel_mesh
from tpu_platform.pooled_step import PoolingPrograms
from tpu_platform.programs import Programs
from tpu_platform.prompt_logprobs import PromptLogprobs, PromptLogprobsProgram
from tpu_platform.replica_step import replica_devices, replica_mesh, side_by_side
from tpu_platform.request_table import RequestTable
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.sampling import SamplingBatch
from tpu_platform.sampling.uniform import warm_logprobs_width
from tpu_platform.speculation.verifier import SpeculativeDecoding, load_proposer
from tpu_platform.state_cache import allocate_layer_caches, state_columns
from tpu_platform.step import make_sampler
from tpu_platform.step_program import KVLayout, StepProgram, build_step_program
from tpu_platform.weights.prepared import ShardingFor
from tpu_platform.weights.source import WeightSource, load_served_weights


class PhaseNotRun(RuntimeError):
    """A runner attribute was read before the start-up phase that makes it."""


# The phase that makes each record, in the order they run.
PHASES = {"placement": "Runner(config)", "loaded": "load_model()", "steps": "initialize_kv_cache(num_pages)"}


class RecordField:
    """A runner attribute that lives in one of its phase records (`record`'s `field`): reading it
    before that phase is a `PhaseNotRun` naming the phase; it is never assigned on its own."""

    def __init__(self, record: str, field: str):
        self.record, self.field = record, field

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = f"{owner.__name__}.{name}"

    def __get__(self, runner: Any, owner: type | None = None) -> Any:
        if runner is None:
            return self
        made = getattr(runner, self.record)
        if made is None:
            earlier = list(PHASES)[: list(PHASES).index(self.record)]
            before = "".join(f"{PHASES[r]}, then " for r in earlier if getattr(runner, r) is None)
            raise PhaseNotRun(
                f"{self.name} is made by {PHASES[self.record]}, which has not run on this runner: "
                f"call {before}{PHASES[self.record]} first"
            )
        return getattr(made, self.field)

    def __set__(self, runner: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is part of the runner's {self.record!r} record, made once by its phase"
        )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a runner's model goes: its device, its tensor-parallel mesh (None on one device),
    where a whole (replicated) array goes, and where each weight goes."""

    device: jax.Device
    mesh: jax.sharding.Mesh | None
    whole: jax.Device | jax.sharding.Sharding
    weight_shardings: ShardingFor
    # Data-parallel replicas in one step program (`tpu_platform.replica_step`): their mesh, this
    # process's replica's devices among them (`mesh`'s, or `device`); the step alone runs on it,
    # everything else on `mesh` or `device`. None: none.
    replicas: jax.sharding.Mesh | None = None

    @classmethod
    def for_config(cls, config: RunnerConfig) -> Placement:
        """This host's first device (with several hosts too) and, with tensor parallelism, the
        mesh over `config.tensor_parallel_size` of its devices; with `data_parallel_size`, the
        replicas' mesh over as many devices of each process of the job."""
        device = jax.local_devices()[0]
        if config.data_parallel_size > 1:  # the experts over the replicas: `models.sharding`
            tp = config.tensor_parallel_size
            mesh = tensor_parallel_mesh(tp, jax.local_devices())  # the replica's own devices
            replicas = replica_mesh(config.data_parallel_size, replica_devices(tp), tp)
            shardings = functools.partial(weight_sharding, replicas, expert_parallel=True)
            whole = device if mesh is None else replicated(mesh)
            return cls(device, mesh, whole, shardings, replicas)
        mesh = tensor_parallel_mesh(config.tensor_parallel_size)
        if mesh is None:
            return cls(device, None, device, jax.sharding.SingleDeviceSharding(device))
        # A function of a weight's path and abstract value (`weights.prepared.ShardingFor`):
        # restored checkpoints go straight to their shardings.
        shardings = functools.partial(weight_sharding, mesh, expert_parallel=config.expert_parallel)
        return cls(device, mesh, replicated(mesh), shardings)

    @property
    def whole_on_mesh(self) -> jax.sharding.Sharding | None:
        """Where a whole array goes on the mesh; None on one device (committed to no device)."""
        return None if self.mesh is None else self.whole


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """What `Runner.load_model` makes: the served model, placed, and what is sized by it."""

    config: ModelConfig
    source: WeightSource
    packed_kernels: int  # weights packed for the native dense kernel
    graphdef: nnx.GraphDef
    state: nnx.State  # placed on the device, or leaf by leaf on the mesh
    state_def: jax.tree_util.PyTreeDef  # the state's tree structure
    # The forward's state arguments, the state's leaves: LoRA slots rewrite them in place.
    state_leaves: list[jax.Array]
    lora: LoraSlots | None
    speculation: SpeculativeDecoding | None
    prompt_logprobs_program: PromptLogprobsProgram
    pooling: PoolingPrograms | None  # a pooling runner's programs
    sample: Callable  # the jitted sampler
    # What a step takes as its previous step's tokens when none is in flight.
    no_feed: jax.Array
    # Per-request host state, sized by the model's vocabulary.
    sampling: SamplingBatch
    prompt_logprobs: PromptLogprobs
    # Penalty window, sparse list and logprobs widths of the sampler's "extras" programs.
    extra_widths: dict[str, int]
    logprobs_width: int
    # A mixture of experts: the step counts the tokens routed to each expert (`models.expert_load`).
    has_experts: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class StepState:
    """What `Runner.initialize_kv_cache` makes: the request table and the step program."""

    program: StepProgram
    table: RequestTable

    @property
    def num_pages(self) -> int:
        return self.program.num_pages

    @property
    def num_groups(self) -> int:
        return self.program.layout.num_groups


def load_runner_model(
    config: RunnerConfig,
    placement: Placement,
    *,
    dtype: jnp.dtype,
    dense_isa: str | None,
    programs: Programs,
    buckets: StepBuckets,
    memo_dir: str | None,
) -> LoadedModel:
    """Loads `config`'s model (`weights.source`) onto `placement`, with its LoRA slots and
    speculation, and makes the programs and per-request state sized by it. `programs`: the
    runner's (a draft model's are built there too); `buckets`: the runner's step shapes."""
    mesh = placement.mesh
    model_config, model, source = load_served_weights(
        config, dtype, dense_isa, placement.weight_shardings, memo_dir
    )
    packed = len(jax.tree.leaves(nnx.state(model, PackedKernel)))
    replicas = placement.replicas
    if mesh is None and replicas is None:  # one array per kind of weight of a uniform decoder
        stack_layer_weights(model)
        use_native_norms(model)
    attach_rope_tables(model, config.max_model_len)
    if config.expert_parallel and (mesh is not None or replicas is not None):
        use_expert_parallel(model)  # the experts placed by index: `weight_sharding`
    lora, sites = config.lora, None
    if lora is not None:  # zeroed adapter slots: `models.lora`
        lora_dtype = jnp.dtype(lora.dtype or dtype)
        sites = attach_lora(
            model, max_loras=lora.max_loras, max_rank=lora.max_lora_rank, dtype=lora_dtype,
            blocks=config.tensor_parallel_size,
        )  # fmt: skip
    graphdef, state = nnx.split(model)
    if replicas is not None:  # every weight whole on each replica's device but the experts
        state = place_state(state, replicas, expert_parallel=True)
    elif mesh is None:
        state = jax.device_put(state, placement.device)
    else:  # leaf by leaf to its sharding (`models.sharding`)
        state = place_state(state, mesh, expert_parallel=config.expert_parallel)
    leaves, state_def = jax.tree.flatten(state)
    slots = None if sites is None else LoraSlots(lora, sites, state, leaves)
    whole = placement.whole_on_mesh
    prompt_program = PromptLogprobsProgram.for_model(graphdef, model_config, config, dtype, whole)
    draft = functools.partial(
        load_proposer, config=config, target=model_config, target_model=model, dtype=dtype,
        dense_isa=dense_isa, shardings=placement.weight_shardings, device=placement.device, mesh=mesh,
    )  # fmt: skip
    speculation = SpeculativeDecoding.for_runner(graphdef, model_config, config, whole, programs, draft)
    pooling = None
    if config.pooling is not None:
        pooling = PoolingPrograms(graphdef, state_def, config.pooling, model_config, dtype, whole)
    sampling = SamplingBatch(
        max_num_reqs=config.max_num_seqs,
        vocab_size=model_config.vocab_size,
        max_model_len=config.max_model_len,
        max_logprobs=config.max_logprobs,
        logprobs_mode=config.logprobs_mode,
    )
    return LoadedModel(
        config=model_config,
        source=source,
        packed_kernels=packed,
        graphdef=graphdef,
        state=state,
        state_def=state_def,
        state_leaves=leaves,
        lora=slots,
        speculation=speculation,
        prompt_logprobs_program=prompt_program,
        pooling=pooling,
        sample=make_sampler(buckets.max_seqs, mesh),
        no_feed=jax.device_put(np.zeros(buckets.max_seqs, np.int32), placement.whole),
        sampling=sampling,
        prompt_logprobs=PromptLogprobs(model_config.vocab_size),
        extra_widths={
            "penalty_width": sampling.penalty_widths[-1],
            "sparse_width": sampling.sparse_widths[-1],
        },
        logprobs_width=warm_logprobs_width(config.max_logprobs, model_config.vocab_size),
        has_experts=has_experts(model),
    )


def build_step_state(
    loaded: LoadedModel,
    config: RunnerConfig,
    placement: Placement,
    num_pages: int,
    layout: KVLayout | None,
    *,
    buckets: StepBuckets,
    kv_heads: int,
    dtype: jnp.dtype,
    kv_dtype: jnp.dtype,
    backend: str,
) -> tuple[StepState, list[jax.Array]]:
    """Allocates the caches, stacked in one array (a few past int32's slot numbers:
    `allocate_stacked_caches`) as `layout` shares them between the layers (default: one group,
    one cache per layer; a hybrid's groups as vLLM makes them), and makes the request table and
    the step program over them. Returns those and the caches."""
    mc = loaded.config
    hybrid = KVLayout.for_model(mc) if mc.state_layers else None
    layout = layout or hybrid or KVLayout.from_groups([range(mc.num_layers)], mc.num_layers)
    if layout.state_layers:  # 1 + k state blocks a request under speculative decoding
        layout = dataclasses.replace(layout, state_columns=state_columns(config.speculation))
    shape = (num_pages, config.page_size, kv_heads, mc.head_dim)
    mesh = placement.mesh
    if layout.state_layers:  # a hybrid model: state pools beside KV pages, one cache a layer
        caches = allocate_layer_caches(mc, layout, *shape[:3], kv_dtype, dtype, backend, mesh)
    else:
        caches = allocate_stacked_caches(
            layout.num_caches, *shape, kv_dtype, backend, mesh, latent_width=mc.latent_cache_width
        )
    # Committed to the device like the step's outputs, so warm-up and serving share programs.
    caches = jax.device_put(caches, placement.device) if mesh is None else caches
    if placement.replicas is not None:  # this replica's rows of the replicas' caches
        if layout.state_layers:
            raise ValueError("a hybrid model's state pools are not served over data-parallel replicas")
        caches = [side_by_side(cache, placement.replicas) for cache in caches]
    table = RequestTable(config.max_num_seqs, config.max_model_len, buckets.max_pages, layout.num_groups)
    speculation = loaded.speculation
    program = build_step_program(
        mc, loaded.graphdef, loaded.state_def, loaded.state_leaves, caches,
        backend=backend, layout=layout, kv_dtype=kv_dtype.name, num_pages=num_pages,
        page_size=config.page_size, feed_width=buckets.max_seqs, device=placement.device,
        mesh=placement.replicas or mesh, aux_layers=speculation.aux_layers if speculation else (),
        count_expert_load=loaded.has_experts, verify_shapes=buckets.verify if speculation else None,
    )  # fmt: skip
    return StepState(program=program, table=table), caches


def weight_sharding(mesh: jax.sharding.Mesh, path: tuple[str, ...], abstract, *, expert_parallel=False):
    """A restored weight's sharding on the tensor-parallel `mesh` (`models.sharding` rules)."""
    return parameter_sharding(".".join(path), abstract.shape, mesh, expert_parallel=expert_parallel)
