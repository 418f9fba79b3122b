# SPDX-License-Identifier: Apache-2.0
"""The runner's step programs compiled for a named target with abstract weights.

`StepSetup` names a model configuration, a compile target (`tpu_platform.planner.targets`), the dtypes
and the runner's limits. `step_program` builds the runner's step program (the one builder the
runner uses too, `tpu_platform.step_program`, with the attention backend the runner picks on that
device and caches from `kv_cache.allocate_stacked_caches`) from `ShapeDtypeStruct` weights and
caches, so nothing is allocated; `compile_forward` compiles it with the target's real
compiler; `compile_sampler` does the same for the sampling program. Both return
`ProgramFacts` (`tpu_platform.planner.compiled`): XLA's memory and cost analyses of the compiled
program, the compile time and the collectives of its optimized HLO. The abstract weights are
`tpu_platform.planner.abstract_weights`'s.
`kv.fit_kv_cache` sizes the KV cache from them.

With `StepSetup.quantization = "int8"` the weights are the runner's int8 ones
(`--quantization int8_per_channel_weight_only`: every dense kernel int8 with one float32 scale
per output channel, `models.quantization`), prepared as `tpu_platform.weights.preparation` does.

With `StepSetup.tp_size = N` the programs are the runner's tensor-parallel ones on its mesh of N
compile-only chips (`tpu_platform.mesh`): the weights placed by the rules table
(`models.sharding.state_shardings`), the caches split on their KV heads as
`allocate_stacked_caches` splits them, the step's inputs replicated; every byte is then per chip,
and `expected_collectives` says what the compiled step should exchange between the chips.

Compiling for a TPU or GPU target needs its toolchain importable (`make aot-toolchains`) and
`JAX_PLATFORMS=cpu`: see `tpu_platform.planner.targets`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from models import ModelConfig
from models.sharding import DATA_AXIS, MODEL_AXIS, check_expert_parallel, kv_heads_on_mesh, vocab_parallel
from pallas_kernels import kv_cache_partition_spec, latent_cache_partition_spec
from pallas_kernels.backend import resolve_backend
from tpu_platform.buckets import StepBuckets
from tpu_platform.hosts import per_host_devices
from tpu_platform.kv_cache import allocate_stacked_caches, kv_cache_dtype
from tpu_platform.lora_slots import LoraConfig
from tpu_platform.mesh import check_model_fits_mesh, replicated, tensor_parallel_mesh
from tpu_platform.planner.abstract_weights import (
    AbstractModel,
    abstract_leaf,
    abstract_model,
    device_bytes,
    placed_on,
)
from tpu_platform.planner.compiled import ProgramFacts, compile_with_text, measured
from tpu_platform.planner.hlo import ExpectedCollectives
from tpu_platform.planner.hybrid import abstract_hybrid_caches, hybrid_page_bytes
from tpu_platform.planner.targets import CompileTarget, compile_only_devices, target
from tpu_platform.replica_step import num_replicas, replica_mesh, replica_rows_spec
from tpu_platform.runner_config import default_page_size
from tpu_platform.sampling import SamplerFlags, dummy_tensors
from tpu_platform.state_cache import page_size_holding_a_state
from tpu_platform.step import make_sampler
from tpu_platform.step_program import KVLayout, StepProgram, build_step_program

# The sampler program the planner compiles: random sampling with top-k/top-p filters (the most
# work a step without penalties, logprobs or grammar does).
SAMPLING_FLAGS = SamplerFlags(filters=True)
# The weights' quantizations the planner knows: the runner's bfloat16/float weights, int8 with one
# scale per output channel, or int8 with one per 32 inputs (a GGUF's Q8_0 blocks, kept as they are);
# fp8 per output channel, or with one scale per 128 inputs (a block fp8 checkpoint's, as served).
# int4 per output channel or per 128 inputs: a 4-bit checkpoint's (compressed-tensors W4A16, GPTQ),
# as served on the target (two values a byte on TPU and GPU); int4z alike with an offset beside
# each scale (AWQ and asymmetric GPTQ per 128 inputs, a GGUF's Q4 blocks per 32).
QUANTIZATIONS = (
    "none", "int8", "int8-g32", "fp8", "fp8-g128", "int4", "int4-g128", "int4z-g32", "int4z-g128",
)  # fmt: skip


def known_models() -> list[str]:
    """Names of the real model configurations shipped in `tpu_platform/planner/model_configs/`."""
    folder = resources.files("tpu_platform.planner").joinpath("model_configs")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def model_config(name_or_path: str) -> ModelConfig:
    """The configuration of a known model name (`known_models`), an HF `config.json` file or a
    model directory holding one."""
    if name_or_path in known_models():
        shipped = resources.files("tpu_platform.planner").joinpath("model_configs", f"{name_or_path}.json")
        text = shipped.read_text()
        return ModelConfig.from_hf_dict(json.loads(text))
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(
            f"{name_or_path!r} is neither a known model ({', '.join(known_models())}) nor a "
            "config.json file or a directory holding one"
        )
    with open(path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def first_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    """`config` cut to its first `num_layers` layers, each as wide as in the whole model (0: all of
    them): the short programs `depth` compiles to extrapolate the whole model's memory."""
    if not num_layers or num_layers == config.num_layers:
        return config
    if not 0 < num_layers < config.num_layers:
        raise ValueError(f"cannot cut {config.num_layers} layers to {num_layers}")
    # Every per-layer field is cut to the kept layers (windows, Llama 4's RoPE flags, Gemma 4's
    # head dims); a list of layer indices keeps those below the cut.
    per_layer = {
        field.name: getattr(config, field.name)[:num_layers]
        for field in dataclasses.fields(config)
        if (field.name.startswith("layer_") or field.name == "rope_layers")
        and isinstance(getattr(config, field.name), tuple)
        and len(getattr(config, field.name)) == config.num_layers
    }
    return dataclasses.replace(
        config,
        num_layers=num_layers,
        mlp_only_layers=tuple(i for i in config.mlp_only_layers if i < num_layers),
        **per_layer,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StepSetup:
    """What the runner would be started with: model, target, dtypes, its limits, the tensor
    parallel size (`tp_size` chips of the target, one mesh axis as `tpu_platform.mesh` builds)
    and the weights' quantization ("int8": vLLM's `--quantization int8_per_channel_weight_only`)."""

    config: ModelConfig
    target: str  # a name of `tpu_platform.planner.targets.TARGETS`
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # None: the model's dtype
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    page_size: int = 0  # 0: the runner's default for the target's device kind and cache dtype
    tp_size: int = 1  # vLLM's tensor_parallel_size: chips of the target the model is split over
    quantization: str = "none"  # one of QUANTIZATIONS
    lora: LoraConfig | None = None  # vLLM's LoRA limits: the adapter slots the runner attaches
    attention_backend: str = "auto"  # as the runner's: "auto" picks by the target's device kind
    expert_parallel: bool = False  # vLLM's enable_expert_parallel: experts split by index
    speculative_tokens: int = 0  # vLLM's num_speculative_tokens: k drafts a request (0: none)
    # Data-parallel replicas of `tp_size` chips each in one step program
    # (`tpu_platform.replica_step`), the experts split by index over all their chips under
    # `expert_parallel`; 1: none.
    dp_size: int = 1

    def __post_init__(self) -> None:
        chips = target(self.target).num_chips  # an unknown name fails here, listing the known ones
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens={self.speculative_tokens}: use 0 (none) or k > 0 drafts")
        kv_cache_dtype(self.cache_dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not one the planner knows; use one of "
                f"{', '.join(QUANTIZATIONS)} (int8: the weights as --quantization "
                "int8_per_channel_weight_only serves them; int8-g32: a Q8_0 GGUF's, so served; fp8: "
                "--quantization fp8; fp8-g128: a 128x128 block fp8 checkpoint's; int4, int4-g128: a "
                "4-bit checkpoint's, per channel or per 128 inputs; int4z-g128, int4z-g32: one with "
                "zero points or group minimums, AWQ's or a GGUF's Q4 blocks)"
            )
        if not 1 <= self.tp_size <= chips:
            raise ValueError(
                f"tp_size={self.tp_size} does not fit target {self.target!r} of {chips} chip(s); "
                f"use a tp_size from 1 to {chips} or a larger target"
            )
        check_model_fits_mesh(self.config, self.tp_size, expert_parallel=self.expert_parallel)
        if self.dp_size > 1:
            self._check_replicas(chips)

    def _check_replicas(self, chips: int) -> None:
        if self.dp_size * self.tp_size > chips:
            raise ValueError(
                f"dp_size={self.dp_size} x tp_size={self.tp_size} does not fit target {self.target!r} "
                f"of {chips} chip(s); use at most {chips // self.tp_size} replicas or a larger target"
            )
        if self.expert_parallel and self.config.num_experts:
            ep_size = self.dp_size * self.tp_size
            check_expert_parallel(self.config.num_experts, ep_size, replicas=self.dp_size)

    @property
    def compile_target(self) -> CompileTarget:
        return target(self.target)

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def tokens_per_page(self) -> int:
        base = self.page_size or default_page_size(self.compile_target.platform, self.kv_dtype)
        if not self.config.state_layers:
            return base
        return page_size_holding_a_state(  # a hybrid's pages hold a state (`hybrid`)
            self.config, base, self.kv_heads_per_chip, kv_cache_dtype(self.cache_dtype),
            jnp.dtype(self.dtype), self.tp_size, power_of_two=self.backend == "pallas_gpu",
        )  # fmt: skip

    @property
    def buckets(self) -> StepBuckets:
        return StepBuckets.for_limits(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=self.tokens_per_page,
            spec_tokens=self.speculative_tokens,
        )

    @property
    def backend(self) -> str:
        """The attention backend the runner picks on the target's device kind."""
        return resolve_backend(self.attention_backend, platform=self.compile_target.platform)

    @property
    def kv_heads(self) -> int:
        """KV heads of the whole cache: the model's, repeated up to `tp_size` when fewer; 1 for a
        latent cache (multi-head latent attention: one shared row a token, whole on every chip)."""
        if self.config.latent_cache_width:
            return 1
        return kv_heads_on_mesh(self.config.num_heads, self.config.num_kv_heads, self.tp_size)

    @property
    def kv_heads_per_chip(self) -> int:
        return 1 if self.config.latent_cache_width else self.kv_heads // self.tp_size

    def mesh(self) -> Mesh | None:
        """The runner's mesh over the first `tp_size` compile-only chips (None at TP=1); on a
        multi-host target, as the joined hosts build it (`hosts.per_host_devices`: a compile-only
        pod topology's devices carry their hosts)."""
        if self.dp_size > 1:  # `tp_size` chips a replica (`tpu_platform.replica_step`)
            return replica_mesh(self.dp_size, compile_only_devices(self.target), self.tp_size)
        if self.tp_size == 1:  # one chip of a target of several hosts too (a data-parallel replica)
            return None
        devices = compile_only_devices(self.target)
        num_hosts = len({device.process_index for device in devices})
        if num_hosts > 1:
            return Mesh(np.array(per_host_devices(self.tp_size, num_hosts, devices)), (MODEL_AXIS,))
        return tensor_parallel_mesh(self.tp_size, devices)

    def abstract_mesh(self) -> AbstractMesh | None:
        """`mesh()`'s shape and axes without its chips (what places a chip's weights), None at
        one chip: no compiler needed."""
        if self.dp_size > 1:
            return AbstractMesh((self.dp_size, self.tp_size), (DATA_AXIS, MODEL_AXIS))
        return AbstractMesh((self.tp_size,), (MODEL_AXIS,)) if self.tp_size > 1 else None

    @property
    def kv_layout(self) -> KVLayout:
        """How the engine would share KV caches between the model's layers; a hybrid's requests
        hold 1 + k blocks in each state group under speculative decoding with k drafts (a state
        after each verified row, `tpu_platform.state_cache`), as the runner's layout says."""
        layout = KVLayout.for_model(self.config)
        if not layout.state_layers or not self.speculative_tokens:
            return layout
        return dataclasses.replace(layout, state_columns=1 + self.speculative_tokens)

    def abstract_model(self) -> AbstractModel:
        """The model as the runner would serve it with this setup, weights abstract."""
        return abstract_model(
            self.config, self.dtype, self.max_model_len, self.tp_size, self.quantization, self.lora,
            expert_parallel=self.expert_parallel, backend=target(self.target).platform, replicas=self.dp_size,
        )  # fmt: skip


def _everywhere(mesh: Mesh | None, device: jax.Device, tree: Any) -> Any:
    """`tree`'s leaves on `device`, or replicated on `mesh` (the runner's step inputs)."""
    if mesh is None:
        return placed_on(device, tree)
    whole = replicated(mesh)
    return jax.tree.map(lambda x: abstract_leaf(x, whole), tree)


def _abstract_caches(setup: StepSetup, num_pages: int, mesh: Mesh | None) -> list[jax.ShapeDtypeStruct]:
    """The runner's stacked caches (`allocate_stacked_caches`), abstract: on a mesh of all KV
    heads (`StepSetup.kv_heads`), split on them as the runner allocates them; over data-parallel
    replicas, a replica's caches side by side, each split over its chips as tensor parallelism
    splits them (`replica_step.side_by_side`)."""
    if num_replicas(mesh) > 1:
        rows = NamedSharding(mesh, replica_rows_spec(_cache_spec(setup)))
        return [
            jax.ShapeDtypeStruct(
                (setup.dp_size * cache.shape[0], *cache.shape[1:]), cache.dtype, sharding=rows
            )
            for cache in _abstract_caches(setup, num_pages, None)
        ]
    layout, config = setup.kv_layout, setup.config
    if config.state_layers:  # a hybrid: state pools beside KV pages, one cache a layer
        return abstract_hybrid_caches(
            config, num_pages, setup.tokens_per_page, setup.kv_heads, kv_cache_dtype(setup.cache_dtype),
            jnp.dtype(setup.dtype), setup.backend, mesh,
        )  # fmt: skip
    caches = jax.eval_shape(
        lambda: allocate_stacked_caches(
            layout.num_caches, num_pages, setup.tokens_per_page, setup.kv_heads, config.head_dim,
            kv_cache_dtype(setup.cache_dtype), setup.backend, mesh, latent_width=config.latent_cache_width,
        )
    )  # fmt: skip
    if mesh is None:
        return caches
    # `eval_shape` gives the shapes; the shardings are the ones `allocate_stacked_caches` makes.
    split = NamedSharding(mesh, _cache_spec(setup))
    return [abstract_leaf(cache, split) for cache in caches]


def _cache_spec(setup: StepSetup) -> PartitionSpec:
    """How tensor parallelism splits a cache: on its KV heads, a latent one not at all."""
    if setup.config.latent_cache_width:
        return latent_cache_partition_spec()
    return kv_cache_partition_spec(setup.backend, MODEL_AXIS)


def kv_page_bytes(setup: StepSetup) -> int:
    """Bytes one page of every cache array takes on one chip (all caches of the model, the
    backend's layout; on a mesh the chip's share of the KV heads); a hybrid's, a request's
    states beside them (`hybrid.HybridPageBytes`)."""
    layout, config = setup.kv_layout, setup.config
    if config.state_layers:
        return hybrid_page_bytes(
            config, setup.tokens_per_page, setup.kv_heads_per_chip, kv_cache_dtype(setup.cache_dtype),
            jnp.dtype(setup.dtype), setup.backend, setup.tp_size,
        ).page_bytes  # fmt: skip
    caches = jax.eval_shape(
        lambda: allocate_stacked_caches(
            layout.num_caches, 2, setup.tokens_per_page, setup.kv_heads_per_chip, config.head_dim,
            kv_cache_dtype(setup.cache_dtype), setup.backend, latent_width=config.latent_cache_width,
        )
    )  # fmt: skip
    return sum(device_bytes(c.shape, c.dtype) for c in caches) // 2


def step_program(
    setup: StepSetup, num_pages: int, device: jax.Device | None = None, aux_layers: tuple[int, ...] = ()
) -> StepProgram:
    """The runner's step program (`step_program.build_step_program`, as `Runner.initialize_kv_cache`
    builds it) over abstract weights and a KV cache of `num_pages` pages (per chip), on one chip
    of `setup.target` or on the runner's mesh of `setup.tp_size` chips. `device`: a local device
    to build it for instead, at TP=1 (to set it beside a runner's own program); `aux_layers`: the
    layers an EAGLE-3 head reads (speculative method 'eagle3')."""
    if device is not None and setup.tp_size > 1:
        raise ValueError("a step program for a local device is a one-device one: use tp_size=1")
    mesh = None if device is not None else setup.mesh()
    device = device or compile_only_devices(setup.target)[0]
    model = setup.abstract_model()
    caches = _abstract_caches(setup, num_pages, mesh)
    if mesh is None:
        caches = placed_on(device, caches)
    return build_step_program(
        setup.config, model.graphdef, model.state_def, model.placed(mesh, device), caches,
        backend=setup.backend, layout=setup.kv_layout, kv_dtype=kv_cache_dtype(setup.cache_dtype).name,
        num_pages=num_pages, page_size=setup.tokens_per_page, feed_width=setup.buckets.max_seqs,
        device=device, mesh=mesh, aux_layers=aux_layers, count_expert_load=model.has_experts,
        verify_shapes=setup.buckets.verify if setup.speculative_tokens else None,
    )  # fmt: skip


def step_shape(setup: StepSetup, num_tokens: int, num_seqs: int = 0) -> tuple[int, int, int]:
    """The runner's padded (T, R, P) for a step of `num_tokens` tokens over `num_seqs` sequences
    (0: as many as the bucket allows, one token each for a decode step)."""
    buckets = setup.buckets
    return buckets.shape_for(num_tokens, num_seqs or buckets.seqs_for(num_tokens))


def compile_forward(setup: StepSetup, num_pages: int, num_tokens: int, num_seqs: int = 0) -> ProgramFacts:
    """Compiles the runner's step program (`step_program`) for a step of `num_tokens` tokens over
    `num_seqs` sequences (`step_shape`) with the target's compiler: its memory, cost and HLO facts."""
    program = step_program(setup, num_pages)
    return _compile(program, step_shape(setup, num_tokens, num_seqs))


def expected_collectives(setup: StepSetup, num_tokens: int, num_seqs: int = 0) -> ExpectedCollectives:
    """What the rules table (`models.sharding`) implies the step of `compile_forward(setup, _,
    num_tokens, num_seqs)` exchanges on its mesh: per layer two all-reduces of the `[tokens,
    hidden]` activations (the row-parallel o and down projections; a mixture of experts' down
    projection is split alike), one more for the vocab-parallel embedding, the `[rows, vocab]`
    logits gathered once, and no weight gathered whole."""
    config = setup.config
    t_pad, r_pad, _ = step_shape(setup, num_tokens, num_seqs)
    mesh = setup.mesh()
    if mesh is None:  # one chip: nothing to exchange
        return ExpectedCollectives(t_pad * config.hidden_size, 0, 0, 0)
    split_vocab = vocab_parallel(config.vocab_size, setup.tp_size)
    model = setup.abstract_model()
    split = [leaf for leaf in model.placed(mesh, None) if leaf.sharding.spec]
    # DeepSeek's and Qwen3-Next's MoE: the shared experts' row-parallel down projection is summed
    # beside the routed ones'.
    shared = getattr(config, "n_shared_experts", 0) or getattr(config, "shared_expert_intermediate_size", 0)
    shared_sums = sum(map(config.is_moe_layer, range(config.num_layers))) if shared else 0
    return ExpectedCollectives(
        activation_elements=t_pad * config.hidden_size,
        all_reduces=2 * config.num_layers + shared_sums + split_vocab,
        logits_elements=r_pad * config.vocab_size if split_vocab else 0,
        weight_floor_bytes=min((device_bytes(leaf.shape, leaf.dtype) for leaf in split), default=0),
    )


def compile_sampler(setup: StepSetup, rows: int, flags: SamplerFlags = SAMPLING_FLAGS) -> ProgramFacts:
    """Compiles the runner's sampler for `rows` padded rows of logits with `flags` on one chip
    (on a mesh: replicated, as the runner's, the logits arriving gathered)."""
    devices = compile_only_devices(setup.target)
    device, mesh = devices[0], setup.mesh()
    if num_replicas(mesh) > 1:  # each replica samples its own rows on its own chips
        mesh = tensor_parallel_mesh(setup.tp_size, devices)
    vocab = setup.config.vocab_size
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
    args = _everywhere(mesh, device, (logits, dummy_tensors(flags, rows, vocab)))
    return measured(
        lambda: compile_with_text(make_sampler(setup.max_num_seqs, mesh), device, *args, flags=flags)
    )


def _compile(program: StepProgram, shape: tuple[int, int, int]) -> ProgramFacts:
    return measured(lambda: program.compile(shape))
