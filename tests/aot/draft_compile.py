# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles speculative decoding's programs for a compile-only target (one chip).

`python -m tests.aot.draft_compile TARGET [DRAFT_LAYERS]` (run by `toolchains.run_worker`) prints
one JSON line: the verification of k = 4 drafts for Llama-3.1-8B: the verify step itself (the
step program at its verify shape, 64 requests of 1 + k rows, the head on every row; DRAFT_LAYERS
layers as for the draft, with its caches' bytes over `VERIFY_PAGES` pages), the random rows'
program over its rows' logits, and from hidden states (a step of another shape: greedy, and
random with filters), the draft loop of Llama-3.2-1B as its draft (k = 4), each with its compile
seconds, temp, argument and aliased bytes, the draft's caches' bytes, and the draft's planner rows
(weights, bytes per page) for the whole draft. DRAFT_LAYERS > 0 compiles the loop with the
draft's first layers at full width (0, the default: all 16), its caches given as many pages more
as make them the whole draft's bytes: what the loop does to its caches (an in-place update or a
copy of them) it does layer by layer. Weights are abstract: nothing is allocated, only compiled.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from tpu_platform.planner.draft import compile_draft_loop, compile_verify, compile_verify_rows, draft_memory
from tpu_platform.planner.plan import (
    StepSetup,
    compile_forward,
    first_layers,
    kv_page_bytes,
    model_config,
    step_shape,
)
from tpu_platform.sampling import SamplerFlags
from tpu_platform.speculation.verifier import position_flags

K = 4
ROWS = 64
NUM_PAGES = 512
# The verify step's caches: larger than its head's logits on all 320 rows (with the draft's
# layer count, 512 pages would be smaller), so a temporary of a cache's size stands out.
VERIFY_PAGES = 8192


def _facts(facts) -> dict:
    return {
        "seconds": round(facts.compile_seconds, 2),
        "temp_bytes": facts.temp_bytes,
        "argument_bytes": facts.argument_bytes,
        "alias_bytes": facts.alias_bytes,
    }


def main(target: str, draft_layers: str = "0") -> dict:
    limits = dict(target=target, max_num_seqs=ROWS, max_model_len=4096, max_num_batched_tokens=2048)
    verify_setup = StepSetup(config=model_config("llama-3.1-8b"), **limits)
    draft = StepSetup(config=model_config("llama-3.2-1b"), **limits)
    out = {"target": target}
    for name, flags in (
        ("verify_greedy", SamplerFlags(all_greedy=True)),
        ("verify_random", SamplerFlags(filters=True)),
    ):
        try:
            out[name] = _facts(compile_verify(verify_setup, ROWS, K, flags))
        except Exception as e:  # the compiler's message is the answer
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    out.update(_verify_step(verify_setup, int(draft_layers)))
    cut = dataclasses.replace(draft, config=first_layers(draft.config, int(draft_layers)))
    pages = NUM_PAGES * draft.config.num_layers // cut.config.num_layers
    try:
        out["draft_loop"] = _facts(compile_draft_loop(cut, pages, ROWS, K))
    except Exception as e:
        out["draft_loop"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    out["draft_layers"] = cut.config.num_layers
    out["draft_cache_bytes"] = kv_page_bytes(cut) * pages
    out["draft_memory"] = dataclasses.asdict(draft_memory(draft))
    out["target_page_bytes"] = kv_page_bytes(verify_setup)
    return out


def _verify_step(target: StepSetup, layers: int) -> dict:
    """The verify step (the step program at a verify shape) of `target` cut to `layers` layers,
    its caches' bytes and shape, and the random rows' program."""
    setup = dataclasses.replace(target, config=first_layers(target.config, layers), speculative_tokens=K)
    out = {"verify_step_shape": list(step_shape(setup, ROWS * (1 + K), ROWS))}
    out["verify_step_cache_bytes"] = kv_page_bytes(setup) * VERIFY_PAGES
    for name, compile_it in (
        ("verify_step", lambda: compile_forward(setup, VERIFY_PAGES, ROWS * (1 + K), ROWS)),
        ("verify_rows_random", lambda: compile_verify_rows(target, ROWS, K, SamplerFlags(filters=True))),
        (
            "verify_rows_options",
            lambda: compile_verify_rows(target, ROWS, K, position_flags(20, "raw_logprobs")[1]),
        ),
    ):
        try:
            out[name] = _facts(compile_it())
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
