# SPDX-License-Identifier: Apache-2.0
"""Compilation: persistent cache and the guard against compiling after warm-up."""

from __future__ import annotations

import logging
import os
import time

import jax

logger = logging.getLogger(f"vllm_xla.{__name__}")


def enable_persistent_cache(cache_dir: str) -> str:
    """Turns on JAX's persistent compilation cache under `cache_dir/jax`; returns the path."""
    path = os.path.join(cache_dir, "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileGuard:
    """Counts and times the compilations of jitted functions; after `seal()` one is an error
    (strict) or a warning naming the shape that caused it."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.sealed = False
        self.count = 0
        self.seconds = 0.0
        self.compiles_after_warmup = 0

    def call(self, description: tuple, fn, *args, **kwargs):
        """Calls the jitted `fn`; when that compiled a new program, records it (and its time)."""
        before = fn._cache_size()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if fn._cache_size() == before:
            return out
        jax.block_until_ready(out)
        self.count += 1
        self.seconds += time.perf_counter() - start
        if self.sealed:
            self.compiles_after_warmup += 1
            message = f"compiled a new program after warm-up for {description}"
            if self.strict:
                raise RuntimeError(
                    f"{message} (VLLM_XLA_STRICT_COMPILE=1); this shape is missing from warm-up"
                )
            logger.warning(message)
        return out

    def seal(self) -> None:
        self.sealed = True
