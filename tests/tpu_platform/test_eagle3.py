# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-3 proposer in the runner, with JAX alone (no vLLM): a random head of vLLM's layout
(a draft vocabulary mapped through `d2t`, the target's embedding shared) proposes exactly what an
independent torch reference of the head proposes on the target's hidden states (transformers),
after a prompt prefilled in two chunks and after verification steps that kept some drafts and
rejected others, so its cache holds the right entries at the right positions; the verified
steps' output is the target's greedy continuation; sampled tokens with its drafts follow the
target's distribution (chi-square); nothing compiles after warm-up. Heads that do
not fit the target are refused by name."""

import json
import os

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from models.config import ModelConfig
from models.eagle3 import Eagle3Config, default_aux_layers
from tests.eagle3_reference import Eagle3Reference
from tests.models.tiny_checkpoints import prompts
from tests.speculation_driver import CHUNK, PROMPT_LEN, assert_verified_like_reference, speculating_runner
from tests.speculation_statistics import check_follows_target
from tests.tiny_models import save_tiny_eagle3_head, save_tiny_llama
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import CachedRequests, NewRequest, StepUpdate

K = 3
GREEDY = SamplingOptions(temperature=0.0)
AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_llama(str(tmp_path_factory.mktemp("target")), seed=3, num_hidden_layers=4)
    head = save_tiny_eagle3_head(
        str(tmp_path_factory.mktemp("head")), target, seed=7, aux_layer_ids=AUX, draft_vocab_size=256
    )
    return target, head


@pytest.fixture(scope="module")
def runner(dirs):
    target, head = dirs
    return speculating_runner(target, "eagle3", head, K, max_num_seqs=2, max_num_batched_tokens=32)


@pytest.mark.slow  # two programs a step shape built and run: about a minute
def test_the_head_proposes_what_the_reference_head_does_through_verification(runner, dirs):
    target_dir, head_dir = dirs
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    reference = Eagle3Reference(head_dir, target, AUX)
    (prompt,) = prompts([PROMPT_LEN], seed=5)
    # The head's own drafts first, then drafts made to keep 3, 1 and 2 tokens (a random head's
    # are rarely kept): the head proposes from the right cache entries whatever was kept.
    assert_verified_like_reference(
        runner, target, lambda history: reference.drafts(history, K), prompt, K, keeps=(None, K, 1, 2),
        vocab=384,
    )  # fmt: skip
    assert runner.speculation.stats.draft_tokens == 4 * K
    assert runner.speculation.stats.accepted_tokens >= K + 1 + 2


def _config(tmp_path, **fields):
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 384,
        **fields,
    }  # fmt: skip
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(hf, f)
    return Eagle3Config.from_pretrained(str(tmp_path))


def _target(**fields):
    base = dict(architecture="LlamaForCausalLM", vocab_size=384, hidden_size=64, intermediate_size=128,
                num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    return ModelConfig(**{**base, **fields})


def test_the_head_reads_vllms_default_layers_or_its_configured_ones(tmp_path):
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's choice for Llama-3.1-8B's depth
    assert _config(tmp_path).aux_layers(_target()) == (2, 4, 5)
    configured = _config(tmp_path, eagle_aux_hidden_state_layer_ids=[7, 1, 4])
    assert configured.aux_layers(_target()) == (1, 4, 7)  # in layer order, as vLLM concatenates
    nested = _config(tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 8, 3]})
    assert nested.aux_layers(_target()) == (0, 3, 8)  # 8: the last layer's output


@pytest.mark.parametrize(
    ("head", "target", "message"),
    [
        ({}, dict(vocab_size=512), "vocab_size=384"),
        ({"target_hidden_size": 32}, {}, "hidden_size=32"),
        ({}, dict(num_layers=4), "eagle_aux_hidden_state_layer_ids"),  # (2, 2, 1): two layers
        ({"eagle_aux_hidden_state_layer_ids": [0, 9, 3]}, {}, "in range"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused_by_name(tmp_path, head, target, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **head).aux_layers(_target(**target))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "EAGLE-3 head checkpoint"),
        ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
        ({"norm_before_fc": True}, "norm_before_fc"),
    ],
)
def test_a_head_variant_not_built_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **fields)


def test_an_fp8_head_loads_its_kernels_as_fp8_with_their_scales(tmp_path):
    """A head quantized in 128x128 fp8 blocks, as llm-compressor writes heads: its projections
    load fp8 with their scales and hold the dequantized checkpoint's values."""
    import jax.numpy as jnp
    import numpy as np

    from models import fp8, int8
    from models.eagle3 import load_eagle3_head
    from tests.models.fp8_checkpoints import dequantized_weights, write_block_fp8, write_float

    target = save_tiny_llama(str(tmp_path / "target"), hidden_size=128, intermediate_size=128)
    source = save_tiny_eagle3_head(str(tmp_path / "head"), target, seed=5, aux_layer_ids=None)
    quantized = write_block_fp8(source, str(tmp_path / "fp8"))
    dequantized = write_float(source, str(tmp_path / "float"), dequantized_weights(quantized))
    (_, head), (_, reference) = [load_eagle3_head(p, jnp.float32) for p in (quantized, dequantized)]
    for got, want in [(head.layer.mlp.down_proj, reference.layer.mlp.down_proj),
                      (head.layer.self_attn.o_proj, reference.layer.self_attn.o_proj)]:  # fmt: skip
        assert got.kernel[...].dtype == fp8.FP8_DTYPE and got.kernel_scale is not None
        values = int8.dequantize(np.asarray(got.kernel[...]), np.asarray(got.kernel_scale[...]))
        np.testing.assert_array_equal(values, np.asarray(want.kernel[...]))


@pytest.mark.slow  # shares the module's runner
def test_sampled_tokens_with_the_heads_drafts_follow_the_targets_distribution(runner, dirs):
    # A fresh request's drafts from the head (its prompt prefilled greedily, so its history is
    # known), then the target's logits at the drafted positions (transformers): verified in
    # many independent rows, what is kept follows the target's distribution as sampling without
    # speculation would. A random head's drafts are rarely the target's likeliest tokens, so a
    # temperature that spreads the target's distribution keeps some of them.
    target = LlamaForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).eval()
    (prompt,) = prompts([CHUNK], seed=9)  # a warmed step shape
    runner.execute(
        StepUpdate(
            new_requests=[NewRequest("s", prompt, [[5, 6, 7]], 0, GREEDY)],
            cached=CachedRequests.of([]),
            finished_req_ids={"a"},
            num_scheduled_tokens={"s": len(prompt)},
        )
    )
    result = runner.sample()
    (drafts,) = runner.speculation.propose(runner.table, result.req_ids, result.sampled_token_ids)
    history = [*prompt, *result.sampled_token_ids[0]]
    with torch.no_grad():
        logits = target(torch.tensor([[*history, *drafts[:2]]])).logits[0, -3:].numpy()
    temperature = float(logits[0].std())
    check_follows_target(logits, np.array(drafts[:2]), rows=20000, seed=3, temperature=temperature)
    assert runner.programs.compiles_after_warmup == 0
