# SPDX-License-Identifier: Apache-2.0
"""Our platform against vLLM's built-in CPU backend on the same tiny model, in one run."""

import gc
import json
import os
import subprocess
import sys

import pytest
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from plugin_shim.active import assert_active
from tests.tiny_models import save_tiny_llama
from tests.vllm_cpu_reference import CASES, run_cases

pytestmark = pytest.mark.slow  # vllm.LLM here and vLLM's CPU backend in a subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: a size vLLM's CPU attention kernels support.
    return save_tiny_llama(
        str(tmp_path_factory.mktemp("cpu_ref")), seed=1, hidden_size=128, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_XLA_")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_cpu_reference", model_dir],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.fixture(scope="module")
def ours(model_dir):
    llm = LLM(model=model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, seed=0)
    assert_active()
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def our_results(ours):
    return run_cases(ours)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tokens_as_vllm_cpu_backend(case, reference, our_results):
    assert [r["token_ids"] for r in our_results[case]] == [r["token_ids"] for r in reference[case]]


@pytest.mark.parametrize(
    ("case", "key", "length"),
    [("greedy_logprobs", "logprobs", 10), ("prompt_logprobs", "prompt_logprobs", None)],
)
def test_logprobs_match_vllm_cpu_backend(reference, our_results, case, key, length):
    for ours, theirs in zip(our_results[case], reference[case], strict=True):
        assert len(ours[key]) == len(theirs[key]) == (length or len(theirs[key])) > 0
        for step_ours, step_theirs in zip(ours[key], theirs[key], strict=True):
            assert step_ours.keys() == step_theirs.keys()
            for token, value in step_theirs.items():
                assert abs(step_ours[token] - value) <= 1e-3


def test_options_change_the_output(our_results):
    """Each option moves the output away from plain greedy decoding (what to, the comparison
    with vLLM's CPU backend checks), so those comparisons cannot pass with the option ignored."""
    greedy = [r["token_ids"] for r in our_results["greedy_logprobs"]]
    for case in ("penalties", "logit_bias", "allowed"):
        for result, plain in zip(our_results[case], greedy, strict=True):
            assert result["token_ids"][:10] != plain[: len(result["token_ids"])], case
    assert all(r["token_ids"] == [100] * 8 for r in our_results["logit_bias"])
    assert all(set(r["token_ids"]) <= {7, 8, 9, 10, 11} for r in our_results["allowed"])
    # The penalties (the repetition penalty counts the prompt's tokens too) repeat no more
    # than greedy decoding does over the same 10 tokens.
    for penalised, plain in zip(our_results["penalties"], greedy, strict=True):
        assert len(set(penalised["token_ids"][:10])) >= len(set(plain))


def test_json_schema_output_parses(ours):
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    params = SamplingParams(
        temperature=0.8, max_tokens=20, seed=3, structured_outputs=StructuredOutputsParams(json=schema)
    )
    for text in (o.outputs[0].text for o in ours.generate(["colour:", "hello", "x"], params)):
        assert json.loads(text) in schema["enum"]
