# SPDX-License-Identifier: Apache-2.0
"""Runner counters shared across processes through a small JSON file.

The engine core (which owns the runner) and the API server (which owns the Prometheus registry)
are separate processes in a real deployment; the worker publishes its counters to a file at
most every `interval` seconds, and the stat logger in the server reads them back.

The file is a side channel: a write that fails (disk full, read-only directory) is logged once
and skipped, never raised into the engine, and a file that is not a snapshot (malformed,
truncated, foreign, too large) is refused with its reason, never handed on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(f"vllm_xla.{__name__}")

# A snapshot is a few hundred bytes: anything much larger is not one, and is not read whole.
MAX_SNAPSHOT_BYTES = 64 * 1024


# A snapshot's count of the tokens routed to expert e, summed over the MoE layers, is
# `EXPERT_TOKENS + str(e)`: under expert parallelism the device holding expert index e holds it
# in every layer, and one count per expert keeps the snapshot small for hundreds of experts.
EXPERT_TOKENS = "expert_tokens."


def expert_token_counts(load: np.ndarray | None) -> dict[str, float]:
    """The snapshot's entries for a runner's `[L, E]` tokens per expert (none for a dense model)."""
    if load is None:
        return {}
    return {f"{EXPERT_TOKENS}{e}": float(n) for e, n in enumerate(load.sum(axis=0).tolist())}


class MetricsFileError(ValueError):
    """A metrics file that is not a counter snapshot; the message says what is wrong with it."""


def metrics_path(cache_dir: str, instance_id: str, engine_index: int) -> str:
    """Where the runner of engine `engine_index` of the serving instance `instance_id` publishes."""
    return os.path.join(cache_dir, "metrics", f"{instance_id or 'default'}-{engine_index}.json")


class MetricsPublisher:
    """Writes a counter snapshot to `path` atomically, at most once per `interval` seconds.

    A failed write is logged the first time (and once more when writing works again) and
    counted in `failed_writes`; the next write is tried an interval later."""

    def __init__(self, path: str, interval: float = 1.0):
        self.path = path
        self.interval = interval
        self.failed_writes = 0
        self._last = float("-inf")
        self._failing = False

    def due(self) -> bool:
        """Whether `publish` would write now (the interval has passed)."""
        return time.monotonic() - self._last >= self.interval

    def publish(self, snapshot: dict[str, float], *, force: bool = False) -> bool:
        """Writes `snapshot` if the interval has passed (or `force`); returns whether it wrote."""
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return False
        self._last = now
        try:
            _write_atomically(self.path, json.dumps(snapshot))
        except OSError as error:
            self.failed_writes += 1
            if not self._failing:
                logger.warning(
                    "cannot publish the runner's counters to %s (%s); the engine carries on, and "
                    "the vllm_xla:* metrics stay at their last values until a write succeeds",
                    self.path, error,
                )  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            logger.info("publishing the runner's counters to %s again", self.path)
            self._failing = False
        return True

    def remove(self) -> None:
        remove_metrics(self.path)


def _write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` through a temporary file in its directory: readers never see part of it."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".metrics-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(staging, path)
    finally:
        Path(staging).unlink(missing_ok=True)  # gone already once replaced


def remove_metrics(path: str) -> None:
    """Removes a runner's published snapshot, if there is one."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as error:  # not ours to remove, or not a file: left as it is
        logger.debug("could not remove the metrics file %s (%s)", path, error)


def read_metrics(path: str) -> dict[str, float] | None:
    """The last published snapshot, or None when there is none yet.

    Raises `MetricsFileError` naming the problem when the file cannot be read or is not a
    snapshot: a JSON object of finite numbers by name, under `MAX_SNAPSHOT_BYTES`."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SNAPSHOT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise MetricsFileError(f"cannot read {path} ({error})") from error
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise MetricsFileError(f"{path} is larger than a counter snapshot ({MAX_SNAPSHOT_BYTES} bytes)")
    try:
        snapshot = json.loads(data)
    except (ValueError, RecursionError) as error:  # malformed, truncated, not UTF-8, too deep
        raise MetricsFileError(f"{path} is not JSON ({error})") from error
    if not isinstance(snapshot, dict):
        raise MetricsFileError(f"{path} holds a JSON {type(snapshot).__name__}, not a counter snapshot")
    bad = [k for k, v in snapshot.items() if not _is_count(v)]
    if bad:
        raise MetricsFileError(f"{path} has values that are not finite numbers: {sorted(bad)[:5]}")
    return snapshot


def _is_count(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
