# SPDX-License-Identifier: Apache-2.0
"""int8 weights streamed onto tensor-parallel meshes of simulated CPU devices (a process of their
own: `int8_tensor_parallel_worker.py`): at TP=1, 2 and 4 every array equals the whole model
quantized on the host, the scales are split like their kernels' columns, the host never holds
the float model, and the logits are the host-quantized model's. An int8 conversion written at
TP=1 restores at TP=1, 2 and 4 as the streamed load has it, quantizing nothing.

Tiny Qwen2 (q/k/v biases, re-blocked beside the scales), Qwen3 (a tied head: its `[D, V]` copy
quantized as it is made), Qwen3-MoE (expert stacks), a compressed-tensors int8 Llama (int8
kernels and scales from the checkpoint, the `lm_head` it leaves in float kept float, nothing
quantized while streaming) and a GGUF Llama
of Q8_0 weights (int8 as they are read, with their block scales `[in / 32, out]`:
`models.gguf_reader`; nothing quantized while streaming)."""

import json
import os
import subprocess
import sys

import pytest

from tests.models.test_compressed_tensors import write_compressed
from tests.models.test_gguf_q8_0 import write_q8_0_gguf
from tests.models.tiny_checkpoints import save_tiny
from tests.tiny_models import save_tiny_llama
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # 8 simulated devices in a subprocess per model


def _compressed_llama(path: str) -> str:
    source = save_tiny_llama(path + "_float", seed=4, num_hidden_layers=6)
    write_compressed(source, path, fmt="pack-quantized", strategy="channel")
    return path


def _q8_0_llama(path: str) -> str:
    # 128 inputs a projection: 4 groups of 32, whole on each of 4 devices (row-parallel o_proj)
    write_q8_0_gguf(save_tiny_llama(path + "_float", seed=5, num_hidden_layers=6, hidden_size=128), path)
    return path


_MODELS = {
    "qwen2": lambda path: save_tiny("Qwen2ForCausalLM", path, seed=2),
    "qwen3_tied": lambda path: save_tiny("Qwen3ForCausalLM", path, seed=3),
    "qwen3_moe": lambda path: save_tiny("Qwen3MoeForCausalLM", path, seed=1),
    "compressed_llama": _compressed_llama,
    "q8_0_gguf_llama": _q8_0_llama,
}


@pytest.fixture(scope="module", params=sorted(_MODELS))
def report(request, tmp_path_factory):
    scratch = tmp_path_factory.mktemp(f"int8_tp_{request.param}")
    model_dir = _MODELS[request.param](str(scratch / "model"))
    env = {**os.environ, "XLA_FLAGS": with_host_devices(8), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.tpu_platform.int8_tensor_parallel_worker", model_dir, str(scratch)]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.split("REPORT ", 1)[1]), "model": request.param}


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_streamed_int8_arrays_are_the_host_quantized_ones(report, tp):
    at = report["tp"][tp]
    assert at["same_names"]
    for name, array in at["arrays"].items():
        assert array["equal"], name  # bit for bit: quantizing parts, then fusing, is exact
    kernels = [n for n, a in at["arrays"].items() if a["dtype"] == "int8"]
    assert any("qkv_proj" in n for n in kernels)
    # A pre-quantized checkpoint's float lm_head (compressed-tensors' `ignore`) is served as it ships.
    head_int8 = any(n.endswith("head_kernel") or "lm_head" in n for n in kernels)
    assert head_int8 == (report["model"] != "compressed_llama")


@pytest.mark.parametrize("tp", ["2", "4"])
def test_scales_are_split_like_their_kernels_columns(report, tp):
    placed = report["tp"][tp]["arrays"]
    scales = [n for n in placed if n.endswith(("kernel_scale", "head_scale"))]
    assert scales
    for name in scales:
        kernel = placed[name.removesuffix("kernel_scale") + "kernel" if name.endswith("kernel_scale")
                        else name.removesuffix("head_scale") + "head_kernel"]  # fmt: skip
        column_split = kernel["spec"] and kernel["spec"][-1] == "model"
        grouped = len(placed[name]["spec"] or []) == 2 and "experts" not in name  # `[in / G, out]`
        if column_split:  # each device holds its own columns' scales, none all of them
            assert placed[name]["spec"][-1] == "model", name
            assert placed[name]["device_bytes"] == [placed[name]["bytes"] // int(tp)] * int(tp), name
        elif grouped:  # row-parallel, grouped: each device its own groups of inputs
            assert placed[name]["spec"][0] == "model" == kernel["spec"][0], name
        else:  # row-parallel (o_proj, down_proj): every device needs every output's scale
            assert not any(placed[name]["spec"]), name
    qkv = placed["model.layers.0.self_attn.qkv_proj.kernel_scale"]["spec"]
    assert qkv == ([None, "model"] if report["int8"].startswith("int8-g") else ["model"])


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_logits_are_the_host_quantized_model_s(report, tp):
    at = report["tp"][tp]
    # TP > 1 sums the row-parallel products per device: float32 rounding, not int8 error.
    assert at["logits_max_diff"] <= 1e-4 * max(1.0, at["logits_scale"]), at
    assert at["same_argmax"]


def test_the_host_never_holds_the_float_model(report):
    for tp, at in report["tp"].items():
        # A float tensor and a fused projection's int8 parts, or one expert stack, at a time:
        # never the model (`float_bytes`: the model loaded whole, as the checkpoint holds it).
        assert 0 < at["loader_peak"] * 4 < report["float_bytes"], (tp, at["loader_peak"])


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_an_int8_conversion_restores_at_any_tp_size_as_the_streamed_load(report, tp):
    converted = report["converted"][tp]
    assert converted["same_names"] and converted["unequal"] == []  # bit for bit, same shardings
    assert converted["int8_kernels"] >= 4


def test_restoring_an_int8_conversion_quantizes_nothing(report):
    assert report["quantized_while_restoring"] == 0
    if report["model"] in ("q8_0_gguf_llama", "compressed_llama"):  # int8 as they ship, or float
        assert report["quantized_while_streaming"] == 0
    else:
        assert report["quantized_while_streaming"] > 0  # the counter sees a load that quantizes
