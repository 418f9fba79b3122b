# SPDX-License-Identifier: Apache-2.0
"""Every test in this directory compiles for real TPU and GPU targets: they belong to the slow tier."""

import pathlib

import pytest

_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items: mark only this directory's.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.slow)
