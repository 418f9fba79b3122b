# SPDX-License-Identifier: Apache-2.0
"""A logits-processor plugin installed through its entry point acts on our platform."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.greedy_reference import hf_greedy
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # vllm.LLM in a subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_entry_point_logits_processor_end_to_end(tmp_path):
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=1)
    done = subprocess.run(
        [sys.executable, "-m", "tests.logits_processor_check", model_dir, str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert result["forced"] == [42] * 6  # the processor forced every sampled token
    assert result["plain"] == hf_greedy(hf, [1, 5, 9, 20, 33], 6)  # the other row is untouched
    assert result["instances"] >= 1
    assert "force_token must be an int" in result["rejected"]
