# SPDX-License-Identifier: Apache-2.0
"""Quantized Qwen3.5 (the dense tiny model) split over two simulated CPU devices, served as its
checkpoint ships: `quant_method: fp8` in 128x128 blocks (`in_proj_b` / `in_proj_a` left in
float, as Qwen's FP8 release has them), compressed-tensors W4A16 in groups of 16 with zero
points, asymmetric GPTQ with activation order and AWQ (groups of 16, `in_proj_b` / `in_proj_a`
in float). The mesh worker (`qwen3_next_mesh_worker.py`, a process of its own) streams each onto
one device and onto two as the runner does and drives two ragged steps through the Gated
DeltaNet states; the two-device logits equal one device's (up to summation order) and
transformers' on the dequantized weights, the greedy tokens alike, and every quantized Gated
DeltaNet projection's scale (and zero offset) is split like its kernel. A TP size whose split
would end inside an fp8 block of `out_proj`'s inputs is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.models.fp8_checkpoints import dequantized_weights, write_block_fp8
from tests.models.test_qwen3_5_quantized import BA, DENSE, _reference
from tests.models.test_qwen3_next_on_mesh import ATOL, RTOL, _expected
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.xla_flags import with_host_devices

# Whole 128-wide fp8 blocks on both sides of every projection at two devices: q and k 2 x 64
# outputs (one key head a device), out_proj's 4 x 64 and o_proj's 4 x 64 inputs (two blocks).
FP8_WIDTHS = dict(
    hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=64, head_dim=64, intermediate_size=256
)
_PROJECTIONS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj")


def _fp8(root) -> tuple[str, dict[str, np.ndarray], str]:
    source = save_tiny_qwen3_next(str(root / "source"), seed=6, architecture=DENSE, **FP8_WIDTHS)
    ignored = tuple(f"model.layers.{i}.linear_attn.in_proj_{p}" for i in range(3) for p in "ba")
    path = write_block_fp8(source, str(root / "fp8"), ignored=ignored)
    return path, dequantized_weights(path), source


def _w4a16(root) -> tuple[str, dict[str, np.ndarray], str]:
    from tests.models.int4_checkpoints import write_packed_w4a16

    source = save_tiny_qwen3_next(str(root / "source"), seed=6, architecture=DENSE)
    path, dequantized = write_packed_w4a16(source, str(root / "w4a16"), group_size=16, symmetric=False)
    return path, dequantized, source


def _gptq(root) -> tuple[str, dict[str, np.ndarray], str]:
    from tests.models.gptq_checkpoints import write_gptq

    # asymmetric, activation order: each part's input order whole on each device, its qzeros
    # cut by words of eight outputs (one q/k/v part's 16 per device: two words)
    source = save_tiny_qwen3_next(str(root / "source"), seed=6, architecture=DENSE)
    path, dequantized = write_gptq(
        source, str(root / "gptq"), group_size=16, sym=False, act_order=5, keep_float=BA
    )
    return path, dequantized, source


def _awq(root) -> tuple[str, dict[str, np.ndarray], str]:
    from tests.models.awq_checkpoints import write_awq

    # AWQ's `qweight [in, out / 8]`: eight outputs a word on the axis the devices split
    source = save_tiny_qwen3_next(str(root / "source"), seed=6, architecture=DENSE)
    path, dequantized = write_awq(source, str(root / "awq"), group_size=16, keep_float=BA)
    return path, dequantized, source


_WRITERS = {"fp8": _fp8, "w4a16": _w4a16, "gptq": _gptq, "awq": _awq}
# The quantized leaves of a projection that split like its kernel (GPTQ's input order is whole).
_LEAVES = {
    "fp8": ("kernel", "kernel_scale"),
    "w4a16": ("kernel", "kernel_scale", "kernel_offset"),
    "gptq": ("kernel", "kernel_scale", "kernel_offset"),
    "awq": ("kernel", "kernel_scale", "kernel_offset"),
}


def _run_worker(path: str, sizes: str, out) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": with_host_devices(2), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "tests.models.qwen3_next_mesh_worker", path, sizes, str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("fp8", marks=pytest.mark.slow),
        pytest.param("w4a16", marks=pytest.mark.full),
        pytest.param("gptq", marks=pytest.mark.full),
        pytest.param("awq", marks=pytest.mark.full),
    ],
)
def test_quantized_qwen3_5_on_two_devices_equals_one(kind, tmp_path):
    path, dequantized, source = _WRITERS[kind](tmp_path)
    done = _run_worker(path, "1,2", tmp_path / "report.json")
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    hf = _reference(DENSE, source, str(tmp_path / "float"), dequantized)
    for step, expected in zip(("first", "second"), _expected(hf), strict=True):
        one, two = np.asarray(report["1"][step]), np.asarray(report["2"][step])
        np.testing.assert_allclose(two, one, atol=2e-4, rtol=0, err_msg=step)
        np.testing.assert_allclose(two, expected, atol=ATOL, rtol=RTOL, err_msg=step)
        np.testing.assert_array_equal(two.argmax(-1), expected.argmax(-1), err_msg=step)
    placed = report["2"]["placed"]
    for name in (f"model.layers.0.linear_attn.{p}.{leaf}" for p in _PROJECTIONS for leaf in _LEAVES[kind]):
        kernel = placed[name.rsplit(".", 1)[0] + ".kernel"]
        assert placed[name]["spec"] == kernel["spec"] and "model" in kernel["spec"], name
        assert placed[name]["device_bytes"] == [placed[name]["bytes"] // 2] * 2, name
    # fp8 values: a byte a weight on each device
    q = placed["model.layers.0.linear_attn.in_proj_q.kernel"]
    if kind == "fp8":
        assert q["bytes"] == FP8_WIDTHS["hidden_size"] * 2 * FP8_WIDTHS["linear_key_head_dim"]


@pytest.mark.slow  # a checkpoint and a process of its own (seconds: it stops at the refusal)
def test_a_tp_size_cutting_an_fp8_block_of_out_proj_is_refused_by_name(tmp_path):
    # 4 value heads x 32: out_proj's 128 inputs are one fp8 block, which two devices would cut.
    widths = {**FP8_WIDTHS, "linear_value_head_dim": 32}
    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture=DENSE, **widths)
    path = write_block_fp8(source, str(tmp_path / "fp8"))
    done = _run_worker(path, "2", tmp_path / "report.json")
    assert done.returncode != 0
    assert (
        "tensor_parallel_size=2 cannot split model.layers.0.linear_attn.out_proj.kernel_scale: its "
        "kernel's inputs are in 1 groups"
    ) in done.stderr, done.stderr[-4000:]
    assert "use a tensor_parallel_size dividing 1" in done.stderr
