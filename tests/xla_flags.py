# SPDX-License-Identifier: Apache-2.0
"""The test processes' `XLA_FLAGS`: XLA:CPU programs compiled without LLVM's optimizations.

Most of a clean run's time is XLA compiling small CPU programs, and over a quarter of that is LLVM
optimizing machine code the tests run once or a few times. `tests/conftest.py` therefore adds
`--xla_backend_optimization_level=0` to every test process's `XLA_FLAGS` (unless the flag is
already set: `XLA_FLAGS=--xla_backend_optimization_level=3 make test`, XLA's default, compiles as
served). Only LLVM's level changes: XLA's HLO passes (fusion, layouts, buffer assignment, the
collectives of a sharded program) are the served program's (`tests/test_xla_flags.py` compares an
optimized program's text both ways), and the results are the same within the tests'
tolerances. Two things run as shipped: the real TPU and GPU compilers of `tests/aot/` (their
workers drop the flag, `without_test_flags`) and the installed wheel's generation
(`tests/test_packaging.py`). Programs whose run costs more than their compile (the TPU attention
kernel in interpret mode) compile at XLA's default level by options of their own (`jit_kernel_run`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

LLVM_OPTIMIZATIONS_OFF = "--xla_backend_optimization_level=0"
_LEVEL = "--xla_backend_optimization_level="
# XLA's default level, for the programs whose run costs more than their compile (`jit_kernel_run`).
AS_SERVED = {"xla_backend_optimization_level": 3}


def with_test_flags(flags: str) -> str:
    """`flags` with LLVM's optimizations off, unless `flags` sets a level of its own."""
    if _LEVEL in flags:
        return flags
    return f"{flags} {LLVM_OPTIMIZATIONS_OFF}".strip()


def without_test_flags(flags: str) -> str:
    """`flags` without the suite's own flag: programs compiled as served."""
    return " ".join(flag for flag in flags.split() if flag != LLVM_OPTIMIZATIONS_OFF)


def with_host_devices(count: int) -> str:
    """This process's `XLA_FLAGS` (the suite's) with `count` simulated CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def jit_kernel_run(
    fun: Callable[..., Any], *, long_run: bool = False, **jit_kwargs: Any
) -> Callable[..., Any]:
    """`jax.jit(fun)` for a kernel test's program; compiled at XLA's default level when its run,
    not its compile, is the cost (`long_run`), whatever the process's `XLA_FLAGS`.

    The TPU attention kernel in interpret mode is such a program: the TPU interpreter runs the
    kernel's grid as compiled loops that call back into Python at every DMA and semaphore, which
    LLVM-unoptimized loops run several times slower. The other interpret-mode programs (the TPU
    KV write, the MLA kernels, the GPU kernels' interpreter) ran faster at the suite's level: their
    compile outweighs their run. `jax.jit`'s `compiler_options` set the level for this program
    alone."""
    import jax  # not at import: `tests/conftest.py` reads this module before JAX starts

    options = AS_SERVED if long_run else None
    return jax.jit(fun, compiler_options=options, **jit_kwargs)
