# SPDX-License-Identifier: Apache-2.0
"""Builds the native CPU kernels (`paged_attention.cc`, `rope_kv.cc`, `silu_mul.cc`, `rms_norm.cc`,
`dense.cc`, `dense_f32.cc`, `dense_int8.cc`, `dense_int4.cc`) and registers them with XLA.

The sources are compiled on the machine that runs it, with `-march=native`, by the C++ compiler
in `$CXX` (else `g++`, `c++` or `clang++` on the PATH), against the XLA FFI headers that jaxlib
ships. The shared library lands in a build directory under a name that hashes the sources, the
compiler, its flags, jaxlib's version and the CPU's instruction-set flags, so a rebuilt source, an
upgraded jaxlib or a cache directory shared with a different CPU never picks up a stale library.
A build directory or library that another user could have written (or replace: every directory
above is judged, `private_files`) is refused; the library is built private whatever the umask and
loaded through the descriptor that was judged.
Building takes a few seconds, once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from pallas_kernels.private_files import (
    UnsafeCacheError,
    make_private_dir,
    open_private,
    open_private_file,
    unsafe_reason,
)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cc",
        "rope_kv.cc",
        "silu_mul.cc",
        "rms_norm.cc",
        "dense.cc",
        "dense_f32.cc",
        "dense_int8.cc",
        "dense_int4.cc",
    )
)
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "parallel.h",
        "kv_values.h",
        "fast_math.h",
        "attention_blocks.h",
        "attention_page.h",
        "dense_blocks.h",
        "dense_amx.h",
        "layer_stack.h",
        "dense_f32_block.h",
        "dense_avx2.h",
        "dense_avx512_bf16.h",
        "float16.h",
        "dense_int8_vnni.h",
        "dense_int4_avx2.h",
        "dense_int4_avx512_float.h",
        "dense_int4_pairs.h",
        "dense_int4_vnni.h",
    )
)
ATTENTION_TARGET = "vllm_xla_ragged_paged_attention"
ROPE_KV_TARGET = "vllm_xla_rope_write_kv"
SILU_MUL_TARGET = "vllm_xla_silu_mul"
RMS_NORM_TARGET = "vllm_xla_rms_norm"
ADD_RMS_NORM_TARGET = "vllm_xla_add_rms_norm"
DENSE_TARGET = "vllm_xla_dense"
DENSE_F32_TARGET = "vllm_xla_dense_f32"
DENSE_INT8_TARGET = "vllm_xla_dense_int8"
DENSE_INT4_TARGET = "vllm_xla_dense_int4"
_HANDLERS = {
    ATTENTION_TARGET: "VllmXlaRaggedPagedAttention",
    ROPE_KV_TARGET: "VllmXlaRopeWriteKv",
    SILU_MUL_TARGET: "VllmXlaSiluMul",
    RMS_NORM_TARGET: "VllmXlaRmsNorm",
    ADD_RMS_NORM_TARGET: "VllmXlaAddRmsNorm",
    DENSE_TARGET: "VllmXlaDense",
    DENSE_F32_TARGET: "VllmXlaDenseF32",
    DENSE_INT8_TARGET: "VllmXlaDenseInt8",
    DENSE_INT4_TARGET: "VllmXlaDenseInt4",
}
_FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-w",
)
_COMPILERS = ("g++", "c++", "clang++")


class NativeKernelError(RuntimeError):
    """The native CPU kernels cannot be built or loaded here."""


def find_compiler() -> str:
    """The C++ compiler to use: `$CXX`, else the first of g++, c++, clang++ on the PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else list(_COMPILERS)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise NativeKernelError(
        f"no C++ compiler found (looked for {', '.join(candidates)}): install one "
        "(e.g. `apt-get install g++`) or set CXX, or use the pure-XLA attention backend 'xla'"
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_name(compiler: str) -> str:
    """The file name of the library built from the current sources by `compiler` on this CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + path.read_bytes())
    for part in (version.encode(), repr(_FLAGS).encode(), jaxlib.__version__.encode()):
        digest.update(part)
    digest.update(platform.machine().encode() + _cpu_flags().encode())
    return f"libvllm_xla_cpu_{digest.hexdigest()[:20]}.so"


def build_library(build_dir: str | os.PathLike[str]) -> Path:
    """Compiles the kernels into `build_dir` unless that library is already there; returns its path.

    Builders of the same directory take turns (a file lock), so a process that finds another
    one building waits for that library instead of compiling it again.
    """
    compiler = find_compiler()
    build_dir = Path(build_dir)
    make_private_dir(str(build_dir))
    library = build_dir / library_name(compiler)
    _check_private(build_dir, library)
    if library.exists():
        return library
    with open_private(str(build_dir / ".build.lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not library.exists():
            _compile(compiler, library)
    return library


def _check_private(*paths: Path) -> None:
    """Refuses a build directory or library another user could have written, or replace, by the
    rule of `private_files` (itself, its directory, every ancestor): the library is loaded into
    this process, so it must be the one built here."""
    for path in paths:
        reason = unsafe_reason(str(path))
        if reason is not None:
            raise NativeKernelError(
                f"refusing to build or load the native kernels in {path}: {reason} (or set "
                "VLLM_XLA_CACHE_DIR to a private directory)"
            )


def _compile(compiler: str, library: Path) -> None:
    """One compiler process per source, side by side, then one link; the library appears whole."""
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        include = ["-I", jax.ffi.include_dir(), "-I", str(HEADERS[0].parent)]
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in SOURCES]
        _run_side_by_side(
            [
                [compiler, *_FLAGS, *include, "-c", str(s), "-o", o]
                for s, o in zip(SOURCES, objects, strict=True)
            ],
            Path(scratch),
        )
        partial = Path(scratch) / library.name
        _run_side_by_side([[compiler, *_FLAGS, *objects, "-o", str(partial)]], Path(scratch))
        # The linker creates it under the umask (group-writable under 002), and a library others
        # may write is refused on every later start: private, whatever the umask.
        os.chmod(partial, 0o700)
        os.replace(partial, library)  # atomic: concurrent loaders never see half a library


def _run_side_by_side(commands: list[list[str]], scratch: Path) -> None:
    """Runs the commands at once; the first that fails raises, quoting it and its errors."""
    logs = [scratch / f"command-{i}.log" for i in range(len(commands))]
    running = []
    for command, log in zip(commands, logs, strict=True):
        with open(log, "w") as out:  # a file, not a pipe: a long error log never blocks the compiler
            running.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
    codes = [process.wait() for process in running]
    for command, log, code in zip(commands, logs, codes, strict=True):
        if code != 0:
            raise NativeKernelError(
                f"building {' '.join(p.name for p in SOURCES)} failed ({' '.join(command)}):\n"
                f"{log.read_text(errors='replace')[-4000:]}"
            )


@dataclasses.dataclass(frozen=True)
class _Library:
    """A built library, equal to any copy of it (same name) in another build directory."""

    name: str
    path: Path = dataclasses.field(compare=False)


@functools.cache
@functools.cache
def _shared_object(library: _Library) -> ctypes.CDLL:
    """`library` loaded into this process, once, from the descriptor that was judged private
    (`private_files.open_private_file`): a file swapped in after the check is never loaded. Where
    `/proc/self/fd` is missing, by its path after the same check."""
    try:
        opened = open_private_file(str(library.path))
    except UnsafeCacheError as error:
        raise NativeKernelError(
            f"refusing to load the native kernels: {error}; use a private VLLM_XLA_CACHE_DIR"
        ) from error
    with opened:
        if not os.path.exists(f"/proc/self/fd/{opened.fileno()}"):
            return ctypes.CDLL(str(library.path))
        # A raw duplicate of the judged descriptor, never closed: the dynamic loader knows the
        # library by this name, and a closed descriptor's number, reused for another library,
        # would make the loader hand back this one.
        kept = os.dup(opened.fileno())
    return ctypes.CDLL(f"/proc/self/fd/{kept}")


@functools.cache
def _register(library: _Library) -> None:
    """Registers the handlers once per process and build: XLA keeps one handler per target name."""
    shared = _shared_object(library)
    try:
        for target, symbol in _HANDLERS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(shared, symbol)), platform="cpu")
    except Exception as error:
        raise NativeKernelError(
            f"cannot register {library.name} in this process ({error}); a process serves one build "
            "of the kernels: restart it to use another"
        ) from error


def load(build_dir: str | os.PathLike[str]) -> Path:
    """Builds (if needed) and registers the native kernels for this process; returns the library.

    Raises NativeKernelError, naming the cause and the way out, when no compiler is found or
    the build fails.
    """
    library = build_library(build_dir)
    _register(_Library(library.name, library))
    return library


def is_loaded() -> bool:
    """Whether `load` registered the kernels in this process."""
    return _register.cache_info().currsize > 0


def require_loaded(alternative: str = "") -> None:
    """Raise `NativeKernelError` naming the fix unless `load` registered the kernels here;
    `alternative` names another way out (", or use ...")."""
    if not is_loaded():
        raise NativeKernelError(
            f"the native CPU kernels are not loaded in this process: call "
            f"pallas_kernels.cpu.load(build_dir) first{alternative}"
        )


DENSE_ISAS = {1: "avx512_bf16", 2: "amx", 3: "avx2"}  # the dense kernel's paths, by their code in dense.cc
_DENSE_PREFERENCE = ("amx", "avx512_bf16", "avx2")


def dense_isas(library: Path) -> tuple[str, ...]:
    """The instruction sets `library` (from `load`) can run its bfloat16 dense kernel with in this
    process, best first: "amx" (AMX tiles with bfloat16, granted by the operating system),
    "avx512_bf16", and "avx2" (AVX2 with FMA, in float32)."""
    mask = _probe_dense_isas(_Library(library.name, library))
    codes = {name: code for code, name in DENSE_ISAS.items()}
    return tuple(name for name in _DENSE_PREFERENCE if mask & (1 << codes[name]))


def dense_isa(library: Path) -> str | None:
    """The best of `dense_isas`, or None: the dense layers stay on XLA's dots."""
    return next(iter(dense_isas(library)), None)


@functools.cache
def _probe_dense_isas(library: _Library) -> int:
    return int(_shared_object(library).VllmXlaDenseIsas())


def dense_f32_usable(library: Path) -> bool:
    """Whether `library` (from `load`) can run its float32 dense kernel (AVX2 with FMA) here."""
    return _probe_dense_f32(_Library(library.name, library))


@functools.cache
def _probe_dense_f32(library: _Library) -> bool:
    return bool(_shared_object(library).VllmXlaDenseF32Usable())


# the int8 kernel's paths, by their code in dense_int8.cc
DENSE_INT8_ISAS = {1: "avx512", 2: "avx512_bf16", 3: "avx2", 4: "avx512_vnni", 5: "amx"}
_DENSE_INT8_PREFERENCE = ("avx512_vnni", "amx", "avx512_bf16", "avx512", "avx2")


def dense_int8_isas(library: Path) -> tuple[str, ...]:
    """The instruction sets `library` (from `load`) can run its int8 dense kernel with in this
    process, best first: "avx512_vnni" (AVX-512 VNNI with VBMI: bfloat16 x in 16-bit fixed point,
    int8 products in int32 with VPDPBUSD; float32 x, and a call with values that are not finite,
    take the next path; past 16 rows of bfloat16 x with scales per column, "amx" where the CPU
    has it), "amx" (AMX bfloat16 tiles: as "avx512_bf16", each int8 panel widened once to
    bfloat16, the rows then multiplied on tiles, for K a multiple of 32 and scales per column;
    else as "avx512_bf16"), "avx512_bf16" (as "avx512" for a few rows; for more, with bfloat16 x,
    each int8 panel widened once to bfloat16 and multiplied with VDPBF16PS), "avx512" (AVX-512F:
    int8 widened to float32 in registers) and "avx2" (the same with AVX2 and FMA)."""
    mask = _probe_dense_int8_isas(_Library(library.name, library))
    codes = {name: code for code, name in DENSE_INT8_ISAS.items()}
    return tuple(name for name in _DENSE_INT8_PREFERENCE if mask & (1 << codes[name]))


@functools.cache
def _probe_dense_int8_isas(library: _Library) -> int:
    return int(_shared_object(library).VllmXlaDenseInt8Isas())


# the int4 kernel's paths, by their code in dense_int4.cc
DENSE_INT4_ISAS = {
    1: "avx2",
    2: "portable",
    3: "avx2_float",
    4: "avx512_bf16",
    5: "avx512_vnni",
    6: "amx",
    7: "avx512_float",
}
_DENSE_INT4_PREFERENCE = (
    "avx512_vnni", "amx", "avx512_bf16", "avx2", "avx512_float", "avx2_float", "portable"
)  # fmt: skip


def dense_int4_isas(library: Path) -> tuple[str, ...]:
    """The instruction sets `library` (from `load`) can run its int4 dense kernel with in this
    process, best first: "avx512_vnni" (AVX-512 VNNI and VBMI: "avx2"'s fixed point for up
    to 16 rows of bfloat16 x with VPDPBUSD; more rows as the next path), "amx" (AMX bfloat16
    tiles: as "avx512_bf16", each panel widened once, the rows then multiplied on tiles, for K a
    multiple of 32), "avx512_bf16" (AVX-512 BF16: as
    "avx2" for a few rows; for more, with
    bfloat16 x, each panel widened once to bfloat16 and multiplied with VDPBF16PS; float32 x takes
    the float product), "avx2" (AVX2: bfloat16 x in 16-bit fixed point, integer products of its
    byte planes with the nibbles; a call with values that are not finite takes "avx2_float"),
    "avx512_float" (AVX-512: "avx2_float"'s float product with a whole 16-column line a register and
    up to 8 rows sharing each widened line; the default for float32 x), "avx2_float" (AVX2 with
    FMA: nibbles widened to float32 in registers; float32 x's default without AVX-512) and
    "portable" (plain C++, on any CPU)."""
    mask = _probe_dense_int4_isas(_Library(library.name, library))
    codes = {name: code for code, name in DENSE_INT4_ISAS.items()}
    return tuple(name for name in _DENSE_INT4_PREFERENCE if mask & (1 << codes[name]))


@functools.cache
def _probe_dense_int4_isas(library: _Library) -> int:
    return int(_shared_object(library).VllmXlaDenseInt4Isas())
