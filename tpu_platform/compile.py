# SPDX-License-Identifier: Apache-2.0
"""Compilation: persistent cache and the guard against compiling after warm-up."""

from __future__ import annotations

import logging
import os
import time

import jax

logger = logging.getLogger(__name__)


def enable_persistent_cache(cache_dir: str) -> str:
    """Turns on JAX's persistent compilation cache under `cache_dir/jax`; returns the path."""
    path = os.path.join(cache_dir, "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileGuard:
    """Counts distinct program shapes; after `seal()`, a new one is logged or (strict) an error."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.sealed = False
        self.seen: set[tuple] = set()
        self.count = 0
        self.seconds = 0.0
        self.compiles_after_warmup = 0

    def check(self, key: tuple) -> bool:
        """Records `key`; returns True if it is new (the caller is about to compile)."""
        if key in self.seen:
            return False
        if self.sealed:
            self.compiles_after_warmup += 1
            message = f"compiling a new program after warm-up for shape {key}"
            if self.strict:
                raise RuntimeError(message + " (VLLM_XLA_STRICT_COMPILE=1); add this size to the buckets")
            logger.warning(message)
        self.seen.add(key)
        return True

    def timed(self, key: tuple, fn, *args, **kwargs):
        """Calls `fn`, charging its time to compilation when `key` is new."""
        if not self.check(key):
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        self.count += 1
        self.seconds += time.perf_counter() - start
        return out

    def seal(self) -> None:
        self.sealed = True
