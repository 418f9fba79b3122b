# SPDX-License-Identifier: Apache-2.0
"""Test environment: CPU JAX, in-process vLLM engine, no hub, a persistent compilation cache."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.xla_flags import with_test_flags

_REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
os.environ.setdefault("VLLM_XLA_CACHE_DIR", str(_REPO / ".cache" / "vllm-xla"))
os.environ.setdefault("VLLM_XLA_CPU_KV_CACHE_GB", "0.25")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine tests run what TPU and GPU run by default: vLLM's async scheduling (our platform turns
# it off on the CPU device otherwise; tests/plugin_shim/test_platform.py checks that rule).
os.environ.setdefault("VLLM_XLA_CPU_ASYNC_SCHEDULING", "1")
# XLA:CPU programs compiled without LLVM's optimizations: a quarter of the compile time the suite is
# mostly made of (tests/xla_flags.py says what stays as served).
os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))


_HEAD_START = pytest.StashKey[list[subprocess.Popen]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist with workers (the Makefile's `-n 2`), the controller starts two jobs at
    once, beside the workers' collection, that tests would otherwise each start on their own time:
    building the native kernels (else the first worker to need them builds while the other waits
    on the build lock, one core idle through the build's tail; the workers' `native_kernels` take
    the library as built, or wait on the same lock; a failed build is left to them to report),
    and reading vLLM's facts about every architecture the tests serve into vLLM's cache
    (`tests/vllm_model_facts.py`: one process, where a clean machine would start one for each)."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None):
        return
    build_dir = os.path.abspath(os.path.join(os.environ["VLLM_XLA_CACHE_DIR"], "native"))
    # absolute: the subprocess runs in the checkout, the workers where pytest was started
    commands = (
        [sys.executable, "-m", "pallas_kernels.cpu", build_dir],
        [sys.executable, "-m", "tests.vllm_model_facts"],
    )
    quiet = subprocess.DEVNULL
    config.stash[_HEAD_START] = [
        subprocess.Popen(command, cwd=_REPO, stdout=quiet, stderr=quiet) for command in commands
    ]


def pytest_sessionfinish(session: pytest.Session) -> None:
    for job in session.config.stash.get(_HEAD_START, []):
        job.wait()  # a run that never needed them still leaves no process behind


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache() -> None:
    """JAX's persistent compilation cache, in the test cache directory, from each test process's
    start: a second run (the edit loop) loads the programs an unchanged test compiled before
    instead of compiling them again. The runner turns the same cache on when it starts
    (`programs.enable_persistent_cache`), so without this the tests after a process's first engine
    already ran under it and those before did not."""
    from tpu_platform.programs import enable_persistent_cache

    enable_persistent_cache(os.environ["VLLM_XLA_CACHE_DIR"])


@pytest.fixture(scope="session")
def native_kernels() -> pathlib.Path:
    """Builds (once; kept in the test cache directory) and registers the native CPU kernels."""
    from pallas_kernels import cpu

    return cpu.load(os.path.join(os.environ["VLLM_XLA_CACHE_DIR"], "native"))


@pytest.fixture(scope="session")
def dense_kernels(native_kernels: pathlib.Path) -> pathlib.Path:
    """The native kernels, on a CPU that runs their bfloat16 dense layers (AMX, AVX-512 BF16, or
    AVX2 with FMA; else the test is skipped)."""
    from pallas_kernels import cpu

    if cpu.dense_isa(native_kernels) is None:
        pytest.skip("this CPU (or its kernel) has none of AMX bfloat16 tiles, AVX-512 BF16, AVX2 with FMA")
    return native_kernels


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which `-p no:xdist` leaves out
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `--dist loadfile` (the Makefile's), each test file goes whole to one worker, so the
    engines and models a module shares are built once, except that `tests/aot/` goes to the
    workers as two units (`tests/aot/units.py`): its real-size step compiles take several GiB
    each and run one at a time on one worker, its layer-sized compiles one at a time on the
    other. Both units are handed out first: they are the run's longest, and the other files fill
    in behind them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from tests.aot.units import LAYER_UNIT, STEP_UNIT, unit_of

    class CompilesFirstInTwoUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid) or super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            for unit in (LAYER_UNIT, STEP_UNIT):  # the step unit ends up first
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return CompilesFirstInTwoUnits(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The TPU interpreter's DMA and race simulations are the long interpret-mode checks: slow tier.
    for item in items:
        if item.get_closest_marker("tpu_interpret") is not None:
            item.add_marker(pytest.mark.slow)
