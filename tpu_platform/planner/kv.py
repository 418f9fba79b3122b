# SPDX-License-Identifier: Apache-2.0
"""Sizing the KV cache from compiled programs, and the decode step's memory-bandwidth roofline.

`fit_kv_cache` compiles the runner's prefill and decode programs (`tpu_platform.planner.plan`) for one
chip of a target (or its tensor-parallel mesh: then every byte is per chip): once with a small
cache to learn what the weights, inputs and temporaries take, then with the cache sized to what
is left of the chip's memory budget, and again (from the two compiles' slope) if the
temporaries grew with the cache. `decode_roofline` is the time a
decode step needs at the chip's peak bandwidth just to read the weights and the batch's KV once.
All of it is compiler estimates and arithmetic, not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp

from tpu_platform.planner.compiled import ProgramFacts, ProgramTooLarge
from tpu_platform.planner.hybrid import cache_tokens
from tpu_platform.planner.plan import (
    SAMPLING_FLAGS,
    StepSetup,
    compile_forward,
    compile_sampler,
    kv_page_bytes,
)
from tpu_platform.state_cache import state_slot_bytes

# Share of the chip's memory the planner lets the program use (vLLM's gpu_memory_utilization).
MEMORY_UTILIZATION = 0.9
# The probe compile's cache: this share of what the weights leave (the compile cost does not
# depend on it; the share is small so a temporary that grows with the cache barely shows).
PROBE_SHARE = 1 / 16
# Sizes tried before giving up (a temporary that grows with the cache needs a second one).
MAX_SIZING_ROUNDS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class KVFit:
    """The largest KV cache the compiled programs leave room for on one chip, or why none."""

    setup: StepSetup
    weight_bytes: int
    budget_bytes: int  # the chip's memory times the utilization
    page_bytes: int  # one page of every cache array
    num_pages: int  # 0 when nothing fits
    decode: ProgramFacts | None
    prefill: ProgramFacts | None
    sampler: ProgramFacts | None
    compiles: int
    reason: str = ""  # why nothing fits

    @property
    def fits(self) -> bool:
        return self.num_pages > 0

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens the cache holds for one sequence's worth of layers (with several KV-cache groups
        a token takes a page slot in each), once `max_num_seqs` requests of a hybrid hold their
        states (`hybrid.cache_tokens`)."""
        setup = self.setup
        return cache_tokens(setup.kv_layout, self.num_pages, setup.tokens_per_page, setup.max_num_seqs)

    @property
    def peak_bytes(self) -> int:
        return max(p.peak_bytes for p in (self.decode, self.prefill) if p is not None)

    def as_dict(self) -> dict[str, Any]:
        facts = {k: getattr(self, k) for k in ("decode", "prefill", "sampler")}
        return {
            "fits": self.fits, "reason": self.reason, "weight_bytes": self.weight_bytes,
            "budget_bytes": self.budget_bytes, "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "kv_bytes": self.kv_bytes, "kv_tokens": self.kv_tokens, "compiles": self.compiles,
            **{k: None if v is None else v.as_dict() for k, v in facts.items()},
        }  # fmt: skip


def fit_kv_cache(
    setup: StepSetup, decode_tokens: int, prefill_tokens: int, memory_utilization: float = MEMORY_UTILIZATION
) -> KVFit:
    """Sizes the KV cache so that both steps (and the sampler beside the resident weights and
    cache) fit `memory_utilization` of one chip's memory; see the module docstring."""
    weights = setup.abstract_model().chip_weight_bytes(setup.mesh())
    budget = int(setup.compile_target.hbm_bytes * memory_utilization)
    page = kv_page_bytes(setup)
    fit = functools.partial(KVFit, setup, weights, budget, page)
    if weights >= budget:
        over = f"weights need {weights} B, {weights - budget} B over the {budget} B budget"
        return fit(0, None, None, None, 0, over)
    sampler = compile_sampler(setup, setup.buckets.seqs_for(decode_tokens), SAMPLING_FLAGS)
    # The sampler runs beside the resident weights and cache: its own bytes come on top.
    budget_steps = budget - (sampler.peak_bytes - sampler.argument_bytes)
    probe_pages = max(1, int((budget_steps - weights) * PROBE_SHARE) // page)
    probe, probe_peak = _compile_peak(setup, probe_pages, prefill_tokens)
    compiles = 2
    if probe is None:
        too_large = f"the prefill step needs {probe_peak} B with {probe_pages} pages"
        return fit(0, None, None, sampler, compiles, too_large)
    pages = (budget_steps - (probe_peak - probe_pages * page)) // page
    for _ in range(MAX_SIZING_ROUNDS):
        if pages <= 0:
            break
        prefill, peak = _compile_peak(setup, pages, prefill_tokens)
        decode = None
        compiles += 1
        if prefill is not None and peak <= budget_steps:
            decode, decode_peak = _compile_peak(setup, pages, decode_tokens)
            compiles += 1
            peak = max(peak, decode_peak)
            if decode is not None and peak <= budget_steps:
                return fit(pages, decode, prefill, sampler, compiles)
        # The programs grow faster than the cache (temporaries that scale with it): shrink by the
        # bytes over budget at the growth the prefill step showed since the probe.
        growth = (peak - probe_peak) / (pages - probe_pages) if pages > probe_pages else page
        pages -= math.ceil((peak - budget_steps) / max(growth, page))
    return fit(0, None, probe, sampler, compiles, f"no KV cache size found whose steps fit {budget_steps} B")


def _compile_peak(setup: StepSetup, num_pages: int, num_tokens: int) -> tuple[ProgramFacts | None, int]:
    """The compiled forward and its peak bytes, or None and the bytes the compiler said it needs
    when it refused the program for the chip's memory."""
    try:
        facts = compile_forward(setup, num_pages, num_tokens)
    except ProgramTooLarge as error:
        return None, error.needed_bytes
    return facts, facts.peak_bytes


def kv_bytes_read(setup: StepSetup, batch: int, context: int) -> int:
    """KV bytes a decode step of `batch` sequences of `context` tokens reads on one chip (every
    layer reads its keys and values once, a sliding-window layer only its window; on a mesh each
    chip its own KV heads); a hybrid's state layers read and write each request's state once."""
    config, itemsize = setup.config, _itemsize(setup.cache_dtype)
    if config.latent_cache_width:  # one shared latent row a token, whole on every chip
        per_layer_token = config.latent_cache_width * itemsize
    else:
        per_layer_token = 2 * (setup.kv_heads // setup.tp_size) * config.head_dim * itemsize
    states = set(config.state_layers)
    windows = [w for i, w in enumerate(config.layer_sliding_windows) if i not in states]
    tokens = sum(min(context, w) if w else context for w in windows)
    state = 2 * len(states) * state_slot_bytes(config, jnp.dtype(setup.dtype), setup.tp_size) if states else 0
    return batch * (tokens * per_layer_token + state)


def weight_bytes_read(setup: StepSetup, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens reads on one chip: all it holds for a dense
    model; for a mixture of experts, the experts a batch of uniformly routed tokens is expected
    to touch (on a mesh each chip holds a `1 / tp_size` slice of every expert, or on average
    that many whole ones; with the experts over data-parallel replicas, `1 / (dp_size x
    tp_size)`, and every replica's batch reaches them)."""
    config = setup.config
    replicas = setup.dp_size if setup.expert_parallel else 1  # the replicas a chip's experts serve
    devices = setup.tp_size * replicas  # the chips the experts are spread over
    total = setup.abstract_model().chip_weight_bytes(setup.abstract_mesh())
    if not config.num_experts:
        return total
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    hidden, inner = config.hidden_size, config.moe_intermediate_size
    values, _, group = setup.quantization.partition("-g")
    values = values.removesuffix("z")  # int4z: the routed experts keep no offsets (`quantize_int4`)
    weight = 3 * hidden * inner // 2 if values == "int4" else 3 * hidden * inner  # int4: 2 a byte
    if getattr(config, "mxfp4", False):  # FP4 values, a one-byte scale per 32 (`models.mxfp4`)
        expert = 3 * hidden * inner * 17 // 32 // devices
    elif values in ("fp8", "int4") and group:  # a float32 scale per group of inputs and output
        expert = (weight + 4 * 3 * hidden * inner // int(group)) // devices
    elif values in ("int8", "fp8", "int4"):  # 8- or 4-bit kernels, a float32 scale per channel
        expert = (weight + 4 * (2 * inner + hidden)) // devices
    else:
        expert = 3 * hidden * inner * _itemsize(setup.dtype) // devices
    all_experts = moe_layers * config.num_experts * expert
    untouched = (1 - config.num_experts_per_tok / config.num_experts) ** (batch * replicas)
    return int(total - all_experts * untouched)


def decode_roofline(setup: StepSetup, batch: int, context: int) -> dict[str, float]:
    """Seconds a decode step takes at the chip's peak bandwidth to read the weights and the KV
    once (a lower bound: compute, activations and the sampler come on top), and the tokens/s."""
    weights, kv = weight_bytes_read(setup, batch), kv_bytes_read(setup, batch, context)
    seconds = (weights + kv) / setup.compile_target.hbm_bytes_per_second
    return {
        "weight_bytes_read": weights,
        "kv_bytes_read": kv,
        "seconds": seconds,
        "tokens_per_second": batch / seconds,
    }


def xla_decode_estimate(setup: StepSetup, decode: ProgramFacts, batch: int) -> dict[str, float | None]:
    """XLA's cost model of the decode step: its `optimal_seconds` where it is usable (positive:
    XLA's TPU model gives a negative figure for programs with Mosaic calls), and the time its
    `bytes accessed` takes at peak bandwidth, each with the tokens/s it implies."""
    optimal = decode.optimal_seconds if decode.optimal_seconds and decode.optimal_seconds > 0 else None
    traffic = decode.bytes_accessed / setup.compile_target.hbm_bytes_per_second
    return {
        "optimal_seconds": optimal,
        "optimal_tokens_per_second": batch / optimal if optimal else None,
        "bytes_accessed_seconds": traffic,
        "bytes_accessed_tokens_per_second": batch / traffic if traffic else None,
    }


def _itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize
