# SPDX-License-Identifier: Apache-2.0
"""The runner's compiled programs: built ahead of time in parallel, kept on disk, counted.

Also turns on JAX's own persistent compilation cache (`enable_persistent_cache`).

A program is one jitted function at one set of static arguments and argument shapes (a forward
per step shape, a sampler per row count and flag set), named by a hashable key. `Programs.build`
makes one ready, fastest source first:

1. memory (built earlier in this process);
2. the executable cache on disk (`<cache_dir>/executables`): a serialized executable, loaded
   without tracing or compiling;
3. tracing and compiling it, after which the executable is written to the executable cache
   (without an executable cache, JAX's persistent compilation cache may serve the compile).

A disk entry is named by a hash of everything that shapes the program: the key, the argument
structure and shapes, the caller's context (model configuration, attention backend), the JAX and
jaxlib versions, the device, `XLA_FLAGS` and the source of our three packages (comments and
docstrings excluded). An executable that JAX loaded from its own persistent cache cannot be
serialized again (XLA:CPU drops its code), so programs bound for the executable cache are compiled
under a JAX cache key of their own, and only executables XLA demonstrably compiled in the call
(JAX reports writing them to its cache) are written (see `Programs._compile_for_cache`).

Entries are unpickled, so a cache directory or entry another user could have written (or a
directory above them, or one swapped in after the check) is not read (`private_files`); the
program is compiled instead.

After `seal()`, a program that warm-up did not build is an error (strict) or a counted warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jaxlib
from flax import nnx
from jax.experimental import serialize_executable

from tpu_platform import internals
from tpu_platform.disk_cache import mark_used, remove_unused, source_fingerprint, write_atomically
from tpu_platform.private_files import (
    UnsafeCacheError,
    make_private_dir,
    open_private_file,
    unsafe_reason,
)

logger = logging.getLogger(f"vllm_xla.{__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class ProgramSpec:
    """One program to build: `jitted(*args, **static)` under `key`; `args` may be abstract."""

    key: Hashable
    jitted: Callable
    args: tuple
    static: dict[str, Any] = dataclasses.field(default_factory=dict)
    context: str = ""


def enable_persistent_cache(cache_dir: str) -> str | None:
    """Turns on JAX's persistent compilation cache under `cache_dir/jax`; returns the path, or
    None when another user could write that directory (its executables are loaded as code)."""
    path = os.path.join(cache_dir, "jax")
    make_private_dir(path)
    unsafe = unsafe_reason(path)
    if unsafe:
        logger.warning("not using JAX's compilation cache at %s: %s", path, unsafe)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def environment_fingerprint(device: jax.Device, memo_dir: str | None = None) -> str:
    """What, besides a program's own inputs, decides the executable XLA builds for it
    (`memo_dir`: see `source_fingerprint`)."""
    parts = (
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        os.environ.get("XLA_FLAGS", ""),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        source_fingerprint(memo_dir=memo_dir),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def structure_text(graphdef: nnx.GraphDef) -> str:
    """`repr(graphdef)` with every variable's metadata in key order: equal graph definitions give
    equal text, however their metadata was built (a model rebuilt from the weights cache lists it
    sorted, a freshly built one in creation order), so the executables they name are shared."""
    return repr(dataclasses.replace(graphdef, nodes=internals.variable_metadata_sorted(graphdef.nodes)))


def _signature(spec: ProgramSpec) -> str:
    leaves, treedef = jax.tree.flatten(spec.args)
    avals = [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))) for x in leaves]
    return repr((spec.key, sorted(spec.static.items()), spec.context, str(treedef), avals))


class ExecutableCache:
    """Serialized executables in one directory, one file per program; those unused for 30 days
    are removed when a cache is opened."""

    def __init__(self, directory: str, device: jax.Device):
        self.directory = directory
        self.device = device
        make_private_dir(directory)
        # Executables are unpickled: a directory another user can write is not used at all.
        self.unsafe = unsafe_reason(directory)
        if self.unsafe:
            logger.warning(
                "not using the executable cache at %s: %s; programs are compiled and not kept",
                directory,
                self.unsafe,
            )
        else:
            remove_unused(directory, ".xla")
        self._environment = environment_fingerprint(device, memo_dir=None if self.unsafe else directory)

    def path(self, spec: ProgramSpec) -> str:
        name = hashlib.sha256(f"{self._environment}\n{_signature(spec)}".encode()).hexdigest()
        return os.path.join(self.directory, f"{name[:40]}.xla")

    def load(self, path: str) -> jax.stages.Compiled | None:
        """The executable at `path` (from `path(spec)`), or None when it is missing, unreadable or
        could have been written by another user (then compiled instead, and replaced)."""
        if self.unsafe:
            return None
        try:
            with open_private_file(path) as f:  # unpickled from the descriptor that was judged
                payload, in_tree, out_tree = pickle.load(f)
            loaded = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[self.device]
            )
            mark_used(path)
            return loaded
        except FileNotFoundError:
            return None
        except UnsafeCacheError as error:
            logger.warning("%s; compiling the program instead", error)
            return None
        except Exception as error:  # a stale or truncated entry: rebuild it
            logger.warning("dropping unreadable cached executable %s (%s)", path, error)
            Path(path).unlink(missing_ok=True)
            return None

    def store(self, path: str, compiled: jax.stages.Compiled) -> None:
        if self.unsafe:
            return
        try:
            write_atomically(path, pickle.dumps(serialize_executable.serialize(compiled)))
        except (OSError, ValueError, NotImplementedError) as error:
            logger.warning("could not cache the executable at %s (%s)", path, error)


class Programs:
    """The programs of one runner, with counters for the stat logger."""

    def __init__(self, *, strict: bool, cache: ExecutableCache | None):
        self.strict = strict
        self.cache = cache
        self.sealed = False
        self.count = 0  # programs made ready (compiled or loaded)
        self.loaded = 0  # of which loaded from the executable cache
        self.seconds = 0.0
        self.compiles_after_warmup = 0
        self._ready: dict[Hashable, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self._fresh_event_recorded = True  # until a compile proves otherwise (`_compile_for_cache`)

    def call(self, spec_key: Hashable, make_spec: Callable[[], ProgramSpec], *args):
        """Runs program `spec_key` on `args`, building it first (see `seal`) when it is missing."""
        program = self._ready.get(spec_key)
        if program is None:
            program = self._build_late(make_spec())
        return program(*args)

    def get(self, spec_key: Hashable) -> jax.stages.Compiled | None:
        """Program `spec_key` if it is built."""
        return self._ready.get(spec_key)

    def keys(self) -> list[Hashable]:
        """The keys of the programs built so far."""
        return list(self._ready)

    def build_all(self, specs: Sequence[ProgramSpec], workers: int | None = None) -> int:
        """Builds `specs` on `workers` threads (default: one per core, at most four: compiling is
        memory-hungry) behind a progress bar; returns how many were new."""
        workers = workers or max(1, min(4, os.cpu_count() or 1))
        built = 0
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="vllm-xla-build") as pool,
            _progress_bar(
                total=len(specs), desc="vllm-xla warm-up", unit="program", disable=len(specs) < 2
            ) as bar,
        ):
            for new in pool.map(self.build, specs):
                built += new
                bar.update()
        return built

    def build(self, spec: ProgramSpec) -> bool:
        """Makes `spec` ready; False when it already was."""
        if spec.key in self._ready:
            return False
        start = time.perf_counter()
        if self.cache is None:
            program, loaded = _compile(spec)[0], False
        else:
            path = self.cache.path(spec)
            program = self.cache.load(path)
            loaded = program is not None
            if program is None:
                program = self._compile_for_cache(spec, path)
        with self._lock:
            if spec.key in self._ready:
                return False
            self._ready[spec.key] = program
            self.count += 1
            self.loaded += loaded
            self.seconds += time.perf_counter() - start
        return True

    def _compile_for_cache(self, spec: ProgramSpec, path: str) -> jax.stages.Compiled:
        """Compiles `spec` so that the executable can be written, and writes it.

        JAX's caches would hand back a copy of an identical program compiled before (under an
        older key of ours, say after an upgrade that left the program unchanged), which cannot be
        re-serialized. So the compile carries our entry's name as an inert option, which JAX's
        cache keys include; if JAX still had that (our entry was deleted), a random one forces a
        fresh compile.
        """
        name = os.path.basename(path)
        fresh = False
        if self._fresh_event_recorded:
            program, fresh = _compile(spec, salt=name)
            fresh = fresh or not _jax_cache_on()  # without JAX's cache every compile is XLA's own
        if not fresh:
            program, fresh = _compile(spec, salt=f"{name}-{uuid.uuid4().hex}")
            if not fresh and _jax_cache_on():
                # A salt never used before cannot hit a cache: JAX no longer records the event
                # that tells a fresh compile. From now on every program takes a new salt.
                internals.warn_fallback(
                    f"compilation event {internals.FRESH_COMPILE_EVENT!r}",
                    "a new compile option salt for every program bound for the executable cache",
                )
                self._fresh_event_recorded = False
        self.cache.store(path, program)
        return program

    def seal(self) -> None:
        self.sealed = True

    def _build_late(self, spec: ProgramSpec) -> jax.stages.Compiled:
        if self.sealed:
            message = f"a program was built after warm-up for {spec.key}"
            if self.strict:
                raise RuntimeError(
                    f"{message} (VLLM_XLA_STRICT_COMPILE=1); this shape is missing from warm-up"
                )
            logger.warning(message)
            with self._lock:
                self.compiles_after_warmup += 1
        self.build(spec)
        return self._ready[spec.key]


def _jax_cache_on() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def _compile(spec: ProgramSpec, salt: str | None = None) -> tuple[jax.stages.Compiled, bool]:
    """Traces and compiles `spec`; the flag says whether XLA compiled it here (not a cache's copy).

    A `salt` sets an XLA option that only affects debug printing (how many buffers a buffer
    assignment dump lists) but is part of JAX's cache keys.
    """
    options = None
    if salt:
        options = {
            "xla_debug_buffer_assignment_show_max": int(hashlib.sha256(salt.encode()).hexdigest()[:7], 16)
        }
    thread, fresh = threading.get_ident(), []

    def on_event(event: str, **_: Any) -> None:
        if event == internals.FRESH_COMPILE_EVENT and threading.get_ident() == thread:
            fresh.append(event)

    jax.monitoring.register_event_listener(on_event)
    try:
        compiled = spec.jitted.trace(*spec.args, **spec.static).lower().compile(compiler_options=options)
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    return compiled, bool(fresh)


def _progress_bar(**kwargs: Any) -> Any:
    # Imported here: the step program's module imports this one, and a host that runs JAX alone
    # (the accelerator check script) may have no tqdm.
    from tqdm import tqdm

    return tqdm(**kwargs)
