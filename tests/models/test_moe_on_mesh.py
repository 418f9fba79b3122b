# SPDX-License-Identifier: Apache-2.0
"""The mixture of experts split over a tensor-parallel mesh (`models.moe.experts_routed_on_mesh`),
run on 4 simulated CPU devices in a subprocess (`moe_mesh_worker.py`: the device count is fixed
when JAX starts): the same outputs as one device, and one sum of `[tokens, hidden]` per layer
instead of one over every routed row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.models.moe_mesh_worker import HIDDEN, TOKENS
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # 4 simulated devices in a subprocess


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.models.moe_mesh_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_experts_on_a_mesh_equal_one_device(report, weights):
    assert report[f"{weights}_max_error"] < 1e-5


@pytest.mark.parametrize("split", ["tp", "ep"])
@pytest.mark.parametrize("scales", ["grouped", "channel"])
def test_affine_4_bit_experts_on_a_mesh_equal_one_device(report, split, scales):
    """Zero points' offsets split like their scales (inside each expert: gate/up on F, down on
    its groups of F; by index: each device its experts' whole)."""
    assert report[f"affine_{scales}_{split}_max_error"] < 1e-4


def test_experts_on_a_mesh_sum_once_over_tokens_and_hidden(report):
    assert report["all_reduces"] == [[TOKENS * HIDDEN]]


@pytest.mark.parametrize("where", ["one", "tp", "ep"])
def test_act_order_experts_gather_each_experts_inputs_on_a_mesh(report, where):
    """GPTQ act-order experts (`input_order [E, D]`): each tile's inputs gathered into its
    expert's order, on one device and split both ways, equal the experts in the inputs' order."""
    assert report[f"act_order_{where}_max_error"] < 1e-5
