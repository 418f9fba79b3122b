# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles an EAGLE-3 head's programs for a compile-only target (one chip).

`python -m tests.aot.eagle3_compile TARGET [TP [PREFILL]]` (run by `toolchains.run_worker`) prints
one JSON line: the target's step program handing the head its hidden states (Llama-3.1-8B cut to
its first four layers, the head reading three of them), the head's pass over a prefill step of
PREFILL tokens (default 512) and its loop
for k = 4 (a head of Llama-3.1-8B's shape: 4096 wide, a 32000-token draft vocabulary, as
EAGLE3-LLaMA3.1-Instruct-8B), each with its compile seconds, temp, argument and aliased bytes,
and the head's cache and weight bytes on one chip, beside the planner's rows for it. With
TP > 1 (`v6e-8` and 8, say), the target's step and the head's programs are the runner's
tensor-parallel ones, the head split on the mesh as the runner splits it. Weights are abstract:
nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from models.eagle3 import Eagle3Config
from tpu_platform.planner.draft import compile_eagle3, eagle3_memory
from tpu_platform.planner.plan import (
    StepSetup,
    _compile,
    first_layers,
    model_config,
    step_program,
    step_shape,
)

K = 4
ROWS = 64
NUM_PAGES = 4096  # the cache far larger than any activation: a copy of it would show
PREFILL = 512
AUX_LAYERS = (1, 2, 3)


def _facts(facts) -> dict:
    return {
        "seconds": round(facts.compile_seconds, 2),
        "temp_bytes": facts.temp_bytes,
        "argument_bytes": facts.argument_bytes,
        "alias_bytes": facts.alias_bytes,
    }


def _error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {str(e)[:2000]}"}  # the compiler's message is the answer


def main(target: str, tp_size: str = "1", prefill: str = str(PREFILL)) -> dict:
    config = model_config("llama-3.1-8b")
    limits = dict(target=target, max_num_seqs=ROWS, max_model_len=4096, max_num_batched_tokens=2048,
                  tp_size=int(tp_size))  # fmt: skip
    setup = StepSetup(config=first_layers(config, 4), **limits)
    head = Eagle3Config(
        model=dataclasses.replace(config, architecture="LlamaForCausalLMEagle3", num_layers=1,
                                  layer_sliding_windows=(None,)),
        draft_vocab_size=32000, target_hidden_size=config.hidden_size, num_aux_hidden_states=3,
        aux_layer_ids=AUX_LAYERS,
    )  # fmt: skip
    out = {"target": target, "tp_size": int(tp_size)}
    try:
        program = step_program(setup, NUM_PAGES, aux_layers=AUX_LAYERS)
        out["target_step"] = _facts(_compile(program, step_shape(setup, int(prefill))))
    except Exception as e:
        out["target_step"] = _error(e)
    try:
        programs = compile_eagle3(setup, head, NUM_PAGES, int(prefill), ROWS, K)
        out["head_pass"], out["head_loop"] = _facts(programs.head_pass), _facts(programs.loop)
        out["head_cache_bytes"], out["head_weight_bytes"] = programs.cache_bytes, programs.weight_bytes
    except Exception as e:
        out["head_pass"] = out["head_loop"] = _error(e)
    memory = eagle3_memory(setup, head)  # the planner's rows, a chip's
    out["planned"] = {"weight_bytes": memory.weight_bytes, "page_bytes": memory.page_bytes}
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
