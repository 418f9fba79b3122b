# SPDX-License-Identifier: Apache-2.0
"""`python -m pallas_kernels.cpu BUILD_DIR`: builds the native CPU kernels there (if they are not
already) and prints the library's path; e.g. to build them ahead of a server's start."""

from __future__ import annotations

import argparse
import sys

from pallas_kernels.cpu.build import NativeKernelError, build_library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.cpu", description=__doc__)
    parser.add_argument("build_dir", help="where the library goes, e.g. $VLLM_XLA_CACHE_DIR/native")
    try:
        print(build_library(parser.parse_args(argv).build_dir))
    except NativeKernelError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
