# SPDX-License-Identifier: Apache-2.0
"""Runner counters shared across processes through a small JSON file.

The engine core (which owns the runner) and the API server (which owns the Prometheus registry)
are separate processes in a real deployment; the worker publishes its counters to a file at
most every `interval` seconds, and the stat logger in the server reads them back.
"""

from __future__ import annotations

import json
import os
import tempfile
import time


def metrics_path(cache_dir: str, instance_id: str, engine_index: int) -> str:
    """Where the runner of engine `engine_index` of the serving instance `instance_id` publishes."""
    return os.path.join(cache_dir, "metrics", f"{instance_id or 'default'}-{engine_index}.json")


class MetricsPublisher:
    """Writes a counter snapshot to `path` atomically, at most once per `interval` seconds."""

    def __init__(self, path: str, interval: float = 1.0):
        self.path = path
        self.interval = interval
        self._last = float("-inf")
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def due(self) -> bool:
        """Whether `publish` would write now (the interval has passed)."""
        return time.monotonic() - self._last >= self.interval

    def publish(self, snapshot: dict[str, float], *, force: bool = False) -> bool:
        """Writes `snapshot` if the interval has passed (or `force`); returns whether it wrote."""
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return False
        self._last = now
        fd, staging = tempfile.mkstemp(prefix=".metrics-", dir=os.path.dirname(self.path))
        with os.fdopen(fd, "w") as f:
            json.dump(snapshot, f)
        os.replace(staging, self.path)
        return True

    def remove(self) -> None:
        remove_metrics(self.path)


def remove_metrics(path: str) -> None:
    """Removes a runner's published snapshot, if there is one."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def read_metrics(path: str) -> dict[str, float] | None:
    """The last published snapshot, or None when there is none yet."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
