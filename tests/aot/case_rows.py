# SPDX-License-Identifier: Apache-2.0
"""A session's answers of the per-case compile workers, so that a case two modules compile is
compiled once (the bfloat16 twin of Llama-3.2-3B's 2-layer step on v5e: test_int8_step.py's and
test_fp8_step.py's). A worker answers one JSON row a case, named by its `case` field; the
session fixture `case_rows` (`tests/aot/conftest.py`) holds one `CaseRows` for the run."""

from __future__ import annotations

from tests.aot.toolchains import run_worker


class CaseRows:
    """Rows of `python -m tests.aot.<module> *leading CASE ...` by case, each compiled once."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str, tuple[str, ...], str], dict] = {}

    def get(self, platform: str, module: str, leading: tuple[str, ...], cases: tuple[str, ...]) -> dict:
        """Each of `cases`' rows, compiling in one worker run those no earlier call compiled."""
        key = (platform, module, leading)
        missing = [case for case in cases if (*key, case) not in self._rows]
        if missing:
            for row in run_worker(platform, module, *leading, *missing, timeout=3500):
                self._rows[(*key, row["case"])] = row
        return {case: self._rows[(*key, case)] for case in cases}
