# SPDX-License-Identifier: Apache-2.0
"""The pooling program (last-token and mean embeddings, a classifier's head) compiles with the
real TPU and GPU compilers (`tests.aot.pooling_compile`)."""

from __future__ import annotations

import pytest

from tests.aot.pooling_compile import SEQS
from tests.aot.toolchains import run_worker


@pytest.mark.parametrize(("platform", "target"), [("tpu", "v6e-1"), ("cuda", "h100x1")])
def test_pooling_program_compiles(platform, target):
    cases = run_worker(platform, "pooling_compile", target)
    assert [(c["task"], c["method"]) for c in cases] == [
        ("embed", "LAST"),
        ("embed", "MEAN"),
        ("classify", "LAST"),
    ]
    widths = [c["out_shape"] for c in cases]
    assert widths == [[SEQS, 256], [SEQS, 256], [SEQS, 2]]
    assert all(c["out_dtype"] == "float32" for c in cases)
