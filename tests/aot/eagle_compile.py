# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles an EAGLE-1 head's programs for a compile-only target.

`python -m tests.aot.eagle_compile TARGET [TP [PREFILL]]` (run by `toolchains.run_worker`) prints
one JSON line: the pass of a head of Llama-3.1-8B's shape (one layer 4096 wide, `fc` 8192 -> 4096,
the target's embedding and LM head, as EAGLE-LLaMA3-Instruct-8B) over a prefill step of PREFILL
tokens (default 512) and its loop for k = 4, each with its compile seconds, temp, argument and
aliased bytes, and the head's cache and weight bytes on one chip. Weights are abstract: nothing
is allocated. (The target's step is the plain one: the head reads its final hidden states.)
"""

from __future__ import annotations

import json
import sys

from tests.aot.eagle3_compile import NUM_PAGES, PREFILL, ROWS, K, _error, _facts
from tpu_platform.planner.draft import compile_eagle
from tpu_platform.planner.plan import StepSetup, model_config


def main(target: str, tp_size: str = "1", prefill: str = str(PREFILL)) -> dict:
    setup = StepSetup(
        config=model_config("llama-3.1-8b"), target=target, max_num_seqs=ROWS, max_model_len=4096,
        max_num_batched_tokens=2048, tp_size=int(tp_size),
    )  # fmt: skip
    out = {"target": target, "tp_size": int(tp_size), "num_pages": NUM_PAGES}
    try:
        programs = compile_eagle(setup, NUM_PAGES, int(prefill), ROWS, K)
        out["head_pass"], out["head_loop"] = _facts(programs.head_pass), _facts(programs.loop)
        out["head_cache_bytes"], out["head_weight_bytes"] = programs.cache_bytes, programs.weight_bytes
    except Exception as e:
        out["head_pass"] = out["head_loop"] = _error(e)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
