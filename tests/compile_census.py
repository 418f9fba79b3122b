# SPDX-License-Identifier: Apache-2.0
"""Where a run's compile time goes: JAX's duration events (XLA compiles, lowerings, traces,
persistent-cache loads) summed per test file, one JSON file a test process.

Not loaded by default: `pytest -p tests.compile_census --compile-census DIR ...` writes
`DIR/<worker>.json` (`{"events": {file: {event: [count, seconds]}}}`) when the session ends.
Processes a test starts (simulated hosts, the TPU and GPU compile workers) are not counted.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

_CENSUS = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-census", metavar="DIR", help="write JAX's duration events, summed per test file, to DIR"
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("compile_census"):
        return
    import jax.monitoring

    census = {"current": "<collection>", "events": {}}
    config.stash[_CENSUS] = census

    def count(event: str, duration: float, **_: object) -> None:
        entry = census["events"].setdefault(census["current"], {}).setdefault(event, [0, 0.0])
        entry[0] += 1
        entry[1] += duration

    jax.monitoring.register_event_duration_secs_listener(count)


def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    census = item.config.stash.get(_CENSUS, None)
    if census is not None:
        census["current"] = item.nodeid.split("::")[0]


def pytest_sessionfinish(session: pytest.Session) -> None:
    census = session.config.stash.get(_CENSUS, None)
    if census is None or not census["events"]:  # pytest-xdist's controller runs no test
        return
    directory = pathlib.Path(session.config.getoption("compile_census"))
    directory.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (directory / f"{worker}.json").write_text(json.dumps({"events": census["events"]}, indent=1))
