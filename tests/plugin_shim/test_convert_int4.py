# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla convert --quantization int4`: a float checkpoint written as a compressed-tensors
W4A16 one (vLLM 0.32 has no online int4 for a float checkpoint). The compressed-tensors
package's own decompression of it is the reference: our load of it computes what the float
model of the package's decompressed weights does; the LM head, embedding and MoE router stay as
they were, the MoE experts load 4-bit in their groups, and a source that cannot convert is
refused by name."""

import os

import numpy as np
import pytest

from models import int4, load_model
from models.compressed_tensors import quantization_config
from plugin_shim.cli import main
from tests.models.int4_checkpoints import write_decompressed
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


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
