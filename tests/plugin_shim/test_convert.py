# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla convert`: a converted model directory serves the same greedy tokens as its source."""

import logging
import os

import pytest
from vllm import LLM, SamplingParams

from plugin_shim.cli import main
from tests.tiny_models import save_tiny_llama
from tpu_platform.weights.converted import PREPARED_DIR

pytestmark = pytest.mark.slow  # converts and serves through vllm.LLM

_PROMPTS = ["The capital of France is", "hello world, hello"]
_LIMITS = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, dtype="bfloat16", seed=0)


def _greedy_tokens(model: str) -> list[list[int]]:
    llm = LLM(model=model, **_LIMITS)
    outputs = llm.generate(_PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    return tokens


@pytest.fixture(scope="module")
def source_and_converted(tmp_path_factory):
    source = save_tiny_llama(str(tmp_path_factory.mktemp("convert_source")), seed=6)
    out = str(tmp_path_factory.mktemp("convert_out") / "converted")
    assert main(["convert", source, out, "--dtype", "bfloat16"]) == 0
    return source, out


def test_the_converted_directory_holds_no_source_weights(source_and_converted):
    source, out = source_and_converted
    names = set(os.listdir(out))
    assert PREPARED_DIR in names and "config.json" in names and "tokenizer.json" in names
    assert not [n for n in names if n.endswith((".safetensors", ".gguf", ".pkl"))]
    assert set(os.listdir(source)) - {"model.safetensors"} <= names


def test_serving_the_conversion_gives_the_sources_greedy_tokens(source_and_converted, native_kernels, caplog):
    source, out = source_and_converted
    expected = _greedy_tokens(source)
    assert all(len(t) == 8 for t in expected)
    log = logging.getLogger("vllm_xla.tpu_platform.runner")  # may not propagate: vLLM's handlers
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            got = _greedy_tokens(out)
    finally:
        log.removeHandler(caplog.handler)
    assert "from the converted checkpoint" in caplog.text
    assert got == expected


def test_convert_refuses_a_used_directory_and_a_bad_dtype(source_and_converted, tmp_path):
    source, out = source_and_converted
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["convert", source, out])
    with pytest.raises(SystemExit, match="already converted"):
        main(["convert", out, str(tmp_path / "again")])
    with pytest.raises(SystemExit, match="is not a dtype"):
        main(["convert", source, str(tmp_path / "x"), "--dtype", "bf17"])
