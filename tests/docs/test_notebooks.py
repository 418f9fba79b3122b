# SPDX-License-Identifier: Apache-2.0
"""Every notebook in examples/ runs top to bottom from a clean kernel, and is committed without outputs.

The kernel inherits this process's environment (tests/conftest.py: CPU JAX, the test cache
directory, the in-process vLLM engine), so the notebooks share the suite's compiled programs and
native kernels. A cell that raises fails the test with the cell's traceback.
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbclient = pytest.importorskip("nbclient", reason="make test installs nbclient (Makefile PIN)")
nbformat = pytest.importorskip("nbformat")

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "examples").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds; a whole notebook is meant to take a few minutes on 2 cores
# Runs `make test-full` takes: the serving notebook samples thousands of tokens from a 135M model
# through vLLM (minutes on 2 cores); `make test` keeps the other notebooks' runs, the embedded
# model's engine test (`tests/plugin_shim/test_embedded_model.py`) and every notebook's no-outputs check.
FULL_ONLY = {"03_serving_experiments.ipynb"}


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)
    ]
    assert not dirty, f"{path.name}: cells {dirty} keep outputs; clear them before committing"


@pytest.mark.slow  # each notebook runs from a clean kernel
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.name, marks=[pytest.mark.full] if p.name in FULL_ONLY else []) for p in NOTEBOOKS],
)
def test_notebook_runs_from_a_clean_kernel(path: pathlib.Path, tmp_path: pathlib.Path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    # The kernel process imports this checkout's packages, and writes what it writes in tmp_path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # ipykernel's inline backend draws the plots
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
