# SPDX-License-Identifier: Apache-2.0
"""Server tests' helpers: a `vllm-xla serve` process (`serving`: started in its own session,
waited for until `/health` answers, stopped with its whole session when the block ends), a free
port, and GET / POST of JSON."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], log_path: Path, *, startup_seconds: float) -> Iterator[str]:
    """Runs `vllm-xla serve --host 127.0.0.1 --port <free> *args` with `env`, its output in
    `log_path`; yields the server's base URL once healthy."""
    port = free_port()
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
                    if get(f"{base}/health", timeout=2) is not None:
                        break
                except OSError:
                    pass
                assert time.time() < deadline, "server did not become healthy"
                time.sleep(1)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):  # a test may have ended it already
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
