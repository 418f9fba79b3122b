# SPDX-License-Identifier: Apache-2.0
"""A worker's part in serving across hosts (docs/multihost.md): join JAX's hosts, then vLLM's.

Each host's one worker joins JAX's multi-controller runtime (`tpu_platform.hosts`) from vLLM's
multi-node options, then vLLM's own process group (torch gloo, one rank a host), over which vLLM's
executor builds its multi-node message queues: every step's `SchedulerOutput` reaches every host's
worker through them. No tensor crosses that group; the devices' exchanges are XLA's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import jax

from tpu_platform.envs import read_env
from tpu_platform.hosts import HostGroup, coordinator_address, join_hosts

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def host_group(vllm_config: VllmConfig) -> HostGroup | None:
    """This host's place among the hosts from vLLM's options, or None on one host."""
    parallel = vllm_config.parallel_config
    if parallel.nnodes <= 1:
        return None
    return HostGroup(
        coordinator_address=coordinator_address(parallel.master_addr, parallel.master_port),
        num_hosts=parallel.nnodes,
        host_rank=parallel.node_rank,
        timeout_seconds=parallel.distributed_timeout_seconds,
    )


def join(vllm_config: VllmConfig, rank: int, local_rank: int, init_method: str) -> None:
    """Joins JAX's hosts, then vLLM's process group of one rank a host; nothing on one host.

    JAX first: its join is the one with a bounded wait and a clear error for a missing host."""
    group = host_group(vllm_config)
    if group is None:
        return
    if rank != group.host_rank:
        raise RuntimeError(
            f"vLLM started worker rank {rank} on --node-rank {group.host_rank}: vllm-xla runs one "
            "worker a host (see docs/multihost.md)"
        )
    join_hosts(group, read_env().platform)
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    parallel = vllm_config.parallel_config
    seconds = parallel.distributed_timeout_seconds
    init_distributed_environment(
        parallel.world_size,
        rank,
        init_method,
        local_rank,
        "gloo",
        timedelta(seconds=seconds) if seconds else None,
    )
    ensure_model_parallel_initialized(
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.prefill_context_parallel_size,
        parallel.decode_context_parallel_size,
    )


def replies(vllm_config: VllmConfig, rank: int) -> bool:
    """Whether vLLM reads this worker's step outputs: its executor reads one rank's,
    `world_size - tensor_parallel_size * prefill_context_parallel_size` (`MultiprocExecutor.
    _get_output_rank`): host 0's worker across hosts, the one worker on one host."""
    parallel = vllm_config.parallel_config
    return (
        rank == parallel.world_size - parallel.tensor_parallel_size * parallel.prefill_context_parallel_size
    )


# The context of a step on one host: no other host can be lost (stateless, so shared).
_ONE_HOST = contextlib.nullcontext()


def naming_lost_hosts(num_hosts: int) -> contextlib.AbstractContextManager[None]:
    """Across hosts, a step's XLA failure (a collective whose peer is gone) becomes an error that
    says what happened and what to do; vLLM's engine then stops and the server exits. On one
    host a step's errors pass as they are (and a generator-based context, a few microseconds a
    step, is not made)."""
    return _ONE_HOST if num_hosts < 2 else _naming_lost_hosts(num_hosts)


@contextlib.contextmanager
def _naming_lost_hosts(num_hosts: int) -> Iterator[None]:
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        raise RuntimeError(
            f"a step across {num_hosts} hosts failed in XLA, most likely because another host died "
            f"or left mid-step; restart every host ({error})"
        ) from error
