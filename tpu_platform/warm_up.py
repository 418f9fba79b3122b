# SPDX-License-Identifier: Apache-2.0
"""A runner's warm-up (`Runner.warm_up`): the programs it builds before serving (`warm_up_specs`),
and those it runs once on harmless inputs (`run_once`), reading the runner's start-up records."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpu_platform.inputs import exercise_inputs, pack_inputs, padding_inputs
from tpu_platform.programs import ProgramSpec
from tpu_platform.sampling.uniform import uniform_warmup_flag_sets
from tpu_platform.speculation.adaptive import StepCosts

if TYPE_CHECKING:
    from tpu_platform.runner import Runner

logger = logging.getLogger(f"vllm_xla.{__name__}")

# Forward programs up to this many tokens run once at warm-up (see `Runner.warm_up`).
FIRST_RUN_TOKENS = 64


def warm_up_specs(runner: Runner, shapes: list[tuple[int, int, int]]) -> list[ProgramSpec]:
    """The forward per shape (largest first: they take longest) and the sampler per row count."""
    specs, rows = [], []
    for t_pad, r_pad, p_pad in sorted(shapes, reverse=True):
        packed, dims = pack_inputs(padding_inputs(t_pad, r_pad, p_pad, runner.num_groups))
        if runner.mesh is not None:  # replicated, as each step's inputs arrive
            packed = jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=runner._whole)
        specs.append(runner._forward_spec(packed, dims))
        rows.append(r_pad)
    if runner._pooling is not None:  # a pooling engine never samples (the forward's argmax serves)
        return specs + runner._pooling.specs(runner._state_leaves, shapes)
    vocab = runner.model_config.vocab_size
    for r_pad in dict.fromkeys(rows):
        whole = None if runner.mesh is None else runner._whole
        logits = jax.ShapeDtypeStruct((r_pad, vocab), jnp.float32, sharding=whole)
        for flags in uniform_warmup_flag_sets(
            runner._logprobs_width, logprobs_mode=runner.config.logprobs_mode
        ):
            if flags.argmax_only and not runner.config.logits_processors:
                continue  # the forward's argmax serves these steps
            tensors = runner.sampling.dummy_tensors(flags, r_pad, **runner._extra_widths)
            specs.append(runner._sampler_spec(logits, tensors, flags))
    if runner.speculation is not None:
        specs += runner.speculation.warm_up_specs(runner._whole_state(), runner.sampling, runner.dtype)
    return specs + runner._prompt_logprobs.warm_up_specs(runner._whole_state())


def run_once(runner: Runner, specs: list[ProgramSpec]) -> None:
    """Runs every sampler program and the forward programs of up to `FIRST_RUN_TOKENS` tokens."""
    logits = {}
    # Samplers first: a program's first run can undo part of another's (measured: a forward
    # run before the samplers' first runs paid its first-run cost again afterwards).
    for spec in sorted(specs, key=lambda spec: spec.key[0] != "sample"):
        kind, *static = spec.key
        if kind == "forward" and static[0] <= FIRST_RUN_TOKENS:
            t_pad, r_pad, p_pad, _ = static
            for num_seqs in dict.fromkeys((1, r_pad)):  # a prefill chunk, then a batch (if R > 1)
                inputs = exercise_inputs(
                    t_pad, r_pad, p_pad, runner.num_groups, runner.num_pages,
                    page_size=runner.config.page_size, num_seqs=num_seqs,
                )  # fmt: skip
                runner._run_forward(*pack_inputs(inputs), runner._no_feed)
        elif kind == "sample":
            rows = static[0]
            if rows not in logits:
                zeros = np.zeros((rows, runner.model_config.vocab_size), np.float32)
                logits[rows] = jax.device_put(zeros, None if runner.mesh is None else runner._whole)
            runner.programs.call(spec.key, lambda spec=spec: spec, logits[rows], spec.args[1])
    jax.block_until_ready(runner.kv_caches)


# Timing a step shape for speculation: one untimed run (a program's first run sets up its
# fusions), then this many timed ones, of which the median counts.
TIMING_RUNS = 3
# Larger request buckets are not timed once a step of this many seconds is met: they would
# lengthen the warm-up, and the policy reads only ratios, which the largest timed bucket gives.
TIMING_LIMIT_S = 0.5


def time_speculation(runner: Runner) -> StepCosts | None:
    """The seconds of the plain decode step and of each verify step (the forward and the
    verification program) a request bucket, for `speculation.adaptive`; None where steps are not
    timed: without speculation, under vLLM's per-batch-size schedule (the user's choice), or on a
    mesh (every host must pick the same k, and simulated devices' times mean little)."""
    speculation = runner.speculation
    if speculation is None or speculation.config.per_batch_size:
        return None
    if runner.mesh is not None or jax.process_count() > 1:
        return None
    seconds: dict[int, dict[int, float]] = {}
    for r in speculation.row_buckets:
        by_k = {}
        for k in (0, *speculation.verify_tokens):
            if r * (1 + k) > runner.config.max_num_batched_tokens:
                break
            by_k[k] = _median_seconds(lambda r=r, k=k: _run_step(runner, r, k))
        if len(by_k) < 2:
            break
        seconds[r] = by_k
        if max(by_k.values()) > TIMING_LIMIT_S:
            break
    logger.info("speculation: step seconds by requests and drafts a request: %s", seconds)
    return StepCosts(seconds) if seconds else None


def _median_seconds(run) -> float:
    run()
    times = []
    for _ in range(TIMING_RUNS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _run_step(runner: Runner, num_requests: int, k: int) -> None:
    """One step of `num_requests` requests of 1 + k tokens each, on warm-up inputs, waited for."""
    t_pad, r_pad, p_pad = runner.buckets.shape_for(num_requests * (1 + k), num_requests)
    inputs = exercise_inputs(
        t_pad, r_pad, p_pad, runner.num_groups, runner.num_pages,
        page_size=runner.config.page_size, num_seqs=num_requests,
    )  # fmt: skip
    outputs = runner._run_forward(*pack_inputs(inputs), runner._no_feed)
    if k:
        state, sampling = runner._whole_state(), runner.sampling
        outputs = runner.speculation.run_verification(state, num_requests, k, sampling, runner.dtype)
    jax.block_until_ready(outputs)
