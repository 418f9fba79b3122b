# SPDX-License-Identifier: Apache-2.0
"""Where a compile worker's time goes: each compile's wall and CPU seconds, for choosing what
`make test` compiles.

    python -m tests.aot.time_compiles tpu|cuda WORKER [ARGS ...]
    python -m tests.aot.time_compiles tpu model_step_worker depth-one-prefill v6e-1:llama-3.1-8b

runs `python -m tests.aot.WORKER ARGS` as `toolchains.run_worker` does (the platform's compiler on
the path, JAX on the CPU) and prints to stderr a line for every `Lowered.compile()` it makes and
one for the whole worker; the worker's own output passes through. CPU seconds are the ones to
compare: on a shared machine a compile's wall time is mostly other processes' turns, and `make
test` runs as many test processes as cores.
"""

from __future__ import annotations

import functools
import re
import runpy
import subprocess
import sys
import time

import jax

from tests.aot.toolchains import REPO, worker_env

INNER = "--inner"
MODULE_NAME = re.compile(r"module @([^ ]+)")


def _timed_compile(compile_lowered):
    @functools.wraps(compile_lowered)
    def compile_and_report(lowered, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        compiled = compile_lowered(lowered, *args, **kwargs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        name = MODULE_NAME.search(lowered.as_text()[:500])
        print(f"compile {name and name[1]}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr, flush=True)
        return compiled

    return compile_and_report


def run_inner(worker: str, args: list[str]) -> None:
    """In the toolchain's process: the worker run as `python -m`, every compile timed."""
    jax.stages.Lowered.compile = _timed_compile(jax.stages.Lowered.compile)
    sys.argv = [worker, *args]
    try:
        runpy.run_module(f"tests.aot.{worker}", run_name="__main__")
    finally:
        print(f"worker {worker}: {time.process_time():.1f} s CPU in all", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == [INNER]:
        run_inner(argv[1], argv[2:])
        return 0
    if len(argv) < 2 or argv[0] not in ("tpu", "cuda"):
        raise SystemExit(__doc__)
    platform, worker, *args = argv
    command = [sys.executable, "-m", "tests.aot.time_compiles", INNER, worker, *args]
    return subprocess.run(command, cwd=REPO, env=worker_env(platform)).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
