# SPDX-License-Identifier: Apache-2.0
"""Every test in this directory compiles for real TPU and GPU targets: they belong to the slow tier.

Their compiles of multi-billion-parameter programs take several GiB each, so one such module at a
time compiles, and one module of layer-sized programs beside it (`units.py`). Under `make test`
one pytest-xdist worker runs each of the two units (tests/conftest.py schedules them); the lock
file each module holds, its unit's, shared by the run's workers, keeps the rule under other
schedulings too."""

import fcntl
import pathlib
from collections.abc import Iterator

import pytest

from tests.aot.case_rows import CaseRows
from tests.aot.units import lock_name

_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items: mark only this directory's.
    # The timeout covers a module's wait for the lock below.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(3600))


@pytest.fixture(scope="module", autouse=True)
def one_compiling_module_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    # Under xdist each worker's base temp is `<run's directory>/popen-gwN`: the parent is the run's.
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if base.name.startswith("popen-gw") else base
    with open(run_dir / lock_name(request.path.name), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def case_rows() -> CaseRows:
    """The per-case compile workers' rows for the session: a case two modules compile, once."""
    return CaseRows()
