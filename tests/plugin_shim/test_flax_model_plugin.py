# SPDX-License-Identifier: Apache-2.0
"""An out-of-tree Flax model, installed as a package of its own (`examples/flax_model_plugin`),
served through `vllm.LLM` on our platform: vLLM resolves its architecture from `config.json`
through the package's `vllm.general_plugins` entry point, and its greedy tokens equal
transformers' Granite (the same residual scaling, the same weights)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.greedy_reference import hf_greedy
from tests.tiny_models import save_tiny_llama

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flax_model_plugin"
ARCHITECTURE = "ScaledResidualLlamaForCausalLM"
RESIDUAL_MULTIPLIER = 0.5
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> pathlib.Path:
    """The example installed (`pip install --no-deps --target`) into a directory of its own: its
    dist-info carries the entry point, found once the directory is on `sys.path`. Built from a
    copy, so the build leaves nothing in the repository."""
    root = tmp_path_factory.mktemp("flax_plugin")
    source = shutil.copytree(EXAMPLE, root / "source")
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(source)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert list(site.glob("flax_model_plugin-*.dist-info/entry_points.txt"))
    return site


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama's weights under the plugin's architecture, and under one vLLM knows but
    nothing serves here (config only)."""
    root = tmp_path_factory.mktemp("flax_plugin_models")
    llama = save_tiny_llama(str(root / "llama"), seed=3)
    config = json.loads((pathlib.Path(llama) / "config.json").read_text())
    variants = {
        "plugin": (dict(config, architectures=[ARCHITECTURE], residual_multiplier=RESIDUAL_MULTIPLIER), ()),
        "unserved": (dict(config, architectures=["Phi3ForCausalLM"], model_type="phi3"), ("*.safetensors",)),
    }
    dirs = {"llama": llama}
    for name, (variant, left_out) in variants.items():
        path = root / name
        shutil.copytree(llama, path, ignore=shutil.ignore_patterns(*left_out))
        (path / "config.json").write_text(json.dumps(variant))
        dirs[name] = str(path)
    return dirs


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (5, 19, 33)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, plugin_site, checkpoints) -> dict:
    out_dir = tmp_path_factory.mktemp("flax_plugin_run")
    job, out = out_dir / "job.json", out_dir / "out.json"
    # 64-token steps hold the three prompts at once; warm-up compiles 5 forwards, not the 8 of
    # vLLM's default 512-token step budget.
    engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=16, seed=0)
    job.write_text(json.dumps({
        "model": checkpoints["plugin"], "unserved_model": checkpoints["unserved"], "prompts": _prompts(),
        "new_tokens": NEW_TOKENS, "llm": engine,
    }))  # fmt: skip
    pythonpath = os.pathsep.join([str(plugin_site), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.flax_plugin_engine", str(job), str(out)],
        env=env, capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


def _granite_reference(llama_dir: str):
    """transformers' Granite with the Llama's weights, scaling only its residual branches."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM, LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    c = llama.config
    config = GraniteConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", None) or 10000.0,
        tie_word_embeddings=False, residual_multiplier=RESIDUAL_MULTIPLIER, embedding_multiplier=1.0,
        attention_multiplier=(c.hidden_size // c.num_attention_heads) ** -0.5, logits_scaling=1.0,
    )  # fmt: skip
    granite = GraniteForCausalLM(config).to(torch.float32).eval()
    granite.load_state_dict(llama.state_dict())
    return granite, llama


@pytest.mark.slow
def test_plugin_model_serves_greedy_tokens_equal_to_transformers(served, checkpoints):
    granite, llama = _granite_reference(checkpoints["llama"])
    expected = [hf_greedy(granite, p, NEW_TOKENS) for p in _prompts()]
    assert served["tokens"] == expected
    # The plugin's own computation ran: the unscaled Llama continues differently.
    assert expected != [hf_greedy(llama, p, NEW_TOKENS) for p in _prompts()]
    assert served["config_class"] == "ScaledResidualConfig"


@pytest.mark.slow
def test_an_architecture_nothing_serves_is_refused_with_the_plugins_listed(served):
    refusal = served["refusal"]
    assert "model architecture 'Phi3ForCausalLM' is not supported by vllm-xla" in refusal
    assert ARCHITECTURE in refusal and "LlamaForCausalLM" in refusal
