# SPDX-License-Identifier: Apache-2.0
"""Sizing the KV cache from short programs: the step of a model's first few layers, each at its
full width, compiled for the target, its memory extrapolated to every layer.

The faults the compile-only checks look for (a copy of the whole cache, a collective the rules
table does not imply, a weight-sized temporary) are made per layer, so a program of two layers
shows them as one of forty does, in less memory and, on GPU, in less compile time. What grows
with the depth is known:

- the weights and the KV cache per layer are arithmetic on the abstract model of every layer
  (`abstract_weights.abstract_model`, `plan.kv_page_bytes`: no compile);
- what a step needs beyond them (temporaries, outputs not aliasing the donated caches, code, the
  step's inputs) is read from the compiled step at two depths and extrapolated linearly to the
  model's depth; a slope below zero (XLA reusing buffers across layers) counts as zero. A model
  with routed experts has its decode step compiled at a third depth as well, and the smallest
  slope between neighbouring depths taken (`extrapolate`): XLA may schedule the shallowest
  program's expert loop tighter than every deeper one's (Qwen3-30B-A3B at EP=8 on v6e-8 keeps
  one layer's gathered expert tiles live at 3 layers and more, not at 2), a step up once that
  the slope through two depths would repeat for every layer. Its compile is cheap beside a
  prefill's; a dense model's steps grow on a line, and their compile checks run in CI.

`fit_by_depth` compiles the sampler once and the prefill and decode steps at their depths
(`step_depths`) with the whole model's page count estimate, then sizes the cache as
`kv.fit_kv_cache` does from the extrapolated figures. With `one_prefill` the prefill step is
compiled at the shallower depth only and its bytes beyond the weights and cache are scaled by
`layers / depth`: an upper bound (what a step needs beyond them is a part that does not grow
with the depth, never negative, and one that grows linearly; the scaling counts the first part
`layers / depth` times), for a quicker check where the prefill compiles for minutes.
`kv.fit_kv_cache` (every layer compiled) remains the planner's answer and what `make test-full`
runs; `tests/aot/test_model_step.py` checks that the two agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models import ModelConfig
from tpu_platform.planner.compiled import ProgramFacts
from tpu_platform.planner.hybrid import cache_tokens
from tpu_platform.planner.kv import MEMORY_UTILIZATION
from tpu_platform.planner.plan import (
    SAMPLING_FLAGS,
    StepSetup,
    compile_forward,
    compile_sampler,
    first_layers,
    kv_page_bytes,
)

# The two depths compiled: small, and for models whose layers alternate (sliding and full
# attention, dense and sparse MLPs) each a whole number of the pattern.
DEPTHS = (2, 4)
# The steps a model with routed experts has compiled at a third depth, as far past the deeper one
# (`step_depths`).
THIRD_DEPTH_STEPS = ("decode",)


def step_depths(
    depths: tuple[int, ...], step: str, one_prefill: bool = False, routed_experts: bool = True
) -> tuple[int, ...]:
    """The depths `fit_by_depth` compiles `step` at: `depths`, a routed-experts model's decode
    step also one step further (`THIRD_DEPTH_STEPS`), the prefill the shallowest only with
    `one_prefill`."""
    if one_prefill and step == "prefill":
        return depths[:1]
    if routed_experts and step in THIRD_DEPTH_STEPS and len(depths) == 2:
        return (*depths, 2 * depths[1] - depths[0])
    return depths


def depths_for(config: ModelConfig) -> tuple[int, int]:
    """`DEPTHS`, past a leading run of dense layers before the first sparse one (DeepSeek-V3 has
    three): both short programs then hold sparse layers, so what the slope between them adds for
    each of the remaining layers is a sparse layer's, not a dense one's. A hybrid's (linear
    attention layers before each full-attention one): one and two whole runs of its pattern."""
    if config.state_layers:
        states = set(config.state_layers)
        period = next((i for i in range(config.num_layers) if i not in states), 0) + 1
        return period, 2 * period
    first_sparse = next((i for i in range(config.num_layers) if config.is_moe_layer(i)), 0)
    shift = max(0, first_sparse - 1)  # one dense layer: the shallower program holds it and a sparse one
    return DEPTHS[0] + shift, DEPTHS[1] + shift


@dataclasses.dataclass(frozen=True, slots=True)
class DepthFit:
    """The largest KV cache the extrapolated programs leave room for on one chip, or why none."""

    setup: StepSetup  # the whole model's
    depths: tuple[int, int]
    weight_bytes: int  # the whole model's, per chip
    budget_bytes: int
    page_bytes: int  # one page of every layer's cache, per chip
    steps_budget_bytes: int  # the budget less what the sampler needs beside the weights and cache
    overhead_bytes: dict[str, int]  # per step: its bytes beyond the weights and cache, extrapolated
    num_pages: int  # 0 when nothing fits
    short: dict[str, tuple[ProgramFacts, ...]]  # per step, the compiled programs at `step_depths`
    sampler: ProgramFacts | None
    reason: str = ""
    short_kv_bytes: tuple[int, ...] = ()  # the cache each short program holds, per `depths`
    compiled_depths: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # per step

    @property
    def fits(self) -> bool:
        return self.num_pages > 0

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        setup = self.setup
        return cache_tokens(setup.kv_layout, self.num_pages, setup.tokens_per_page, setup.max_num_seqs)

    def predicted_peak_bytes(self, step: str, num_pages: int | None = None) -> int:
        """The whole model's `step` program's peak bytes with `num_pages` pages (default: the
        fitted cache), extrapolated."""
        pages = self.num_pages if num_pages is None else num_pages
        return self.weight_bytes + pages * self.page_bytes + self.overhead_bytes[step]

    def as_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits, "reason": self.reason, "depths": list(self.depths),
            "weight_bytes": self.weight_bytes, "budget_bytes": self.budget_bytes,
            "steps_budget_bytes": self.steps_budget_bytes, "page_bytes": self.page_bytes,
            "num_pages": self.num_pages, "kv_bytes": self.kv_bytes, "kv_tokens": self.kv_tokens,
            "overhead_bytes": self.overhead_bytes,
            "predicted_peak_bytes": {step: self.predicted_peak_bytes(step) for step in self.overhead_bytes},
            "short": {step: [facts.as_dict() for facts in programs] for step, programs in self.short.items()},
            "sampler": None if self.sampler is None else self.sampler.as_dict(),
            "short_kv_bytes": list(self.short_kv_bytes),
            "step_depths": {step: list(depths) for step, depths in self.compiled_depths.items()},
        }  # fmt: skip


def at_depth(setup: StepSetup, num_layers: int) -> StepSetup:
    """`setup` with the model cut to its first `num_layers` layers."""
    return dataclasses.replace(setup, config=first_layers(setup.config, num_layers))


def fit_by_depth(
    setup: StepSetup,
    decode_tokens: int,
    prefill_tokens: int,
    depths: tuple[int, int] | None = None,
    memory_utilization: float = MEMORY_UTILIZATION,
    one_prefill: bool = False,
) -> DepthFit:
    """Sizes the whole model's KV cache from its steps compiled at two short `depths` (default:
    `depths_for` the model; see the module docstring). `one_prefill`: the prefill step at the
    shallower depth only, its growth bounded from above."""
    depths = depths or depths_for(setup.config)
    weights = setup.abstract_model().chip_weight_bytes(setup.mesh())
    budget = int(setup.compile_target.hbm_bytes * memory_utilization)
    page = kv_page_bytes(setup)
    if weights >= budget:
        reason = f"weights need {weights} B, {weights - budget} B over the {budget} B budget"
        return DepthFit(setup, depths, weights, budget, page, budget, {}, 0, {}, None, reason)
    sampler = compile_sampler(setup, setup.buckets.seqs_for(decode_tokens), SAMPLING_FLAGS)
    steps_budget = budget - (sampler.peak_bytes - sampler.argument_bytes)
    # Each short program's cache has as many pages a layer as the whole model's would without
    # its steps' own bytes: the real per-layer cache, so that what grows with it shows.
    probe_pages = max(1, (steps_budget - weights) // page)
    short, overhead, compiled = {}, {}, {}
    short_kv = tuple(probe_pages * kv_page_bytes(at_depth(setup, depth)) for depth in depths)
    for step, tokens in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        programs, beyond = [], []
        compiled[step] = step_depths(depths, step, one_prefill, setup.config.num_experts > 0)
        for depth in compiled[step]:
            cut = at_depth(setup, depth)
            facts = compile_forward(cut, probe_pages, tokens)
            cut_weights = cut.abstract_model().chip_weight_bytes(cut.mesh())
            programs.append(facts)
            beyond.append(facts.peak_bytes - cut_weights - probe_pages * kv_page_bytes(cut))
        short[step] = tuple(programs)
        overhead[step] = extrapolate(beyond, compiled[step], setup.config.num_layers)
    pages = max(0, (steps_budget - weights - max(overhead.values())) // page)
    reason = "" if pages else f"no KV cache fits beside the steps' {max(overhead.values())} B"
    return DepthFit(
        setup, depths, weights, budget, page, steps_budget, overhead, pages, short, sampler, reason, short_kv,
        compiled,
    )  # fmt: skip


def extrapolate(beyond: list[int], depths: tuple[int, ...], num_layers: int) -> int:
    """A step's bytes beyond the weights and cache for `num_layers` layers, from its bytes at
    `depths` (ascending): from one, scaled by `num_layers / depth`, an upper bound (the module
    docstring); from more, a line of the smallest slope between neighbouring depths (a negative
    one counts as zero) through the highest of them, so that a step up at one depth (XLA
    scheduling the shallowest program tighter than any deeper one, a one-off and not a per-layer
    growth) is neither repeated for every layer nor lost."""
    if len(depths) == 1:
        return -(-max(0, beyond[0]) * num_layers // depths[0])
    pairs = zip(zip(depths, beyond, strict=True), zip(depths[1:], beyond[1:], strict=True), strict=False)
    slope = max(0.0, min((b1 - b0) / (d1 - d0) for (d0, b0), (d1, b1) in pairs))
    return int(max(b + slope * (num_layers - d) for d, b in zip(depths, beyond, strict=True)))
