# SPDX-License-Identifier: Apache-2.0
"""Sizing the KV cache from compiled programs, and the decode step's memory-bandwidth roofline.

`fit_kv_cache` compiles the runner's prefill and decode programs (`tpu_platform.plan`) for one
chip of a target: once with a small cache to learn what the weights, inputs and temporaries
take, then with the cache sized to what is left of the chip's memory budget, and again (from
the two compiles' slope) if the temporaries grew with the cache. `decode_roofline` is the time a
decode step needs at the chip's peak bandwidth just to read the weights and the batch's KV once.
All of it is compiler estimates and arithmetic, not measurements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from tpu_platform.plan import (
    SAMPLING_FLAGS,
    ProgramFacts,
    StepSetup,
    abstract_model,
    compile_forward,
    compile_sampler,
    kv_layout,
    kv_page_bytes,
)

# Share of the chip's memory the planner lets the program use (vLLM's gpu_memory_utilization).
MEMORY_UTILIZATION = 0.9
# The probe compile's cache: this share of what the weights leave (the compile cost does not
# depend on it; the share is small so a temporary that grows with the cache barely shows).
PROBE_SHARE = 1 / 16


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
        a token takes a page slot in each)."""
        return self.num_pages * self.setup.tokens_per_page // kv_layout(self.setup.config).num_groups

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
    weights = abstract_model(setup.config, setup.dtype, setup.max_model_len).weight_bytes
    budget = int(setup.compile_target.hbm_bytes * memory_utilization)
    page = kv_page_bytes(setup)
    no_fit = dict(setup=setup, weight_bytes=weights, budget_bytes=budget, page_bytes=page, num_pages=0)
    if weights >= budget:
        reason = f"weights need {weights} B, {weights - budget} B over the {budget} B budget"
        return KVFit(**no_fit, decode=None, prefill=None, sampler=None, compiles=0, reason=reason)
    sampler = compile_sampler(setup, setup.buckets.seqs_for(decode_tokens), SAMPLING_FLAGS)
    # The sampler runs beside the resident weights and cache: its own bytes come on top.
    budget_steps = budget - (sampler.peak_bytes - sampler.argument_bytes)
    probe_pages = max(1, int((budget_steps - weights) * PROBE_SHARE) // page)
    probe = compile_forward(setup, probe_pages, prefill_tokens)
    compiles = 2
    pages = (budget_steps - (probe.peak_bytes - probe_pages * page)) // page
    while True:
        if pages < 1:
            reason = f"weights and temporaries leave no KV page ({probe.peak_bytes} B at {probe_pages} pages)"
            return KVFit(
                **no_fit, decode=None, prefill=probe, sampler=sampler, compiles=compiles, reason=reason
            )
        prefill, decode = (
            compile_forward(setup, pages, prefill_tokens),
            compile_forward(setup, pages, decode_tokens),
        )
        compiles += 2
        worst = max(prefill.peak_bytes, decode.peak_bytes)
        if worst <= budget_steps or compiles >= 6:
            break
        # The temporaries grow with the cache: from the two sizes, bytes per page beyond the page.
        slope = max((prefill.peak_bytes - probe.peak_bytes) / (pages - probe_pages), page)
        pages = pages - math.ceil((worst - budget_steps) / slope)
    return KVFit(
        **{**no_fit, "num_pages": pages if worst <= budget_steps else 0},
        decode=decode, prefill=prefill, sampler=sampler, compiles=compiles,
        reason="" if worst <= budget_steps else f"the sized programs need {worst} B > {budget_steps} B",
    )  # fmt: skip


def kv_bytes_read(setup: StepSetup, batch: int, context: int) -> int:
    """KV bytes a decode step of `batch` sequences of `context` tokens reads (every layer reads
    its keys and values once; a sliding-window layer only its window)."""
    config, itemsize = setup.config, _itemsize(setup.cache_dtype)
    per_layer_token = 2 * config.num_kv_heads * config.head_dim * itemsize
    tokens = sum(min(context, w) if w else context for w in config.layer_sliding_windows)
    return batch * tokens * per_layer_token


def weight_bytes_read(setup: StepSetup, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens reads: all of them for a dense model; for a
    mixture of experts, the experts a batch of uniformly routed tokens is expected to touch."""
    config = setup.config
    total = abstract_model(config, setup.dtype, setup.max_model_len).weight_bytes
    if not config.num_experts:
        return total
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    expert = 3 * config.hidden_size * config.moe_intermediate_size * _itemsize(setup.dtype)
    all_experts = moe_layers * config.num_experts * expert
    untouched = (1 - config.num_experts_per_tok / config.num_experts) ** batch
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
