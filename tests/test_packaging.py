# SPDX-License-Identifier: Apache-2.0
"""The package as users get it: `python -m build` makes an sdist and a wheel (the wheel built from
the sdist), and the wheel, installed on its own into a fresh virtual environment beside the
pinned vLLM and JAX of this one, runs `vllm-xla generate` with what it carries (C++ kernel
sources, device facts)."""

import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile

import pytest

from tests.xla_flags import without_test_flags

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("plugin_shim", "tpu_platform", "models", "pallas_kernels")
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", ".aot", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests"
)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    """`python -m build` on a copy of the sources (the build's own files stay out of the repo)."""
    root = tmp_path_factory.mktemp("packaging")
    shutil.copytree(REPO, root / "src", ignore=_NOT_SOURCES)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(root / "dist"), str(root / "src")])
    return root / "dist"


def test_build_makes_an_sdist_and_a_wheel_that_carries_the_kernel_sources(dist):
    [sdist] = dist.glob("vllm_xla-*.tar.gz")
    [wheel] = dist.glob("vllm_xla-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = [
        *(REPO / "pallas_kernels" / "cpu").glob("*.[ch]*"),
        *(REPO / "tpu_platform" / "planner" / "device_facts").iterdir(),
        *(REPO / "tpu_platform" / "planner" / "model_configs").iterdir(),
    ]
    sources = {str(p.relative_to(REPO)) for p in data}
    assert sources <= names and any(n.endswith(".cc") for n in sources)
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert sources <= in_sdist and "pyproject.toml" in in_sdist
    modules = {str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    assert modules <= names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vllm-xla = plugin_shim.cli:run" in text and "xla = plugin_shim:register" in text


@pytest.mark.slow
def test_the_installed_wheel_generates_from_its_own_files(dist, tmp_path):
    [wheel] = dist.glob("vllm_xla-*-py3-none-any.whl")
    # Nothing of the repository on the path: it would count as vllm-xla installed already.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["XLA_FLAGS"] = without_test_flags(env.get("XLA_FLAGS", ""))  # generates as a user's install does
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)]
    _run(pip, cwd=tmp_path, env=env)
    fresh_site = pathlib.Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    # vLLM, JAX and the rest from this environment, after the fresh one's own site-packages. Its
    # .pth files (the editable install of these packages among them) are not processed from there.
    (fresh_site / "test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    names = ", ".join(PACKAGES)
    script = f"import {names}\nfor module in ({names},):\n    print(module.__file__)"
    where = _run([str(python), "-c", script], cwd=tmp_path, env=env).stdout.split()
    assert len(where) == len(PACKAGES)
    assert all(pathlib.Path(path).is_relative_to(fresh_site) for path in where), where

    cache_dir = tmp_path / "cache"  # the native kernels are built from the wheel's sources
    cache_dir.mkdir(mode=0o700)
    shared = pathlib.Path(os.environ["VLLM_XLA_CACHE_DIR"])
    if (shared / "jax").is_dir():  # XLA's compiles may come from the test cache
        (cache_dir / "jax").symlink_to(shared / "jax")
    done = _run(
        [str(venv / "bin" / "vllm-xla"), "generate", "The capital of France is", "--max-tokens", "4",
         "--temperature", "0"],
        cwd=tmp_path, env={**env, "VLLM_XLA_CACHE_DIR": str(cache_dir)},
    )  # fmt: skip
    assert "The capital of France is Paris" in done.stdout, done.stdout[-2000:]
    [library] = (cache_dir / "native").glob("libvllm_xla_cpu_*.so")
    assert library.stat().st_size > 0
