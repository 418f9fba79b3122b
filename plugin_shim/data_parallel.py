# SPDX-License-Identifier: Apache-2.0
"""vLLM's data parallelism on this platform: `--data-parallel-size N` replicas of the model, each
vLLM's own engine process with its own scheduler and one worker driving its own share of the
host's devices (N x TP of them), the front end spreading requests over the replicas.

vLLM runs the replicas of a dense model as independent engines (a DP rank of one each) and those
of an MoE model in lock step (an idle rank runs a dummy step while another works, so that
expert-parallel collectives line up). Without `--enable-expert-parallel` our step has no
collective across replicas (each holds every expert), so a dummy step does nothing. With it,
every replica's step (on its TP devices) is one program over all of them, the experts split by
index over every replica's devices (`tpu_platform.replica_step`): the ranks' processes join one
JAX job at start (`join_replicas`), every step agrees on the padded shape, and an idle rank's
dummy step takes its part (`Runner.dummy_step`).

Which devices an engine process drives is vLLM's choice (`assigned_physical_gpu_ids`: each local
DP rank's slice of the host's devices, or of `--device-ids`), fixed before its JAX starts a
backend: GPUs by JAX's `jax_cuda_visible_devices`, TPU chips by the runtime's per-process
variables (chip bounds, visible chips, a port of its own), simulated CPU devices by nothing (each
process has its own). vLLM's engine launcher writes every local DP rank's slice into its
configuration before starting it (on a platform that is not CUDA's), after a dense replica's DP
size is reset to one too. Replicas started one by one (`--data-parallel-rank`: external load
balancing; `--data-parallel-start-rank` on a host with its own API server: hybrid) are vLLM's
too; `vllm-xla serve` links their servers so that one that dies ends the others
(`plugin_shim.vllm_serve`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Set by `plugin_shim.vllm_serve` once this host joined the hosts' liveness link (its address):
# replicas across hosts are refused without it, since no dead host would end the others.
LINK_KEY = "xla_data_parallel_liveness_link"
# A TPU process's chips, by their count: the bounds of the box they form on one host.
_TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
_TPU_FIRST_PORT = 8476  # the TPU runtime's own default, offset by a replica's first chip


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    """The devices one engine process drives: a DP replica's share of its host's, or the ones
    `--device-ids` names."""

    device_ids: tuple[int, ...]


def replica(vllm_config: VllmConfig) -> Replica | None:
    """This engine process's devices as vLLM assigned them (`assigned_physical_gpu_ids`: its
    local DP rank's slice of the host's devices, or of `--device-ids`), or None: all of them."""
    assigned = getattr(vllm_config.parallel_config, "assigned_physical_gpu_ids", None)
    return Replica(device_ids=tuple(int(i) for i in assigned)) if assigned else None


def claim_devices(rep: Replica, platform: str | None) -> dict[str, str]:
    """Makes this process see only `rep`'s devices (before any JAX backend starts); the TPU
    runtime variables it set, for the log. On CPU nothing needs doing: a process's simulated
    devices are its own, so no two processes ever share one."""
    if platform == "cpu":
        return {}
    ids = ",".join(str(i) for i in rep.device_ids)
    if platform in (None, "gpu", "cuda"):
        import jax

        jax.config.update("jax_cuda_visible_devices", ids)
    if platform not in (None, "tpu"):
        return {}
    bounds = _TPU_CHIP_BOUNDS.get(len(rep.device_ids))
    if bounds is None:
        raise ValueError(
            f"a data-parallel replica of {len(rep.device_ids)} TPU chips is not a box of one "
            f"host; use --tensor-parallel-size 1, 2, 4 or 8 with --data-parallel-size"
        )
    port = _TPU_FIRST_PORT + min(rep.device_ids)  # the first chip's own: disjoint replicas differ
    runtime = {
        "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": ids,
        "TPU_PROCESS_PORT": str(port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
    }
    os.environ.update(runtime)
    return runtime


def expert_replicas(vllm_config: VllmConfig) -> int:
    """The data-parallel replicas this engine's step runs with in one program: vLLM's
    `data_parallel_size` when the experts are split over them (`--enable-expert-parallel`; vLLM
    keeps it only for an MoE model's replicas), else 1."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and parallel.enable_expert_parallel:
        return parallel.data_parallel_size
    return 1


def join_replicas(vllm_config: VllmConfig, platform: str | None) -> None:
    """Joins this rank's process to the other ranks' in one JAX job (before any JAX backend
    starts), rank 0's process the coordinator on vLLM's next data-parallel port (each rank takes
    the same one: vLLM hands its ranks the ports in the same order)."""
    from tpu_platform.hosts import HostGroup, join_hosts

    parallel = vllm_config.parallel_config
    address = f"{parallel.data_parallel_master_ip}:{parallel.get_next_dp_init_port()}"
    seconds = parallel.distributed_timeout_seconds
    group = HostGroup(address, parallel.data_parallel_size, parallel.data_parallel_rank, seconds)
    join_hosts(group, platform)


def replica_agreement(vllm_config: VllmConfig) -> Callable[[int], int]:
    """`most(value)`: the largest of every rank's `value`, over a gloo group of the ranks'
    processes (on vLLM's next data-parallel port, after `join_replicas`'s). On the host, not a
    JAX program: a collective program of its own, with no input from the step in flight, could
    run beside that step's program, and their exchanges would interleave."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    parallel = vllm_config.parallel_config
    group = stateless_init_torch_distributed_process_group(
        parallel.data_parallel_master_ip, parallel.get_next_dp_init_port(), parallel.data_parallel_rank,
        parallel.data_parallel_size, backend="gloo",
    )  # fmt: skip

    def most(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(tensor.item())

    return most
