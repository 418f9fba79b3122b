# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles every kernel case of a platform for its targets; prints one JSON line.

`python -m tests.aot.compile_kernels tpu|cuda [target/case ...]` (no pairs: the platform's whole
plan in kernel_cases), run by `toolchains.run_worker` in a process that
has that platform's compiler. The answer maps `"<target>/<case>"` to the compile's outcome:
seconds, `memory_analysis()` bytes, whether the kernel's custom call is in the compiled
program, or the compiler's error (a refusal is a result, not a crash of the worker).
"""

from __future__ import annotations

import json
import sys
import time
from unittest import mock

from jax.sharding import SingleDeviceSharding

import pallas_kernels.backend
from tests.aot.kernel_cases import BACKEND, CompileCase, abstract_args, find_case, layer_step, plan
from tpu_platform.planner.targets import compile_only_devices

# The kernels' custom calls in a compiled program: Mosaic's, and XLA:GPU's Triton fusion.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
ERROR_CHARS = 1500


def compile_case(target: str, platform: str, case: CompileCase) -> dict:
    """Compiles the case's layer step for one device of `target`: its figures, or its error."""
    device = compile_only_devices(target)[0]
    backend = BACKEND[platform]
    args = abstract_args(case, backend, SingleDeviceSharding(device))
    cache_bytes = args[0].size * args[0].dtype.itemsize
    start = time.perf_counter()
    try:
        compiled = layer_step(case, backend).trace(*args).lower().compile()
    except Exception as e:  # Mosaic/Triton/XLA refusals arrive as JaxRuntimeError or ValueError
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:ERROR_CHARS], "cache_bytes": cache_bytes}
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return {
        "ok": True,
        "seconds": round(seconds, 3),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "cache_bytes": cache_bytes,
        "kernel_call": KERNEL_CALL[platform] in compiled.as_text(),
    }


def main(platform: str, *pairs: str) -> None:
    if pairs:
        todo = [(t, find_case(platform, c)) for t, c in (p.split("/", 1) for p in pairs)]
    else:
        todo = plan(platform)
    results = {}
    # Backend selection asks JAX's default device, a CPU here: the compile target stands in.
    with mock.patch.object(pallas_kernels.backend, "default_platform", return_value=platform):
        for target, case in todo:
            result = compile_case(target, platform, case)
            print(f"{target}/{case.name}: {result.get('seconds', 'error')}", file=sys.stderr, flush=True)
            results[f"{target}/{case.name}"] = result
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
