# SPDX-License-Identifier: Apache-2.0
"""Gemma 4's MoE block on simulated CPU devices (2, in a process of their own:
`gemma4_moe_mesh_worker.py`), its weights streamed as the runner places them: at TP=2 (the
experts split inside each expert, the dense MLP beside them like any MLP) and under expert
parallelism on 2 devices (whole experts a device), prefill logits close to transformers'
and greedy tokens equal to its; int8 experts at TP=2 equal to int8 on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.greedy_reference import hf_greedy
from tests.models.gemma4_moe_mesh_worker import NEW_TOKENS, PROMPT
from tests.models.test_gemma4_moe import ARCH, save_tiny_gemma4_moe
from tests.models.tiny_checkpoints import ATOL, RTOL, hf_logits, load_pair
from tests.xla_flags import with_host_devices

# The engine test (tests/plugin_shim/test_gemma4_moe_engine.py) serves TP=2 and EP=2 against
# transformers in `make test`; this model-level grid repeats it (`make test-full`).
pytestmark = [pytest.mark.slow, pytest.mark.full]  # simulated devices in a subprocess


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_gemma4_moe(str(tmp_path_factory.mktemp("gemma4_moe_mesh") / "model"), seed=7)
    env = {**os.environ, "XLA_FLAGS": with_host_devices(2), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.models.gemma4_moe_mesh_worker", path]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    _, _, hf = load_pair(ARCH, path)
    return report, hf_logits(hf, PROMPT), hf_greedy(hf, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("run", ["tp1", "tp2", "ep2"])
def test_logits_and_greedy_tokens_match_transformers(served, run):
    report, logits, tokens = served
    np.testing.assert_allclose(np.asarray(report[run]["logits"]), logits, atol=ATOL, rtol=RTOL)
    assert report[run]["tokens"] == tokens


@pytest.mark.parametrize("run,share", [("tp2", [8, 64, 16]), ("ep2", [4, 64, 32])])
def test_experts_are_split_as_the_rules_table_says(served, run, share):
    experts = served[0][run]["experts"]
    assert experts["gate_proj"] == [[8, 64, 32], share], experts


def test_int8_experts_on_a_mesh_equal_one_device(served):
    report, _, _ = served
    one, two = (np.asarray(report[r]["logits"]) for r in ("int8_tp1", "int8_tp2"))
    np.testing.assert_allclose(two, one, atol=1e-4, rtol=1e-4)
    assert report["int8_tp2"]["tokens"] == report["int8_tp1"]["tokens"]
    assert not np.allclose(one, np.asarray(report["tp1"]["logits"]), atol=1e-6)  # int8 really ran
