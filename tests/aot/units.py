# SPDX-License-Identifier: Apache-2.0
"""How the compile modules are scheduled: two units of work, each run by one pytest-xdist worker.

The step modules compile a real-size model's step (billions of parameters, several GiB of
compiler memory each): one at a time, on one worker. The layer modules compile a kernel, an op,
a projection or a 2-layer toy step (a fraction of that memory): one at a time too, on the other
worker, beside them, so that the step modules alone bound `make test`'s wall time. Each unit
holds its own lock file (`tests/aot/conftest.py`), which keeps the rule under other schedulings.
"""

from __future__ import annotations

AOT_DIR = "tests/aot"
STEP_UNIT = "tests/aot"
LAYER_UNIT = "tests/aot (layers)"
# Modules whose programs are a layer's or smaller (kernels, ops, projections, 2-layer steps).
LAYER_MODULES = frozenset(
    {
        "test_affine_int4.py",
        "test_compile_kernels_gpu.py",
        "test_compile_kernels_tpu.py",
        "test_data_parallel_program.py",
        "test_device_facts.py",
        "test_gated_delta_compile.py",
        "test_int8_collectives.py",
        "test_int8_grouped_gpu.py",
        "test_kv_write_compile.py",
        "test_lora_product.py",
        "test_mla_compile.py",
        "test_pooling_compile.py",
        "test_step_kv_copies.py",
    }
)


def unit_of(nodeid: str) -> str | None:
    """The unit of work of a test id under tests/aot/, None for a test elsewhere."""
    if not nodeid.startswith(AOT_DIR + "/"):
        return None
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return LAYER_UNIT if module in LAYER_MODULES else STEP_UNIT


def lock_name(module: str) -> str:
    """The lock file a compile module holds while it runs (by its file name)."""
    return "aot-layer-compile.lock" if module in LAYER_MODULES else "aot-compile.lock"
