# SPDX-License-Identifier: Apache-2.0
"""Data-parallel replicas on a target's chips, and experts split over them: what one chip holds.

`--data-parallel-size D` with `--tensor-parallel-size N` serves D replicas on D x N chips, each
vLLM's own engine process driving N chips of its own (`plugin_shim/data_parallel.py`) and
compiling the runner's N-way program: the one the planner compiles at `tp_size=N` (at N=1 the
one-chip program, whichever chip: `tests/aot/test_data_parallel_program.py`). The replicas
exchange nothing, so a chip holds what one replica's chip holds, each replica has its own KV
cache, and the replicas together hold D times its tokens.

With the experts split over the replicas (vLLM's expert-parallel group of D x N chips, attention
data-parallel: each replica attends to its own requests on its own N chips), a chip holds its
replica's share of every other weight, as N-way tensor parallelism places it, and 1 / (D x N)
of the routed experts, whole: the program of `tpu_platform.replica_step`, which the planner
compiles (docs/architecture.md, "Expert parallelism across replicas").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from models.sharding import EXPERT_PARALLEL_RULE, MODEL_AXIS, key_path_name, parameter_spec
from tpu_platform.planner.abstract_weights import device_bytes
from tpu_platform.planner.kv import MEMORY_UTILIZATION
from tpu_platform.planner.plan import StepSetup, kv_page_bytes

_EXPERTS = re.compile(EXPERT_PARALLEL_RULE[0])


@dataclasses.dataclass(frozen=True, slots=True)
class ChipWeights:
    """The weight bytes one chip holds: the routed experts' and everything else's."""

    expert_bytes: int
    other_bytes: int  # attention, embedding and head, norms, routers, shared experts, RoPE tables

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.other_bytes


def chip_weights(setup: StepSetup, ep_size: int = 0) -> ChipWeights:
    """What one chip holds of `setup`'s model: every array split as the rules table places it on
    `setup.tp_size` chips (`models.sharding.parameter_spec`), or with `ep_size` the routed
    experts split by index over that many chips instead (0: as `setup` places them)."""
    model = setup.abstract_model()
    paths = [key_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(model.state)[0]]
    experts = other = 0
    for path, leaf in zip(paths, model.leaves, strict=True):
        routed = _EXPERTS.search(path) is not None
        if routed and ep_size:
            shard = (leaf.shape[0] // ep_size, *leaf.shape[1:])
        else:
            spec = parameter_spec(path, leaf.shape, setup.tp_size, expert_parallel=model.expert_parallel)
            axes = (*spec, *(None,) * (len(leaf.shape) - len(spec)))
            split = zip(leaf.shape, axes, strict=True)
            shard = tuple(d // setup.tp_size if a == MODEL_AXIS else d for d, a in split)
        if routed:
            experts += device_bytes(shard, leaf.dtype)
        else:
            other += device_bytes(shard, leaf.dtype)
    return ChipWeights(experts, other)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """`dp_size` replicas of `tp_size` chips each on one target: what one chip holds and the KV
    tokens a replica's cache takes (every byte per chip)."""

    dp_size: int
    tp_size: int
    experts_over_replicas: bool  # the routed experts split by index over all dp x tp chips
    weights: ChipWeights
    budget_bytes: int  # the chip's memory times the utilization
    step_bytes: int  # what the steps take beyond the weights and cache (a compiled program's)
    page_bytes: int  # one page of a replica's cache on one chip
    tokens_per_page: int
    kv_groups: int  # a token takes a page slot in each KV-cache group

    @property
    def chips(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def num_pages(self) -> int:
        return max(0, (self.budget_bytes - self.weights.total_bytes - self.step_bytes) // self.page_bytes)

    @property
    def kv_tokens(self) -> int:
        """Tokens one replica's cache holds."""
        return self.num_pages * self.tokens_per_page // self.kv_groups

    @property
    def total_kv_tokens(self) -> int:
        return self.dp_size * self.kv_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size, "tp_size": self.tp_size, "chips": self.chips,
            "experts_over_replicas": self.experts_over_replicas, "expert_bytes": self.weights.expert_bytes,
            "weight_bytes": self.weights.total_bytes, "budget_bytes": self.budget_bytes,
            "step_bytes": self.step_bytes, "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "kv_bytes": self.num_pages * self.page_bytes, "kv_tokens": self.kv_tokens,
            "total_kv_tokens": self.total_kv_tokens,
        }  # fmt: skip


def plan_replicas(
    setup: StepSetup,
    dp_size: int,
    step_bytes: int,
    *,
    experts_over_replicas: bool = False,
    memory_utilization: float = MEMORY_UTILIZATION,
) -> ReplicaPlan:
    """`dp_size` replicas of `setup` (one replica: its model on `setup.tp_size` chips) on
    `setup.target`, each chip keeping `step_bytes` for the steps beside the weights and cache;
    `experts_over_replicas`: the routed experts split by index over every replica's chips
    (vLLM's expert-parallel group under data parallelism, attention data-parallel)."""
    chips, tp = setup.compile_target.num_chips, setup.tp_size
    if dp_size < 1 or dp_size * tp > chips:
        raise ValueError(
            f"{dp_size} replicas of tp_size={tp} need {dp_size * tp} chips and target {setup.target!r} "
            f"has {chips}; use 1 to {chips // tp} replicas, a smaller tp_size or a larger target"
        )
    ep_size = dp_size * tp if experts_over_replicas else 0
    experts = setup.config.num_experts
    if ep_size and (not experts or experts % ep_size):
        raise ValueError(
            f"experts split over {dp_size} replicas x tp_size={tp}: this model's {experts} routed "
            f"experts do not divide by {ep_size}; use replicas x tp_size dividing {experts}"
        )
    return ReplicaPlan(
        dp_size, tp, experts_over_replicas, chip_weights(setup, ep_size),
        int(setup.compile_target.hbm_bytes * memory_utilization), step_bytes, kv_page_bytes(setup),
        setup.tokens_per_page, setup.kv_layout.num_groups,
    )  # fmt: skip
