# SPDX-License-Identifier: Apache-2.0
"""The packages' layering: imports point down `plugin_shim -> tpu_platform -> models ->
pallas_kernels`, and only `plugin_shim` imports vLLM or torch.

Every module of the four packages, sub-packages included, is parsed with `ast`; every import
counts, those inside functions (lazy ones) too. A second check imports every module below
`plugin_shim` in a fresh interpreter and finds neither vLLM nor torch loaded: what the parse cannot
see (a third-party package that pulls torch in) shows there. The accelerator check script
(`benchmarks/device_check.py`) runs where only JAX is installed, so it is held to the same rule,
and nothing the runner imports reaches the offline planner."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("plugin_shim", "tpu_platform", "models", "pallas_kernels")  # each imports only those after it
ONLY_IN_PLUGIN_SHIM = ("vllm", "torch")
# The offline planner: compile-only targets and what they compile; never on the serving path.
PLANNER = ("tpu_platform.planner",)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(path): path
        for package in LAYERS
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


MODULES = _modules()


def imports_of(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path` (module `module`), at any depth."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level - 1` packages up
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found += [(node.lineno, base)]
            # `from package import submodule` imports the submodule
            found += [
                (node.lineno, f"{base}.{alias.name}")
                for alias in node.names
                if f"{base}.{alias.name}" in MODULES
            ]
    return found


def _layer(name: str) -> int | None:
    top = name.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_the_walk_finds_every_package_and_lazy_imports():
    assert {name.split(".")[0] for name in MODULES} == set(LAYERS)
    assert "tpu_platform.sampling" in MODULES  # sub-packages are walked
    # `pallas_kernels.api` imports a backend's kernels inside a function (a lazy import) and is seen to.
    api = {name for _, name in imports_of(MODULES["pallas_kernels.api"], "pallas_kernels.api")}
    assert "pallas_kernels.tpu" in api


def test_the_architecture_table_is_a_leaf():
    """`models.config` reads the architecture table while parsing; the table imports no model
    (its classes are names imported on first use), so no import cycle runs through the models."""
    assert {name for _, name in imports_of(MODULES["models.architectures"], "models.architectures")} <= {
        "__future__",
        "dataclasses",
        "importlib",
    }


@pytest.mark.parametrize("package", LAYERS)
def test_imports_point_down(package):
    wrong = []
    for module, path in MODULES.items():
        if module.split(".")[0] != package:
            continue
        rank = LAYERS.index(package)
        for line, name in imports_of(path, module):
            top = name.split(".")[0]
            target = _layer(name)
            if target is not None and target < rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (a layer above {package})")
            if top in ONLY_IN_PLUGIN_SHIM and package != "plugin_shim":
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (only plugin_shim may)")
    assert wrong == []


@pytest.mark.parametrize("script", ["device_check", "device_variants"])
def test_the_device_check_script_needs_only_jax(script):
    path = ROOT / "benchmarks" / f"{script}.py"
    names = {name.split(".")[0] for _, name in imports_of(path, f"benchmarks.{script}")}
    assert not names & {*ONLY_IN_PLUGIN_SHIM, "plugin_shim", "transformers"}, names


def test_the_runner_does_not_reach_the_planner():
    reached, queue = set(), ["tpu_platform.runner"]
    while queue:
        module = queue.pop()
        if module in reached or module not in MODULES:
            continue
        reached.add(module)
        queue += [name for _, name in imports_of(MODULES[module], module)]
    assert not {m for m in reached if m.startswith(PLANNER)}, sorted(reached)


def test_the_packages_below_plugin_shim_load_neither_vllm_nor_torch():
    below = [name for name in MODULES if not name.startswith("plugin_shim")]
    code = (
        "import importlib, sys\n"
        f"for name in {below!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in {ONLY_IN_PLUGIN_SHIM!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"
