# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla convert --quantization int4`: a float checkpoint written as a compressed-tensors
W4A16 one (vLLM 0.32 has no online int4 for a float checkpoint). The compressed-tensors
package's own decompression of it is the reference: our load of it computes what the float
model of the package's decompressed weights does; the LM head, embedding and MoE router stay as
they were, the MoE experts load 4-bit in their groups (experts fused in 3-D tensors written
per expert), and a source that cannot convert is refused by name."""

import os
import re

import numpy as np
import pytest

from models import int4, load_model
from models.compressed_tensors import quantization_config
from plugin_shim.cli import main
from tests.models.fp8_checkpoints import write_float
from tests.models.int4_checkpoints import package_dequantized, write_decompressed
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny, save_tiny_llama4_multimodal


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny("MistralForCausalLM", str(tmp_path_factory.mktemp("int4_convert") / "source"))


def _logits(path: str) -> np.ndarray:
    config, model = load_model(path)
    (ids,) = prompts([40], seed=4)
    logits, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    return logits


def test_an_int4_conversion_serves_what_the_package_decompresses(mistral, tmp_path, capsys):
    out = str(tmp_path / "int4")
    assert main(["convert", mistral, out, "--quantization", "int4", "--group-size", "32"]) == 0
    assert "serve the model directory" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(out, "xla_prepared"))
    config = quantization_config(out)
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    _, model = load_model(out)
    down = model.model.layers[0].mlp.down_proj
    assert down.kernel[...].dtype == int4.held_dtype() and down.kernel_scale[...].shape == (128 // 32, 64)
    assert model.lm_head.kernel_scale is None  # the head as it was
    _, floats = load_model(mistral)
    _, scale = int4.quantize(np.asarray(floats.model.layers[0].mlp.down_proj.kernel[...]), 32)
    np.testing.assert_allclose(down.kernel_scale[...], scale, rtol=1e-6)
    reference = write_decompressed(out, str(tmp_path / "decompressed"))
    np.testing.assert_allclose(_logits(out), _logits(reference), atol=2e-4, rtol=2e-4)


def test_moe_experts_convert_to_int4_groups_and_the_router_stays(tmp_path):
    source = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "source"))
    out = str(tmp_path / "int4")
    assert main(["convert", source, out, "--quantization", "int4", "--group-size", "16"]) == 0
    _, model = load_model(out)
    mlp = model.model.layers[0].mlp
    assert mlp.experts.down_proj.kernel[...].dtype == int4.held_dtype()
    assert mlp.experts.down_proj.kernel_scale[...].shape == (8, 32 // 16, 64)
    assert mlp.router.kernel_scale is None


def test_a_source_that_cannot_convert_to_int4_is_refused_by_name(mistral, tmp_path):
    with pytest.raises(SystemExit, match="a multiple of 8"):
        main(["convert", mistral, str(tmp_path / "a"), "--quantization", "int4", "--group-size", "12"])
    # q_proj reads 64 inputs, down_proj 128: groups of 64 split both, of 128 only down_proj's.
    with pytest.raises(
        SystemExit, match=r"do not split into groups of 128 .*--group-size 64 splits every one"
    ):
        main(["convert", mistral, str(tmp_path / "e"), "--quantization", "int4", "--group-size", "128"])
    with pytest.raises(SystemExit, match="groups of 48"):
        main(["convert", mistral, str(tmp_path / "b"), "--quantization", "int4", "--group-size", "48"])
    out = str(tmp_path / "c")
    assert main(["convert", mistral, out, "--quantization", "int4", "--group-size", "32"]) == 0
    with pytest.raises(SystemExit, match="compressed-tensors checkpoint"):
        main(["convert", out, str(tmp_path / "d"), "--quantization", "int4"])


def _fused_as_llama4(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` `[out, in]` back in Llama 4's fused
    layout: `experts.gate_up_proj [E, D, 2F]` (gate columns, then up), `experts.down_proj [E, F, D]`."""
    fused, experts = {}, {}
    for name, w in weights.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if match:
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = w
        else:
            fused[name] = w
    for stem, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        fused[f"{stem}.gate_up_proj"] = np.stack(
            [np.concatenate([parts[e, "gate"].T, parts[e, "up"].T], axis=1) for e in range(count)]
        )
        fused[f"{stem}.down_proj"] = np.stack([parts[e, "down"].T for e in range(count)])
    return fused


@pytest.mark.slow  # a second conversion (fast: a dense model's, served)
def test_fused_3d_experts_convert_per_expert_in_int4_groups(tmp_path):
    """Llama 4's experts fused in 3-D tensors (`gate_up_proj [E, D, 2F]`, `down_proj [E, F, D]`)
    are written per expert in 4-bit groups (as llm-compressor names them) and load as int4
    stacks; the logits equal the float model of the weights the package unpacks (fused back),
    which are within half a step of the source's."""
    from safetensors.numpy import load_file

    source = save_tiny("Llama4ForCausalLM", str(tmp_path / "source"), num_hidden_layers=2)  # layer 1 MoE
    out = str(tmp_path / "int4")
    assert main(["convert", source, out, "--quantization", "int4", "--group-size", "16"]) == 0
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    assert "model.layers.1.feed_forward.experts.3.down_proj.weight_packed" in names
    _, model = load_model(out)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_proj.kernel[...].dtype == int4.held_dtype()
    assert experts.gate_proj.kernel_scale[...].shape == (4, 64 // 16, 32)
    assert experts.down_proj.kernel_scale[...].shape == (4, 32 // 16, 64)
    dequantized = _fused_as_llama4(package_dequantized(out))
    floats = load_file(os.path.join(source, "model.safetensors"))
    for tensor in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.feed_forward.experts.{tensor}"
        error = np.abs(dequantized[name] - floats[name])
        assert 0 < error.max() <= np.abs(floats[name]).max() / 15 + 1e-6  # at most half a step of 4 bits
    reference = write_float(source, str(tmp_path / "float"), dequantized)
    np.testing.assert_allclose(_logits(out), _logits(reference), atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Llama 4's multimodal checkpoint (`language_model.` text model, a vision tower) and its
    conversion in groups of 16."""
    root = tmp_path_factory.mktemp("int4_convert_multimodal")
    source = save_tiny_llama4_multimodal(str(root / "source"))
    out = str(root / "int4")
    assert main(["convert", source, out, "--quantization", "int4", "--group-size", "16"]) == 0
    return source, out


@pytest.mark.slow  # a multimodal checkpoint built and converted
def test_a_multimodal_checkpoint_s_text_model_converts_under_its_prefix(multimodal):
    """The text projections and fused experts are written 4-bit under the checkpoint's own
    prefix and load as int4; the vision tower's linear weights stay float, named in `ignore`."""
    from safetensors.numpy import load_file

    _, out = multimodal
    names = set(load_file(os.path.join(out, "model.safetensors")))
    text = "language_model.model.layers"
    assert {
        f"{text}.0.self_attn.q_proj.weight_packed",
        f"{text}.1.feed_forward.experts.3.down_proj.weight_packed",
    } <= names
    assert "vision_model.model.layers.0.self_attn.q_proj.weight" in names  # float
    ignore = quantization_config(out)["ignore"]
    assert (
        "vision_model.model.layers.0.self_attn.q_proj" in ignore
        and "multi_modal_projector.linear_1" in ignore
    )
    _, model = load_model(out)
    assert model.model.layers[0].self_attn.qkv_proj.kernel[...].dtype == int4.held_dtype()
    assert model.model.layers[1].mlp.experts.gate_proj.kernel_scale[...].shape == (4, 64 // 16, 32)


@pytest.mark.full  # the loader's prefixed 4-bit logits: test_prefixed_quantized in make test
def test_a_multimodal_conversion_computes_what_the_package_unpacks(multimodal, tmp_path):
    source, out = multimodal
    reference = write_float(source, str(tmp_path / "float"), _fused_as_llama4(package_dequantized(out)))
    np.testing.assert_allclose(_logits(out), _logits(reference), atol=2e-4, rtol=2e-4)


def test_gpt_oss_experts_stay_float_and_are_named(tmp_path, caplog):
    """GPT-OSS's experts (interleaved gate/up with biases) have no 4-bit layout here: written as
    they are, and the conversion says so by name; its attention projections are quantized."""
    from safetensors.numpy import load_file

    source = save_tiny("GptOssForCausalLM", str(tmp_path / "source"))
    out = str(tmp_path / "int4")
    with caplog.at_level("WARNING", logger="vllm_xla.tpu_platform.weights.int4_convert"):
        assert main(["convert", source, out, "--quantization", "int4", "--group-size", "16"]) == 0
    assert re.search(
        r"keeps 4 expert tensors in float.*layers\.0\.mlp\.experts\.down_proj, .*experts\.gate_up_proj",
        caplog.text,
    )
    written, floats = (
        load_file(os.path.join(out, "model.safetensors")),
        load_file(os.path.join(source, "model.safetensors")),
    )
    name = "model.layers.0.mlp.experts.gate_up_proj"
    np.testing.assert_array_equal(written[name], floats[name])
    assert "model.layers.0.self_attn.q_proj.weight_packed" in written


def test_qwen3_5_fused_qkv_converts_whole_and_loads_cut_into_q_k_and_v(tmp_path):
    """Qwen3.5's `in_proj_qkv` (q, k and v outputs side by side) is written as one 4-bit layer, as
    llm-compressor writes it; the load cuts its packed rows and scales into the q, k and v
    projections (`models.fused_outputs`); the b and a projections (four outputs) convert too."""
    from safetensors.numpy import load_file

    from tests.models.tiny_qwen3_next import save_tiny_qwen3_next

    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture="Qwen3_5ForCausalLM")
    out = str(tmp_path / "int4")
    assert main(["convert", source, out, "--quantization", "int4", "--group-size", "32"]) == 0
    written = load_file(os.path.join(out, "model.safetensors"))
    fused = "model.layers.0.linear_attn.in_proj_qkv"
    assert f"{fused}.weight" not in written and written[f"{fused}.weight_packed"].shape == (96, 64 // 8)
    _, model = load_model(out)
    mixer = model.model.layers[0].linear_attn
    values = int4.unpack_int32(written[f"{fused}.weight_packed"])  # [out, in]
    scales = written[f"{fused}.weight_scale"]  # [out, in / 32]
    for name, rows in (
        ("in_proj_q", slice(0, 32)),
        ("in_proj_k", slice(32, 64)),
        ("in_proj_v", slice(64, 96)),
    ):
        projection = getattr(mixer, name)
        assert projection.kernel[...].dtype == int4.held_dtype()
        np.testing.assert_array_equal(np.asarray(projection.kernel[...]), values[rows].T.astype(np.int8))
        np.testing.assert_array_equal(np.asarray(projection.kernel_scale[...]), scales[rows].T)
    assert mixer.in_proj_b.kernel[...].dtype == int4.held_dtype()
