# SPDX-License-Identifier: Apache-2.0
"""The suite's head start on vLLM's model facts (`tests/vllm_model_facts.py`) fills vLLM's own cache."""

import json
import os
import subprocess
import sys

import pytest
from vllm.model_executor.models import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_name_the_helper_replaces_is_vllms():
    # Without it the helper still fills the cache, one process an architecture (vLLM's own way).
    assert callable(getattr(registry, "_run_in_subprocess", None))


@pytest.mark.slow  # a process importing vLLM and the torch classes
def test_the_served_architectures_facts_land_in_vllms_cache(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_model_facts"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    read = set(json.loads(done.stdout.strip().splitlines()[-1]))
    expected = {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Eagle3LlamaForCausalLM"}
    assert expected <= read
    files = {path.name for path in (tmp_path / "modelinfos").glob("*.json")}
    assert "vllm-model_executor-models-llama-LlamaForCausalLM.json" in files
    assert len(files) >= len(expected)
