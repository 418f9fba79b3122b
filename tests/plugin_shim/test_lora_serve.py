# SPDX-License-Identifier: Apache-2.0
"""LoRA through vLLM's OpenAI server on our platform: adapters found by LoRA resolver plugins
(vLLM's filesystem resolver, and one of our own registered from a `vllm.general_plugins` entry
point) when a request names an unknown model, and loaded and unloaded at run time through
/v1/load_lora_adapter and /v1/unload_lora_adapter; every answer is transformers' greedy text with
that adapter merged, a broken adapter is refused naming it, and the server keeps serving."""

import json
import os
import shutil
import textwrap
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.lora_adapters import merged, scaling, write_adapter
from tests.plugin_shim.served import REPO, get, post, serving
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # starts a server

NEW_TOKENS = 5
PROMPT = [1, 45, 200, 17, 99, 310, 8]

# A resolver plugin as a package would ship it: the entry point registers it with vLLM.
_RESOLVER = textwrap.dedent(
    """
    import os

    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry


    class PrefixResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name, lora_name):
            if not lora_name.startswith("mine-"):
                return None
            path = os.path.join(os.environ["TEST_LORA_RESOLVER_DIR"], lora_name.removeprefix("mine-"))
            return LoRARequest(lora_name, 4242, path)


    def register():
        LoRAResolverRegistry.register_resolver("test prefix resolver", PrefixResolver())
    """
)


def _install_resolver(site):
    """The resolver module and a dist-info carrying its entry point (found on `sys.path`)."""
    os.makedirs(site / "lora_prefix_resolver-0.1.dist-info")
    (site / "lora_prefix_resolver.py").write_text(_RESOLVER)
    info = site / "lora_prefix_resolver-0.1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lora-prefix-resolver\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nprefix_resolver = lora_prefix_resolver:register\n"
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora_serve")
    model_dir = save_tiny_llama(str(root / "model"), seed=5)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dirs = {"fs": root / "fs_cache", "mine": root / "mine", "loaded": root / "loaded"}
    texts = {None: tokenizer.decode(hf_greedy(hf, PROMPT, NEW_TOKENS))}
    specs = {  # adapter -> (directory, rank, targets)
        "fs-adapter": (dirs["fs"] / "fs-adapter", 8, ("q_proj", "v_proj", "down_proj")),
        "mine-adapter": (dirs["mine"] / "adapter", 4, ("k_proj", "o_proj", "up_proj")),
        "loaded": (dirs["loaded"], 2, ("gate_proj", "q_proj")),
    }
    for seed, (name, (path, rank, targets)) in enumerate(specs.items()):
        weights = write_adapter(
            str(path), hf, rank=rank, alpha=2.0 * rank, targets=targets, seed=seed, base_model=model_dir
        )
        texts[name] = tokenizer.decode(
            hf_greedy(merged(hf, weights, scaling(rank, 2.0 * rank)), PROMPT, NEW_TOKENS)
        )
    assert len(set(texts.values())) == len(texts)  # every adapter changes the answer
    write_adapter(str(root / "broken"), hf, rank=16, alpha=8.0, targets=("q_proj",), seed=9)
    site = root / "site"
    _install_resolver(site)
    return model_dir, dirs, texts, root, site


@pytest.fixture(scope="module")
def server(setup):
    model_dir, dirs, _, root, site = setup
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
        VLLM_LORA_RESOLVER_CACHE_DIR=str(dirs["fs"]),
        TEST_LORA_RESOLVER_DIR=str(dirs["mine"]),
        PYTHONPATH=os.pathsep.join([REPO, str(site)]),
    )
    # float32: the adapters' expected texts are transformers' float32 greedy ones
    args = [
        "--model", model_dir, "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
    ]  # fmt: skip
    log_path = root / "server.log"
    with serving(args, env, log_path, startup_seconds=400) as base:
        yield base, log_path


def _post_text(url: str, body: dict) -> str:
    """A POST answered in plain text (the adapter endpoints)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def _complete(base, model):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return post(f"{base}/v1/completions", body)["choices"][0]["text"]


def _error(call) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as raised:
        call()
    return raised.value.code, raised.value.read().decode()


def test_resolver_plugins_find_adapters_a_request_names(setup, server):
    model_dir, _, texts, _, _ = setup
    base, _ = server
    assert _complete(base, model_dir) == texts[None]
    assert _complete(base, "fs-adapter") == texts["fs-adapter"]  # vLLM's filesystem resolver
    assert _complete(base, "mine-adapter") == texts["mine-adapter"]  # our entry point's resolver
    assert _complete(base, model_dir) == texts[None]
    models = json.loads(get(f"{base}/v1/models"))
    assert {"fs-adapter", "mine-adapter"} <= {m["id"] for m in models["data"]}


def test_adapters_load_and_unload_at_run_time(setup, server):
    model_dir, dirs, texts, root, _ = setup
    base, _ = server
    answer = _post_text(
        f"{base}/v1/load_lora_adapter", {"lora_name": "loaded", "lora_path": str(dirs["loaded"])}
    )
    assert "'loaded' added" in answer
    assert _complete(base, "loaded") == texts["loaded"]
    assert _complete(base, "fs-adapter") == texts["fs-adapter"]  # three adapters, two slots
    _post_text(f"{base}/v1/unload_lora_adapter", {"lora_name": "loaded"})
    code, _ = _error(lambda: _complete(base, "loaded"))
    assert code == 404
    code, text = _error(
        lambda: post(
            f"{base}/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(root / "broken")}
        )
    )
    assert code >= 400 and "rank r=16 exceeds max_lora_rank=8" in text, text
    assert _complete(base, model_dir) == texts[None]  # still serving
    assert _complete(base, "mine-adapter") == texts["mine-adapter"]
    metrics = get(f"{base}/metrics").decode()
    assert np.isclose(
        float(
            next(
                line for line in metrics.splitlines() if line.startswith("vllm_xla:compilations_after_warmup")
            ).rsplit(" ", 1)[1]
        ),
        0,
    )


def test_a_request_whose_adapter_is_gone_at_its_step_fails_alone(setup, server):
    """An adapter evicted from the host cache whose files are gone since: its request fails with
    a 500 naming no more than vLLM's server does, the server logs why, and it keeps serving."""
    model_dir, dirs, texts, root, _ = setup
    base, log_path = server
    gone = root / "gone"
    shutil.copytree(dirs["loaded"], gone)
    _post_text(f"{base}/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(gone)})
    assert _complete(base, "gone") == texts["loaded"]
    for name in ("fs-adapter", "mine-adapter"):  # the host cache holds two: "gone" is evicted
        assert _complete(base, name) == texts[name]
    shutil.rmtree(gone)
    code, _ = _error(lambda: _complete(base, "gone"))
    assert code == 500
    assert _complete(base, model_dir) == texts[None]
    assert _complete(base, "fs-adapter") == texts["fs-adapter"]
    log = log_path.read_text()
    assert "is ended without output" in log and str(gone) in log
