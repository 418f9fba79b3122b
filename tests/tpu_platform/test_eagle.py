# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-1 proposer (method 'eagle') in the runner, with JAX alone (no vLLM): a random head
in vLLM's nested `model_type: eagle` layout, with an `fc` bias and an input norm it must not
apply, sharing the target's embedding and LM head, proposes exactly what an independent torch
reference of the head proposes on the target's final hidden states (transformers), after a
prompt prefilled in two chunks and after verification steps that kept some drafts and rejected
others; the verified steps' output is the target's greedy continuation; nothing compiles after
warm-up. A head with its own embedding and LM head, and one for a target that ties its LM head
to its embedding, draft from the right tables; heads that are not EAGLE-1 heads of this target
are refused by name."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaForCausalLM

from models.config import ModelConfig
from models.eagle import EagleConfig
from tests.eagle_reference import EagleReference
from tests.models.tiny_checkpoints import prompts
from tests.speculation_driver import PROMPT_LEN, assert_verified_like_reference, speculating_runner
from tests.tiny_models import save_tiny_eagle_head, save_tiny_llama
from tpu_platform.speculation.eagle import EagleProposer

K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_llama(str(tmp_path_factory.mktemp("target")), seed=3, num_hidden_layers=2)
    head = save_tiny_eagle_head(
        str(tmp_path_factory.mktemp("head")), target, seed=7, fc_bias=True, nested=True
    )
    return target, head


@pytest.mark.slow  # two programs a step shape built and run: about a minute
def test_the_head_proposes_what_the_reference_head_does_through_verification(dirs):
    target_dir, head_dir = dirs
    runner = speculating_runner(target_dir, "eagle", head_dir, K, max_num_seqs=2, max_num_batched_tokens=32)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    reference = EagleReference(head_dir, target)
    (prompt,) = prompts([PROMPT_LEN], seed=5)
    # The head's own drafts first, then drafts made to keep 3, 1 and 2 tokens (a random head's
    # are rarely kept): the head proposes from the right cache entries whatever was kept.
    assert_verified_like_reference(
        runner, target, lambda history: reference.drafts(history, K), prompt, K, keeps=(None, K, 1, 2),
        vocab=384,
    )  # fmt: skip
    assert runner.speculation.stats.draft_tokens == 4 * K
    assert runner.programs.compiles_after_warmup == 0


@pytest.mark.parametrize("own", [False, True])
def test_the_head_drafts_from_its_own_tables_or_a_tied_targets_embedding(tmp_path, own):
    """A head with its own embedding and LM head reads them; one without, for a target that
    ties its LM head to its embedding, reads the target's embedding for both."""
    from safetensors.torch import load_file

    from models.loader import load_model

    target_dir = save_tiny_llama(str(tmp_path / "target"), seed=4, tie_word_embeddings=True)
    head_dir = save_tiny_eagle_head(
        str(tmp_path / "head"), target_dir, seed=6, own_embedding=own, own_lm_head=own
    )
    config, target = load_model(target_dir, jnp.float32)
    proposer = EagleProposer.load(
        head_dir, k=1, target=config, target_model=target, dtype=jnp.float32, max_model_len=64,
        device=jax.devices()[0],
    )  # fmt: skip
    head = nnx.merge(proposer._graphdef, jax.tree.unflatten(proposer._state_def, proposer._state_leaves))
    tables = load_file(os.path.join(head_dir if own else target_dir, "model.safetensors"))
    embedding = tables["embed_tokens.weight" if own else "model.embed_tokens.weight"].numpy()
    lm_head = tables["lm_head.weight"].numpy() if own else embedding
    tokens = np.array([5, 17, 300], np.int32)
    np.testing.assert_array_equal(np.asarray(head.embed_tokens(jnp.asarray(tokens))), embedding[tokens])
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(head.draft_logits(jnp.asarray(x))), x @ lm_head.T, rtol=1e-5, atol=1e-4
    )


def _config(tmp_path, hf: dict) -> EagleConfig:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(hf, f)
    return EagleConfig.from_pretrained(str(tmp_path))


_LAYER = dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=1, vocab_size=384,
)  # fmt: skip


def _target(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=384, hidden_size=64, intermediate_size=128,
                num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    return ModelConfig(**{**base, **fields})


def test_both_config_layouts_read_the_same_layer(tmp_path):
    flat = _config(tmp_path, _LAYER)
    nested = _config(tmp_path, {"model_type": "eagle", "architectures": ["EAGLEModel"], "model": _LAYER})
    assert flat.model.hidden_size == nested.model.hidden_size == 64
    assert flat.model.num_kv_heads == nested.model.num_kv_heads == 2
    flat.check_target(_target())


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({**_LAYER, "architectures": ["LlamaForCausalLMEagle3"]}, "method 'eagle3'"),
        ({**_LAYER, "architectures": ["EagleMiniCPMForCausalLM"]}, "Llama's layout"),
        ({**_LAYER, "num_hidden_layers": 2}, "num_hidden_layers=2"),
    ],
)
def test_a_head_that_is_not_an_eagle_one_head_is_refused_by_name(tmp_path, hf, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, hf)


@pytest.mark.parametrize(("target", "message"), [(dict(vocab_size=512), "vocab_size=384"),
                                                 (dict(hidden_size=128), "hidden_size=64")])  # fmt: skip
def test_a_head_made_for_another_target_is_refused_by_name(tmp_path, target, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, _LAYER).check_target(_target(**target))
