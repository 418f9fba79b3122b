# SPDX-License-Identifier: Apache-2.0
"""How `make test` hands test files to its two pytest-xdist workers (`tests/conftest.py`'s
scheduler): the real-size step compiles to one worker and the layer-sized compiles to the other,
first, each as one unit; every other file whole to one worker."""

from __future__ import annotations

import types

import pytest

from tests import conftest
from tests.aot import units

pytest.importorskip("xdist")

COLLECTION = [
    "tests/models/test_llama.py::test_a",
    "tests/models/test_llama.py::test_b",
    "tests/models/test_llama.py::test_c",
    "tests/pallas_kernels/test_cpu_dense.py::test_a",
    "tests/pallas_kernels/test_cpu_dense.py::test_b",
    # Units of three tests and more: a worker is given a second unit when two tests are left.
    "tests/aot/test_model_step.py::test_a",
    "tests/aot/test_model_step.py::test_b",
    "tests/aot/test_tensor_parallel_step.py::test_a",
    "tests/aot/test_compile_kernels_tpu.py::test_a",
    "tests/aot/test_compile_kernels_tpu.py::test_b",
    "tests/aot/test_mla_compile.py::test_a",
    *(f"tests/pallas_kernels/test_reference.py::test_{i}" for i in range(8)),
]


class _Node:
    """What the scheduler asks of a worker: tests to run, and to stop."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _config(dist: str) -> types.SimpleNamespace:
    option = types.SimpleNamespace(dist=dist, tx=["2*popen"], loadscopereorder=True)
    return types.SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))


def _first_units(scheduler, nodes: list[_Node]) -> list[set[str]]:
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    return [{COLLECTION[i].split("::")[0] for i in node.sent} for node in nodes]


def test_the_two_compile_units_go_first_one_to_each_worker():
    scheduler = conftest.pytest_xdist_make_scheduler(_config("loadfile"), None)
    steps, layers = _first_units(scheduler, [_Node("gw0"), _Node("gw1")])
    assert steps == {"tests/aot/test_model_step.py", "tests/aot/test_tensor_parallel_step.py"}
    assert layers == {"tests/aot/test_compile_kernels_tpu.py", "tests/aot/test_mla_compile.py"}


def test_files_elsewhere_are_their_own_units():
    assert units.unit_of("tests/models/test_llama.py::test_a") is None
    assert units.unit_of("tests/aot/test_model_step.py::test_a[v6e-1]") == units.STEP_UNIT
    assert units.unit_of("tests/aot/test_mla_compile.py::test_a") == units.LAYER_UNIT
    assert units.lock_name("test_mla_compile.py") != units.lock_name("test_model_step.py")


def test_every_layer_module_exists():
    aot = conftest._REPO / units.AOT_DIR
    assert units.LAYER_MODULES <= {path.name for path in aot.glob("test_*.py")}


def test_other_distributions_keep_xdist_s_scheduler():
    assert conftest.pytest_xdist_make_scheduler(_config("load"), None) is None
