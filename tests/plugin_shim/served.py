# SPDX-License-Identifier: Apache-2.0
"""A `vllm-xla serve` process for server tests: started in its own session, waited for until
`/health` answers, stopped (the whole session) when the test module is done."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.plugin_shim.test_serve import REPO, _free_port, _get


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], log_path: Path, *, startup_seconds: float) -> Iterator[str]:
    """Runs `vllm-xla serve --host 127.0.0.1 --port <free> *args` with `env`, its output in
    `log_path`; yields the server's base URL once healthy."""
    port = _free_port()
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-xla")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [cli, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + startup_seconds
            while True:
                assert process.poll() is None, log_path.read_text()[-3000:]
                try:
                    if _get(f"{base}/health", timeout=2) is not None:
                        break
                except OSError:
                    pass
                assert time.time() < deadline, "server did not become healthy"
                time.sleep(1)
            yield base
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
