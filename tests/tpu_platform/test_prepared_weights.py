# SPDX-License-Identifier: Apache-2.0
"""Prepared-weights checkpoints restored onto other shardings, and converted model directories."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("prepared_llama")), seed=5)


def test_a_checkpoint_saved_two_way_restores_one_way_and_four_way_bit_for_bit(tiny_dir, tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.tpu_platform.reshard_worker", tiny_dir, str(tmp_path / "ckpt")]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert len(report) == 2 * len([k for k in report if k.startswith("1:")]) > 0
    for key, array in report.items():
        ways = key.split(":")[0]
        assert array["equal"], key  # bit for bit what the host prepared
        sharded = array["spec"] and array["spec"][-1] == "model"
        if ways == "1":
            assert array["devices"] == 1 and array["shard_bytes"] == [array["bytes"]], key
        elif sharded:  # each of the 4 devices holds a quarter of the weight
            assert array["devices"] == 4 and array["shard_bytes"] == [array["bytes"] // 4], key
        else:
            assert array["shard_bytes"] == [array["bytes"]], key  # a norm: replicated
    assert report["4:model.layers.0.self_attn.qkv_proj.kernel"]["spec"] == [None, "model"]
    assert report["4:model.norm.weight"]["spec"] == []
