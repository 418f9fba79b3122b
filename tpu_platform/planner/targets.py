# SPDX-License-Identifier: Apache-2.0
"""Compile-only accelerator targets: real TPU and GPU compilers without the hardware.

`compile_only_devices("v6e-4")` gives JAX devices of a named target that programs can be
compiled for (`jax.jit(f).trace(*abstract).lower().compile()`) but never run: the TPU ones come
from `libtpu`'s compile-only topologies, the GPU ones from JAX's CUDA plugin given the GPU's
device facts (a `GpuTargetConfigProto` text in `device_facts/`). A compiled program's
`memory_analysis()` then says what it needs per chip, against the chip's `hbm_bytes` here.

Neither toolchain is a runtime dependency: they are installed beside the project for its compile
tests and planner (docs/testing.md, "Compiling for TPU and GPU without them") and run in processes started
with `JAX_PLATFORMS=cpu`, so nothing here makes JAX look for a device.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

import jax
import numpy as np
from jax.sharding import Mesh

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class CompileTarget:
    """One named target: which compiler, which topology, and the chip's memory facts."""

    name: str
    platform: str  # "tpu" or "cuda"
    topology: str  # libtpu's topology name (TPU) or JAX's "hosts x ... x devices" shape (GPU)
    num_chips: int  # chips a program may use; a TPU topology may hold more (v5e/v6e come in 2x2)
    hbm_bytes: int  # memory per chip
    hbm_bytes_per_second: float  # peak memory bandwidth per chip (the roofline's denominator)
    bf16_flops_per_second: float  # peak dense bfloat16 matmul rate per chip
    device_facts: str = ""  # GPU only: the GpuTargetConfigProto file in device_facts/

    @property
    def chip(self) -> str:
        """The chip kind, e.g. `v6e` or `h100`."""
        return self.name.split("-")[0].split("x")[0]


def _tpu(name: str, topology: str, chips: int, hbm_gib: float, gbps: float, tflops: float) -> CompileTarget:
    return CompileTarget(name, "tpu", topology, chips, int(hbm_gib * GIB), gbps * 1e9, tflops * 1e12)


def _gpu(name: str, facts: str, chips: int, hbm_bytes: int, gbps: float, tflops: float) -> CompileTarget:
    return CompileTarget(name, "cuda", f"1x1x{chips}", chips, hbm_bytes, gbps * 1e9, tflops * 1e12, facts)


# Chip facts: HBM per chip, its peak bandwidth and peak dense bfloat16 TFLOP/s (no sparsity),
# from the vendors' published specifications.
# libtpu builds v5e/v6e topologies from whole 2x2 hosts, so the one-chip targets use one device
# of a 2x2 topology; v5p and v4 counts are chips (a v5p-8 slice has 4 chips, 8 TensorCores).
TARGETS: dict[str, CompileTarget] = {
    t.name: t
    for t in (
        _tpu("v5e-1", "v5e:2x2", 1, 16, 819, 197),
        _tpu("v5e-4", "v5e:2x2", 4, 16, 819, 197),
        _tpu("v5e-8", "v5e:2x4", 8, 16, 819, 197),
        _tpu("v5e-16", "v5e:4x4", 16, 16, 819, 197),
        _tpu("v6e-1", "v6e:2x2", 1, 32, 1640, 918),
        _tpu("v6e-4", "v6e:2x2", 4, 32, 1640, 918),
        _tpu("v6e-8", "v6e:2x4", 8, 32, 1640, 918),
        _tpu("v6e-16", "v6e:4x4", 16, 32, 1640, 918),
        _tpu("v5p-8", "v5p:2x2x1", 4, 95, 2765, 459),
        _tpu("v4-8", "v4:2x2x1", 4, 32, 1200, 275),
        _gpu("h100x1", "h100.txtpb", 1, 84_942_979_072, 3352, 989),
        _gpu("h100x8", "h100.txtpb", 8, 84_942_979_072, 3352, 989),
        _gpu("h200x1", "h200.txtpb", 1, 150_755_278_848, 4800, 989),
        _gpu("h200x8", "h200.txtpb", 8, 150_755_278_848, 4800, 989),
        _gpu("a100x1", "a100.txtpb", 1, 85_100_068_864, 2039, 312),
        _gpu("a100x8", "a100.txtpb", 8, 85_100_068_864, 2039, 312),
        _gpu("l4x1", "l4.txtpb", 1, 23_670_685_696, 300, 121),
    )
}


def target(name: str) -> CompileTarget:
    """The target called `name`, or a ValueError listing the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]


def device_facts(filename: str) -> str:
    """The text of a GPU device-facts file shipped in `tpu_platform/planner/device_facts/`."""
    return resources.files("tpu_platform.planner").joinpath("device_facts", filename).read_text()


@functools.cache
def _topology_devices(platform: str, topology: str, facts: str) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies

    try:
        if platform == "tpu":
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
        else:
            desc = topologies.get_topology_desc(
                topology_name="", platform="cuda", target_config=device_facts(facts), topology=topology
            )
    except Exception as e:  # the plugin's own errors are RuntimeError/JaxRuntimeError/ValueError
        toolchain = "libtpu (pip install 'libtpu==0.0.42.*')" if platform == "tpu" else "jax-cuda12-plugin"
        raise RuntimeError(
            f"cannot build compile-only {platform} devices for {topology!r} ({e}); is {toolchain} "
            "importable in this process? `make aot-toolchains` installs both into .aot/"
        ) from e
    return tuple(desc.devices)


def compile_only_devices(name: str) -> list[jax.Device]:
    """The `num_chips` compile-only devices of target `name` (programs compile for them; none runs)."""
    t = target(name)
    devices = _topology_devices(t.platform, t.topology, t.device_facts)
    return list(devices[: t.num_chips])


def compile_only_mesh(name: str, axis_names: tuple[str, ...] = ("model",)) -> Mesh:
    """A mesh over target `name`'s compile-only devices: all on the last axis, 1 on the others."""
    devices = compile_only_devices(name)
    shape = (1,) * (len(axis_names) - 1) + (len(devices),)
    return Mesh(np.array(devices).reshape(shape), axis_names)
