# SPDX-License-Identifier: Apache-2.0
"""Across hosts an adapter is loaded on every host or refused on all: two JAX hosts (processes on
this machine, gloo collectives) gather each read's outcome (`hosts.agree_across_hosts`) before any
writes a slot, so a file missing on one host, or other files on one, is refused by both."""

import json
import os

import numpy as np
import pytest

from tests.plugin_shim.multihost_launch import run_jax_hosts
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # two JAX processes joining

WORKER = os.path.join(os.path.dirname(__file__), "lora_hosts_worker.py")


def _adapter(path: str, seed: int) -> str:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    os.makedirs(path, exist_ok=True)
    save_file(
        {
            f"{module}.lora_A.weight": rng.normal(size=(2, 64)).astype(np.float32),
            f"{module}.lora_B.weight": rng.normal(size=(64, 2)).astype(np.float32),
        },
        os.path.join(path, "adapter_model.safetensors"),
    )
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["q_proj"],
                "layers_to_transform": [0],
            },
            f,
        )
    return path


def _run_hosts(model: str, good: str, per_host: list[list[str]]) -> list[dict]:
    return run_jax_hosts(WORKER, [[model, good, *argv] for argv in per_host], env={}, timeout=240)


def test_an_adapter_one_host_cannot_read_alike_is_refused_on_both(tmp_path):
    model = save_tiny_llama(str(tmp_path / "model"))
    good = _adapter(str(tmp_path / "good"), seed=1)
    other = _adapter(str(tmp_path / "other"), seed=2)
    reports = _run_hosts(model, good, [[good, good], [str(tmp_path / "absent"), other]])
    assert reports[0]["gathered"] == reports[1]["gathered"]  # the same, in host order
    (e0, d0), (e1, d1) = reports[0]["gathered"]
    assert e0 is None and e1.startswith("too long") and len(e1) == 1024 and (d0, d1) == ([0, 7], [1, 7])
    for report in reports:
        assert (
            "refused on every host: host 1: LoRA adapter 'missing': no adapter_config.json"
            in report["missing"]
        )
        assert "'other' is refused on every host: the hosts read different files" in report["other"]
        assert report["good"] is True and report["ids"] == [2]
