# SPDX-License-Identifier: Apache-2.0
"""Joining this process to the other hosts' (JAX's multi-controller runtime): one process per
host, every host running the same programs on one mesh over all of their devices.

Called once per process, before any JAX backend starts (`jax.distributed.initialize` must come
first). The coordinator is host 0's process; the address, count and rank come from the serving
options (vLLM's `--master-addr`, `--nnodes`, `--node-rank`), so a pod and two processes on one
machine take the same path. JAX's coordinator authenticates nobody, so host 0's listens on the
master address alone (`coordinator_bind_address`), never on every interface; the network
around it must still keep other machines out (docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np

logger = logging.getLogger(f"vllm_xla.{__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class HostGroup:
    """Where host 0's coordinator listens, how many hosts there are and which one this is."""

    coordinator_address: str  # "host:port"
    num_hosts: int
    host_rank: int
    # Bounds the join and the time a silent host is taken for alive (None: JAX's defaults).
    timeout_seconds: int | None = None

    def __post_init__(self) -> None:
        if self.num_hosts < 2:
            raise ValueError(f"a host group has at least 2 hosts, got {self.num_hosts}")
        if not 0 <= self.host_rank < self.num_hosts:
            raise ValueError(f"host rank {self.host_rank} is not in [0, {self.num_hosts})")
        if self.timeout_seconds is not None and self.timeout_seconds < 1:
            raise ValueError(f"the hosts' timeout must be at least 1 s, got {self.timeout_seconds}")


# JAX's defaults, named in the errors when no timeout is given.
DEFAULT_JOIN_SECONDS = 300
DEFAULT_HEARTBEAT_SECONDS = 100


def coordinator_address(master_addr: str, master_port: int) -> str:
    """JAX's coordinator beside vLLM's: the port after `master_port`, which vLLM's store takes."""
    return f"{master_addr}:{master_port + 1}"


def join_hosts(group: HostGroup, platform: str | None) -> None:
    """Joins this process to `group`, or raises a RuntimeError naming the hosts and the timeout.

    On CPU the cross-process collectives are gloo (XLA:CPU has no others built in)."""
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    join = group.timeout_seconds or DEFAULT_JOIN_SECONDS
    heartbeat = group.timeout_seconds or DEFAULT_HEARTBEAT_SECONDS
    # Said before the wait: JAX ends a process whose hosts do not all join with its own message.
    logger.info(
        "joining %d hosts as host %d at %s: waiting up to %d s for every host to join; a host "
        "silent for %d s is taken for dead (--distributed-timeout-seconds)",
        group.num_hosts, group.host_rank, group.coordinator_address, join, heartbeat,
    )  # fmt: skip
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator_address,
            # Host 0's coordinator has no authentication: it listens on the master address only,
            # not on every interface (JAX's default), so only that network reaches it.
            coordinator_bind_address=group.coordinator_address,
            num_processes=group.num_hosts,
            process_id=group.host_rank,
            initialization_timeout=join,
            heartbeat_timeout_seconds=heartbeat,
        )
    except Exception as error:  # JAX raises XlaRuntimeError/RuntimeError/ValueError variously
        raise RuntimeError(
            f"host {group.host_rank} of {group.num_hosts} could not join the hosts at "
            f"{group.coordinator_address} within {join} s: every host must start with the same "
            "--nnodes and --master-addr/--master-port and its own --node-rank, and --master-addr must "
            "be an address of host 0 itself (its coordinator listens there only); the timeout is "
            f"--distributed-timeout-seconds ({error})"
        ) from error
    check_joined(group)


def check_joined(group: HostGroup) -> None:
    """A RuntimeError when JAX's view of the hosts differs from `group` (e.g. two hosts started
    with the same rank, or a TPU slice with another number of hosts)."""
    count, index = jax.process_count(), jax.process_index()
    if (count, index) != (group.num_hosts, group.host_rank):
        raise RuntimeError(
            f"JAX sees this process as host {index} of {count}, but it was started as "
            f"--node-rank {group.host_rank} of --nnodes {group.num_hosts}"
        )


def per_host_devices(
    tp_size: int, num_hosts: int, devices: Sequence[jax.Device] | None = None
) -> list[jax.Device]:
    """The mesh's devices: the first `tp_size / num_hosts` local devices of every process, in
    process order (each host's share contiguous on the model axis). `devices`: all processes'
    (default `jax.devices()`; a compile-only pod topology's devices carry their hosts too)."""
    if tp_size % num_hosts:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not split over {num_hosts} hosts; use a multiple "
            f"of --nnodes ({num_hosts})"
        )
    share = tp_size // num_hosts
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    ):
        by_process.setdefault(device.process_index, []).append(device)
    short = {p: len(ds) for p, ds in by_process.items() if len(ds) < share}
    if len(by_process) != num_hosts or short:
        raise ValueError(
            f"tensor_parallel_size={tp_size} over {num_hosts} hosts needs {share} devices on each, "
            f"but the hosts have {dict(sorted((p, len(ds)) for p, ds in by_process.items()))}; "
            f"use --tensor-parallel-size {num_hosts * min(len(ds) for ds in by_process.values())}"
        )
    return [d for p in sorted(by_process) for d in by_process[p][:share]]


# An outcome's message, as gathered: longer ones are cut (the host that has it logs it whole).
_MESSAGE_BYTES = 1024
_DIGEST_BYTES = 32


def agree_across_hosts(error: str | None, digest: bytes) -> list[tuple[str | None, bytes]]:
    """Every host's `(error or None, digest)` of the same step of work, in host order, so that all
    hosts take one decision (e.g. whether an adapter is loaded). A collective: every host calls it
    at the same point, as they do for the calls and steps vLLM sends to every host's worker."""
    from jax.experimental import multihost_utils

    if len(digest) > _DIGEST_BYTES:
        raise ValueError(f"a digest of at most {_DIGEST_BYTES} bytes, got {len(digest)}")
    message = (error or "").encode()[:_MESSAGE_BYTES]
    row = np.zeros(2 + _DIGEST_BYTES + 2 + _MESSAGE_BYTES, np.uint8)
    row[0], row[1] = error is not None, len(digest)
    row[2 : 2 + len(digest)] = np.frombuffer(digest, np.uint8)
    start = 2 + _DIGEST_BYTES
    row[start : start + 2] = divmod(len(message), 256)
    row[start + 2 : start + 2 + len(message)] = np.frombuffer(message, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)
    outcomes = []
    for host in gathered:
        length = int(host[start]) * 256 + int(host[start + 1])
        text = bytes(host[start + 2 : start + 2 + length]).decode(errors="replace")
        outcomes.append((text if host[0] else None, bytes(host[2 : 2 + int(host[1])])))
    return outcomes
