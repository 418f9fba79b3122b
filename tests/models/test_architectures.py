# SPDX-License-Identifier: Apache-2.0
"""Every tiny architecture against transformers fp32: logits (a ragged prefill of three prompts,
every position of each, then a mixed batch) and greedy generation through vLLM on our platform.

- Mistral: a sliding window (12 tokens, smaller than the prompts) on every layer, so every layer
  reports a sliding-window KV spec and vLLM frees pages that left the window.
- Mixtral: 8 experts, top 2, per-expert HF tensors stacked on load.
- Qwen2; Qwen3: per-head q/k RMSNorm, tied embeddings.
- Qwen3-MoE: 8 experts, top 2, no renormalization, a dense-MLP layer via `mlp_only_layers`.
- Gemma 2: scaled embeddings, sandwich (1 + w) norms, gelu-tanh MLP, query_pre_attn_scalar,
  attention and final soft-capping, sliding layers alternating with global ones, window 10 < prompt.
- Gemma 3 (text): q/k (1 + w) norms, local layers with their own RoPE base, linear RoPE scaling
  on global layers, window 10 < prompt, final soft-capping.
- GPT-OSS: attention sinks, biases on q/k/v/o, a sliding layer (window 6 < prompt) and a full
  one, YaRN RoPE, 8 experts top 2 with a router bias, expert biases and a clamped SwiGLU whose
  clamps bite.
- Llama 4: RoPE layers rotating pairs, with L2 qk-norm and chunked attention (chunks of 8 <
  prompt), a global NoPE layer with temperature-tuned queries, dense layers interleaved with MoE
  ones (4 experts, top 1, sigmoid scores on the experts' inputs, a shared expert), llama3 RoPE;
  chunked and global layers are two KV-cache groups, vLLM freeing the pages of past chunks.
- Gemma 4 (text): sliding layers (window 10 < prompt, 2 KV heads of 16) and full ones (1 KV head
  of 32, keys as values, proportional RoPE), per-layer inputs, layer scalars, two KV-shared
  layers reading the first two layers' caches, double-wide MLPs there, final soft-capping.

Architecture-specific checks (configs, weight layouts) are in test_architecture_configs.py.
"""

import pytest
from flax import nnx

from models import attach_rope_tables, load_model
from models.layers import PagedAttention
from tests.models.tiny_checkpoints import (
    ARCHS,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)


@pytest.fixture(scope="module", params=ARCHS, ids=ARCHS)
def tiny(request, tmp_path_factory):
    """(path, config, model, hf), built once per architecture."""
    arch = request.param
    path = save_tiny(arch, str(tmp_path_factory.mktemp(arch)))
    return (path, *load_pair(arch, path))


# Mistral runs on Llama's module, whose ragged batch the fast tier checks in test_llama.py (and
# sliding windows on Gemma 2 and 3 here): Mistral's is the slow tier's.
@pytest.mark.parametrize(
    "tiny",
    [pytest.param(a, marks=pytest.mark.slow) if a == "MistralForCausalLM" else a for a in ARCHS],
    ids=ARCHS,
    indirect=True,
)
def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


# The ragged check again, through RoPE tables, on every architecture whose attention takes tables
# (Gemma 4's computes its rotations): the slow tier's; the fast tier's runner tests serve through
# tables.
TABLED = [a for a in ARCHS if a != "Gemma4ForCausalLM"]


@pytest.mark.parametrize(
    "tiny",
    [pytest.param(a, marks=pytest.mark.slow) for a in TABLED],
    ids=TABLED,
    indirect=True,
)
def test_rotations_from_rope_tables_match_transformers(tiny, request):
    # What the runner runs: one table a distinct RoPE (Gemma 3: its local and global layers'),
    # shared by the layers that use it.
    path, _, _, hf = tiny
    config, model = load_model(path)
    arch = request.node.callspec.params["tiny"]
    assert attach_rope_tables(model, 64) == (2 if arch == "Gemma3ForCausalLM" else 1)
    tables = {id(m.rope_table) for _, m in nnx.iter_modules(model) if isinstance(m, PagedAttention)}
    assert len(tables) == (2 if arch == "Gemma3ForCausalLM" else 1)
    assert_ragged_matches(model, config, hf, [5, 16, 33])


# Architectures whose engine `make test` runs at TP=2 on the same (native) attention kernel
# against transformers (tests/plugin_shim/test_tensor_parallel.py): their one-device engine here
# repeats that path, in `make test-full`.
SHARDED_ON_THE_NATIVE_KERNEL = ("GptOssForCausalLM", "Llama4ForCausalLM")


@pytest.mark.slow  # builds vllm.LLM per architecture
@pytest.mark.parametrize(
    "tiny",
    [pytest.param(a, marks=pytest.mark.full) if a in SHARDED_ON_THE_NATIVE_KERNEL else a for a in ARCHS],
    ids=ARCHS,
    indirect=True,
)
def test_vllm_greedy_matches_transformers(tiny, request):
    path, _, _, hf = tiny
    stats = vllm_greedy_matches(path, hf, [7, 40, 25])
    # Gemma: sliding and full layers mixed: two KV-cache groups (block tables), sliding pages
    # freed by vLLM; prompts longer than the window must generate what transformers does.
    arch = request.node.callspec.params["tiny"]
    if arch == "Gemma2ForCausalLM":
        assert stats["kv_groups"] == 2
    elif arch == "Gemma3ForCausalLM":
        assert stats["kv_groups"] >= 2
    elif arch == "Llama4ForCausalLM":  # chunked-attention layers (three groups of one) and a global one
        assert stats["kv_groups"] == 4
    elif arch == "Gemma4ForCausalLM":  # the KV-shared layers report no cache: one layer a group
        assert stats["kv_groups"] == 2
