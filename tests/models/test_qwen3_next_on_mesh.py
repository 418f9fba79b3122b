# SPDX-License-Identifier: Apache-2.0
"""Qwen3-Next and Qwen3.5 split over a tensor-parallel mesh of simulated CPU devices (a process
of their own: `qwen3_next_mesh_worker.py`), against transformers fp32 and the same model on one
device: two prompts at once (one longer than the gated delta rule's 64-token chunk), then a
decode and a 3-token chunk continuing from the Gated DeltaNet states and KV pages each device
carried; every row's logits close. The state pools and the Gated DeltaNet weights are split,
each device holding its share.

Qwen3-Next with 4 key heads (8 value heads) at 2 devices (two key heads a device) and at 4 (one,
the KV heads repeated), and Qwen3.5 (its q, k and v projections read apart from the checkpoint's
one) at 2 devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.models.qwen3_next_mesh_worker import CONTINUATIONS, prompts
from tests.models.tiny_checkpoints import hf_logits
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # a subprocess on simulated devices

# As `test_qwen3_next.py`: the chunked rule's float32 solves round apart from transformers'.
ATOL, RTOL = 1e-3, 1e-4
# name -> (architecture, config overrides, TP sizes)
MODELS = {
    "qwen3_next": ("Qwen3NextForCausalLM", dict(linear_num_key_heads=4, linear_num_value_heads=8), "1,2,4"),
    "qwen3_5": ("Qwen3_5ForCausalLM", {}, "2"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, tmp_path_factory):
    """(report by TP size, transformers model, the TP sizes)."""
    import torch
    import transformers

    architecture, overrides, sizes = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path = save_tiny_qwen3_next(str(root / "model"), seed=6, architecture=architecture, **overrides)
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu"}
    out = root / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.models.qwen3_next_mesh_worker", path, sizes, str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    hf = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    return json.loads(out.read_text()), hf, sizes.split(",")


def _expected(hf) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits of the rows of the worker's two steps."""
    ps = prompts()
    first = np.concatenate([hf_logits(hf, p) for p in ps])
    second = np.concatenate(
        [hf_logits(hf, p + new)[-len(new) :] for p, new in zip(ps, CONTINUATIONS, strict=True)]
    )
    return first, second


def test_steps_on_a_mesh_match_transformers_and_one_device(case):
    report, hf, sizes = case
    first, second = _expected(hf)
    for tp in sizes:
        got = report[tp]
        np.testing.assert_allclose(got["first"], first, atol=ATOL, rtol=RTOL, err_msg=f"TP={tp}")
        np.testing.assert_allclose(got["second"], second, atol=ATOL, rtol=RTOL, err_msg=f"TP={tp}")
    if "1" in sizes:  # the split program computes what one device does, up to summation order
        for tp in sizes:
            np.testing.assert_allclose(report[tp]["first"], report["1"]["first"], atol=2e-4, rtol=0)
            np.testing.assert_allclose(report[tp]["second"], report["1"]["second"], atol=2e-4, rtol=0)


def test_state_pools_and_linear_attention_weights_are_split(case):
    report, _, sizes = case
    for tp in (int(s) for s in sizes if s != "1"):
        placed = report[str(tp)]["placed"]
        for name in ("conv_pool", "recurrent_pool"):  # each device: 1/N of every slot
            assert placed[name]["device_bytes"] == [placed[name]["bytes"] // tp] * tp, (tp, name)
        split = [n for n, a in placed.items() if ".linear_attn." in n and a["spec"]]
        whole = {n.rsplit(".linear_attn.", 1)[1] for n, a in placed.items() if ".linear_attn." in n} - {
            n.rsplit(".linear_attn.", 1)[1] for n in split
        }
        assert whole == {"conv1d.weight", "norm.weight"}, (tp, whole)  # all else split
        for name in split:
            assert placed[name]["device_bytes"] == [placed[name]["bytes"] // tp] * tp, (tp, name)
