# SPDX-License-Identifier: Apache-2.0
"""A runner's warm-up (`Runner.warm_up`): the programs it builds before serving (`warm_up_specs`),
and those it runs once on harmless inputs (`run_once`), reading the runner's start-up records."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpu_platform.inputs import exercise_inputs, pack_inputs, padding_inputs
from tpu_platform.programs import ProgramSpec
from tpu_platform.sampling.uniform import uniform_warmup_flag_sets

if TYPE_CHECKING:
    from tpu_platform.runner import Runner

# Forward programs up to this many tokens run once at warm-up (see `Runner.warm_up`).
FIRST_RUN_TOKENS = 64


def warm_up_specs(runner: Runner, shapes: list[tuple[int, int, int]]) -> list[ProgramSpec]:
    """The forward per shape (largest first: they take longest) and the sampler per row count."""
    specs, rows = [], []
    for t_pad, r_pad, p_pad in sorted(shapes, reverse=True):
        packed, dims = pack_inputs(padding_inputs(t_pad, r_pad, p_pad, runner.num_groups))
        if runner.step_program.inputs_sharding is not None:  # on a mesh, as each step's arrive
            packed = runner.step_program.abstract_args((t_pad, r_pad, p_pad))[0][2]
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
        specs += runner.speculation.warm_up_specs(
            runner._whole_state(), runner.sampling, runner.dtype, runner.buckets.verify, runner._extra_widths
        )
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
