# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism on 4 and (`make test-full`) 2 simulated CPU devices (a process of their own a
model: `expert_parallel_worker.py`): each device holds E / N whole experts, and the model's logits
and greedy tokens are the one-device model's (itself checked against transformers in
`test_architectures.py`), for every MoE architecture we serve: Mixtral, Qwen3-MoE, GPT-OSS
(biases, clamped SwiGLU; bfloat16 experts, and mxfp4 ones as released), Llama 4 (shared expert,
weights on the inputs), GLM-4.5 (V3 routing, shared experts) as whole models; DeepSeek-V3's MoE
layer alone; Qwen3-MoE's int8 (per channel and grouped) and fp8 experts too. The compiled prefill
gathers no expert weights: each device computes its own experts where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.models.mxfp4_checkpoint import save_tiny_gpt_oss_mxfp4
from tests.models.tiny_checkpoints import save_tiny
from tests.models.tiny_deepseek import save_tiny_deepseek
from tests.models.tiny_glm4_moe import save_tiny_glm4_moe
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # 4 simulated devices in a subprocess per model

_MODELS = {
    "mixtral": lambda path: save_tiny("MixtralForCausalLM", path, seed=1),
    "qwen3_moe": lambda path: save_tiny("Qwen3MoeForCausalLM", path, seed=2),
    "gpt_oss": lambda path: save_tiny("GptOssForCausalLM", path, seed=3),
    "gpt_oss_mxfp4": lambda path: save_tiny_gpt_oss_mxfp4(path, seed=5)[0],  # its experts as released
    "llama4": lambda path: save_tiny("Llama4ForCausalLM", path, seed=4),
    "glm4_moe": lambda path: save_tiny_glm4_moe("qk_norm", path, seed=5),
}
_MORE = "qwen3_moe"  # also quantized experts, and the layers computing otherwise (`--more`)
_LAYERS = {"deepseek_v3": lambda path: save_tiny_deepseek("v3_noaux_yarn", path, seed=6)}


# `make test` splits the experts 4 ways (2 whole ones a device of 8); 2 ways (4 a device) takes
# the same path with more experts a device, and is `make test-full`'s.
EP_SIZES = [4, pytest.param(2, marks=pytest.mark.full)]


def _sizes(request) -> str:
    """The mesh sizes this session's selected tests of the module ask for, as the worker's "2,4"."""
    here = request.node.path
    asked = {
        item.callspec.params["ep"]
        for item in request.session.items
        if item.path == here and "ep" in getattr(getattr(item, "callspec", None), "params", {})
    }
    return ",".join(str(ep) for ep in sorted(asked | {4}))


def _run(model_dir: str, mode: str, sizes: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.models.expert_parallel_worker", model_dir, mode, sizes]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("REPORT ", 1)[1])


@pytest.fixture(scope="module", params=sorted(_MODELS))
def report(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"ep_{request.param}") / "model")
    mode = "--more" if request.param == _MORE else "--model"
    return _run(_MODELS[request.param](path), mode, _sizes(request))


@pytest.fixture(scope="module", params=sorted(_LAYERS))
def layer_report(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"ep_{request.param}") / "model")
    return _run(_LAYERS[request.param](path), "--layer", _sizes(request))


def _experts_split_by_index(shapes: dict, ep: int) -> None:
    assert shapes
    for name, (whole, share) in shapes.items():
        assert share == [whole[0] // ep, *whole[1:]], name


@pytest.mark.parametrize("ep", EP_SIZES)
def test_expert_parallel_logits_and_tokens_equal_one_device(report, ep):
    assert report[f"max_diff_{ep}"] < 1e-4 * max(1.0, report["scale"])
    assert report[f"tokens_{ep}"] == report["tokens_1"]


@pytest.mark.parametrize("ep", EP_SIZES)
def test_each_device_holds_whole_experts(report, ep):
    _experts_split_by_index(report[f"experts_{ep}"], ep)


def _moves_weights(collectives: list, expert_elements: int) -> list:
    """The collectives that move at least one expert's weights (the MoE's `[T, D]` sums, the
    attention's and the logits' are far smaller)."""
    return [(kind, elements) for kind, elements in collectives if elements >= expert_elements]


@pytest.mark.parametrize("ep", EP_SIZES)
def test_no_expert_weights_moved(report, ep):
    assert not _moves_weights(report[f"collectives_{ep}"], report["expert_elements"])
    # the MoE layers sum their outputs over the devices
    assert any(kind == "all-reduce" for kind, _ in report[f"collectives_{ep}"])


@pytest.mark.parametrize("report", [_MORE], indirect=True)
def test_weights_moved_when_the_layers_compute_otherwise(report):
    # the check above can fail: experts placed by index but computed split inside each expert
    assert _moves_weights(report["collectives_unflagged"], report["expert_elements"])


@pytest.mark.parametrize("report", [_MORE], indirect=True)
@pytest.mark.parametrize("quantization", ["int8", "int8-g16", "fp8"])
def test_quantized_experts_by_index_equal_one_device(report, quantization):
    assert report[f"{quantization}_max_diff_4"] < 1e-4 * max(1.0, report["scale"])


@pytest.mark.parametrize("ep", EP_SIZES)
def test_deepseek_moe_layer_by_expert_index(layer_report, ep):
    assert layer_report[f"max_diff_{ep}"] < 1e-4 * max(1.0, layer_report["scale"])
    _experts_split_by_index(layer_report[f"experts_{ep}"], ep)
    # routed and shared experts' partial sums, each `[T, D]` (or both in one): no weight moved
    sizes = {elements for _, elements in layer_report[f"collectives_{ep}"]}
    assert sizes and sizes <= {layer_report["tokens_by_hidden"], 2 * layer_report["tokens_by_hidden"]}
