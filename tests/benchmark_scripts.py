# SPDX-License-Identifier: Apache-2.0
"""Loads a script of `benchmarks/` as a module: the folder is not a package (its scripts run as
files), so its tests import them by path."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, *, register: bool = False) -> ModuleType:
    """`benchmarks/<name>.py` as a module named `name`; `register`: also entered in `sys.modules`
    first (a module whose dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
