# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/device_check.py --quick` runs on CPU in a subprocess and writes its report: every
attention backend that runs here agrees with the float32 reference, and the step program (the
runner's builder, random weights) runs each decode batch and the prefill with positive times
beside the planner's roofline and cost-model figures, and the other attention kinds agree with the
reference under their options. (Its full sizes are for an accelerator.)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a whole script run: every part, compiles included
def test_quick_device_check_runs_on_cpu(tmp_path):
    out = tmp_path / "device_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--quick", "--out", str(out)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["device"]["platform"] == "cpu" and report["quick"]
    attention = {(row["case"], row["backend"]): row for row in report["attention"]}
    assert set(attention) == {("decode", "xla"), ("prefill", "xla")}
    for row in attention.values():
        assert row["ok"] and 0 < row["max_abs_error"] < 5e-2 and row["median_seconds"] > 0
    # The other attention kinds (sinks, windows, soft cap, chunks, float8, latent), each against
    # the reference with the same options; no GPU here, so no tuning sweep.
    variants = {row["case"]: row for row in report["variants"]}
    assert {"gpt_oss_sinks_decode", "gemma_256_prefill", "llama4_chunked_prefill", "mla_decode"} <= set(
        variants
    )
    assert all(row["ok"] and row["backend"] == "xla" for row in variants.values()), variants
    assert report["sweep"] == []
    step = report["step"]
    assert step["backend"] == "xla" and step["layers"] == 2
    assert set(step["steps"]) == {"decode_1", "decode_4", "prefill_32"}
    for name, row in step["steps"].items():
        assert row["median_seconds"] > 0 and row["program"]["flops"] > 0
        if name.startswith("decode"):
            assert row["roofline"]["seconds"] > 0 and row["xla_cost_model"]["bytes_accessed_seconds"] > 0
