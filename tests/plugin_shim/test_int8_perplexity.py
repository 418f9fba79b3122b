# SPDX-License-Identifier: Apache-2.0
"""The embedded model (SmolLM2-135M) with int8 weights: its perplexity on a fixed public-domain
text (the opening of Alice's Adventures in Wonderland, tests/data/alice.txt) stays within 2% of
bfloat16's. Teacher-forced, one prefill through the models package (no engine)."""

import jax.numpy as jnp
import pytest

from models import load_model
from models.loader import put_on_device
from models.quantization import quantize_int8
from plugin_shim.model_dir import materialize
from tests.models.trained_tiny import TEXT, perplexity, teacher_forced_logits
from tpu_platform.envs import read_env

TOKENS = 300

# A 135M-parameter model's prefill over 300 tokens, four times: slow tier.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoTokenizer

    path = materialize(read_env().cache_dir)
    ids = AutoTokenizer.from_pretrained(path)(TEXT)["input_ids"][:TOKENS]
    return path, ids


def _perplexity(path: str, ids: list[int], int8: bool) -> float:
    config, model = load_model(path, jnp.bfloat16, on_host=True)
    if int8:
        quantize_int8(model)
    put_on_device(model)
    return perplexity(teacher_forced_logits(model, config, ids, jnp.bfloat16), ids)


def test_int8_perplexity_within_two_percent_of_bfloat16(embedded):
    path, ids = embedded
    assert len(ids) == TOKENS
    bf16 = _perplexity(path, ids, int8=False)
    int8 = _perplexity(path, ids, int8=True)
    print(f"perplexity over {len(ids)} tokens: bfloat16 {bf16:.4f}, int8 {int8:.4f} ({int8 / bf16 - 1:+.2%})")
    assert 1.0 < bf16 < 40.0  # a broken forward is far above (hundreds to thousands)
    assert int8 <= bf16 * 1.02
