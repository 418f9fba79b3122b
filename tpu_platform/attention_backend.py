# SPDX-License-Identifier: Apache-2.0
"""Which kernels a runner uses: the attention backend (building the native CPU kernels when it
picks them) and, with those, the instruction set bfloat16 dense layers run with."""

from __future__ import annotations

import logging
import os

from pallas_kernels import cpu
from pallas_kernels.backend import CPU_NATIVE, XLA, resolve_backend
from tpu_platform.envs import default_cache_dir

logger = logging.getLogger(__name__)


def native_build_dir(cache_dir: str | None) -> str:
    """Where the native kernels are built: `<cache_dir>/native`, else under the user's default
    cache directory (never a shared temporary directory, where another user could plant a library)."""
    return os.path.join(cache_dir or default_cache_dir(os.environ), "native")


def select_backend(requested: str, platform: str, cache_dir: str | None) -> str:
    """The backend for `requested` ("auto" or a name) on `platform`.

    "auto" on CPU means `cpu_native` when its kernels build here, else `xla` with a warning that
    says why; an explicit `cpu_native` that cannot build is an error. Elsewhere "auto" picks by
    device kind (`resolve_backend`).
    """
    wants_native = requested == CPU_NATIVE or (requested == "auto" and platform == "cpu")
    if not wants_native:
        return resolve_backend(requested, platform=platform)
    resolve_backend(CPU_NATIVE, platform=platform)  # rejects cpu_native off CPU
    try:
        library = cpu.load(native_build_dir(cache_dir))
    except cpu.NativeKernelError as error:
        if requested == CPU_NATIVE:
            raise
        logger.warning("native CPU attention unavailable, using the slower 'xla' backend: %s", error)
        return XLA
    logger.info("native CPU attention kernels: %s", library)
    return CPU_NATIVE


def native_dense_isa(backend: str, cache_dir: str | None) -> str | None:
    """The instruction set of the `cpu_native` backend's dense kernel here ("amx", "avx512_bf16" or
    "avx2"), or None when the backend is another one or the CPU has none of them."""
    if backend != CPU_NATIVE:
        return None
    return cpu.dense_isa(cpu.load(native_build_dir(cache_dir)))
