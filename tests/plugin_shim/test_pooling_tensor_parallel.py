# SPDX-License-Identifier: Apache-2.0
"""Pooling under tensor parallelism: an embedder and a classifier split over two simulated CPU
devices give transformers' rows (the engines run in a subprocess: `pooling_tp_engine`)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.plugin_shim.tensor_parallel_engine import environment

pytestmark = pytest.mark.slow  # two engines in subprocesses

ATOL = 1e-4


def _served(tmp_path, model: str, task: str, batch: list[list[int]]) -> dict:
    out, job = tmp_path / f"{task}.json", tmp_path / f"{task}_prompts.json"
    job.write_text(json.dumps(batch))
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.pooling_tp_engine", model, task, str(out), str(job)],
        env={**environment(), "VLLM_XLA_STRICT_COMPILE": "1"}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


# The classifier pools the rows gathered from the split model as the embedder does, then applies
# its head: `make test` runs it; the embedder at TP=2 is `make test-full`'s (its one-device pooling
# is tests/plugin_shim/test_pooling_embed.py's).
@pytest.mark.parametrize(
    ("architecture", "task"),
    [
        pytest.param("Qwen3ForCausalLM", "embed", marks=pytest.mark.full),
        ("LlamaForSequenceClassification", "classify"),
    ],
)
def test_two_devices_pool_as_transformers(tmp_path, architecture, task):
    model = save_tiny(architecture, str(tmp_path / "model"), seed=21)
    batch = prompts([9, 40, 3], seed=22)
    served = _served(tmp_path, model, task, batch)
    hf = getattr(transformers, architecture).from_pretrained(model, dtype=torch.float32).eval()
    for ids, row in zip(batch, served["rows"], strict=True):
        with torch.no_grad():
            if task == "embed":
                last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
                expected = last / np.linalg.norm(last)
            else:
                expected = torch.softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
        np.testing.assert_allclose(np.asarray(row), expected, atol=ATOL)
    assert served["stats"]["compiles_after_warmup"] == 0
