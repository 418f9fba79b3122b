# SPDX-License-Identifier: Apache-2.0
"""The tensor-parallel device mesh of one host: vLLM's `tensor_parallel_size` local devices on
one axis (`models.sharding.MODEL_AXIS`), driven by this one process.

TP=1 has no mesh at all: the runner then places everything on one device as it always did, so
one device pays nothing for the option.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.sharding import MODEL_AXIS, check_model_splits
from tpu_platform.hosts import per_host_devices


def check_devices(tp_size: int, devices: Sequence[jax.Device]) -> None:
    """A ValueError naming the fix when `tp_size` local devices are not there."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size > len(devices):
        platform = devices[0].platform if devices else "none"
        hint = (
            "; on CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N"
            if platform == "cpu"
            else ""
        )
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs {tp_size} devices, but this host has {len(devices)} "
            f"{platform} device(s); use --tensor-parallel-size {len(devices)} or less{hint}"
        )


def tensor_parallel_mesh(tp_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """A one-axis mesh over the first `tp_size` local devices, or None for `tp_size == 1`.

    Joined to other hosts (`tpu_platform.hosts`), the mesh spans every host's devices: an equal
    share of each, in host order."""
    if devices is None and jax.process_count() > 1:
        return Mesh(np.array(per_host_devices(tp_size, jax.process_count())), (MODEL_AXIS,))
    devices = list(jax.local_devices() if devices is None else devices)
    check_devices(tp_size, devices)
    if tp_size == 1:
        return None
    return Mesh(np.array(devices[:tp_size]), (MODEL_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of `mesh` holds the whole array (step inputs, logits, sampled tokens)."""
    return NamedSharding(mesh, PartitionSpec())


def check_model_fits_mesh(config: ModelConfig, tp_size: int, *, expert_parallel: bool = False) -> None:
    """A ValueError naming the dimension and the sizes that work when the model's heads or another
    dimension the rules table splits (`models.sharding.check_model_splits`) do not split `tp_size`
    ways (under `expert_parallel`, the experts themselves)."""
    check_model_splits(config, tp_size, expert_parallel=expert_parallel)
