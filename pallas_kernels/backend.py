# SPDX-License-Identifier: Apache-2.0
"""Attention backend names and their selection from the device kind."""

from __future__ import annotations

import jax

XLA = "xla"
PALLAS_TPU = "pallas_tpu"
PALLAS_GPU = "pallas_gpu"
CPU_NATIVE = "cpu_native"
BACKENDS = (XLA, PALLAS_TPU, PALLAS_GPU, CPU_NATIVE)

_BACKEND_FOR_PLATFORM = {"tpu": PALLAS_TPU, "gpu": PALLAS_GPU, "cuda": PALLAS_GPU, "cpu": XLA}
_PLATFORMS_FOR_BACKEND = {XLA: None, PALLAS_TPU: ("tpu",), PALLAS_GPU: ("gpu", "cuda"), CPU_NATIVE: ("cpu",)}


def default_platform() -> str:
    """The platform of JAX's default device: 'tpu', 'gpu' or 'cpu'. A device (or platform name)
    set with `jax.default_device` comes first: programs traced under it are built for that
    device, which may be a compile-only TPU or GPU of `tpu_platform.planner.targets`."""
    chosen = jax.config.jax_default_device
    if chosen is not None:
        return chosen if isinstance(chosen, str) else chosen.platform
    return jax.devices()[0].platform


def resolve_backend(backend: str = "auto", *, platform: str | None = None, interpret: bool = False) -> str:
    """Turns "auto" into the backend for the device kind and checks an explicit choice.

    A Pallas backend runs on its own device kind, or anywhere in interpret mode (tests). The
    `xla` backend runs everywhere; `cpu_native` (C++ through XLA FFI, built by
    `pallas_kernels.cpu.load`) on CPU only. "auto" never picks `cpu_native`, which needs a build
    step: the caller that can build it opts in.
    """
    platform = platform or default_platform()
    if backend == "auto":
        if platform not in _BACKEND_FOR_PLATFORM:
            raise ValueError(f"no attention backend for JAX platform {platform!r}; choose one of {BACKENDS}")
        return _BACKEND_FOR_PLATFORM[platform]
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {BACKENDS}")
    allowed = _PLATFORMS_FOR_BACKEND[backend]
    if backend == CPU_NATIVE and platform != "cpu":
        raise ValueError(f"attention backend {backend!r} runs on CPU only, but JAX runs on {platform!r}")
    if allowed is not None and platform not in allowed and not interpret:
        raise ValueError(
            f"attention backend {backend!r} needs a {allowed[0].upper()} device but JAX runs on "
            f"{platform!r}; use backend 'xla' (or 'auto') here, or interpret=True in tests"
        )
    return backend
