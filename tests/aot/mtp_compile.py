# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the MTP layer's programs of a DeepSeek-V3-shaped target for a compile-only
chip.

`python -m tests.aot.mtp_compile TARGET` (run by `toolchains.run_worker`) prints one JSON line:
the MTP layer's pass over a prefill step and its loop for k = 4 (DeepSeek-V3 at full width, cut
to its first four layers: the MTP layer, numbered after them, is latent attention and MoE), each
with its compile seconds, temp, argument and aliased bytes, and the layer's latent cache and
weight bytes. Weights are abstract: nothing is allocated.
"""

from __future__ import annotations

import json
import sys

from tests.aot.eagle3_compile import _error, _facts
from tpu_platform.planner.draft import compile_mtp
from tpu_platform.planner.plan import StepSetup, first_layers, model_config

K = 4
ROWS = 64
NUM_PAGES = 65536  # the cache far larger than any activation (MoE buffers included): a copy would show
PREFILL = 512


def main(target: str) -> dict:
    config = first_layers(model_config("deepseek-v3"), 4)
    setup = StepSetup(config=config, target=target, max_num_seqs=ROWS, max_model_len=4096,
                      max_num_batched_tokens=2048)  # fmt: skip
    out = {"target": target}
    try:
        programs = compile_mtp(setup, NUM_PAGES, PREFILL, ROWS, K)
        out["head_pass"], out["head_loop"] = _facts(programs.head_pass), _facts(programs.loop)
        out["head_cache_bytes"], out["head_weight_bytes"] = programs.cache_bytes, programs.weight_bytes
    except Exception as e:
        out["head_pass"] = out["head_loop"] = _error(e)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
