# SPDX-License-Identifier: Apache-2.0
"""The planner on hybrid models (Gated DeltaNet layers beside full attention,
`tpu_platform.planner.hybrid`): a block id costs a KV page in every attention layer and a
request's state in every state layer, with pages raised until one holds a layer's state, as the
platform serves them; Qwen3-Next-80B-A3B's figures by hand. A tiny Qwen3-Next runner serves the
step program the planner builds for it (the same text, the same caches), state pools included."""

from __future__ import annotations

import pytest

from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.planner.depth import depths_for
from tpu_platform.planner.hybrid import hybrid_page_bytes
from tpu_platform.planner.kv import kv_bytes_read
from tpu_platform.planner.plan import StepSetup, kv_page_bytes, model_config, step_program, step_shape
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.step_program import KVLayout

# Qwen3-Next-80B-A3B at TP=8, per chip: 12 full-attention layers of 2 KV heads of 256 (repeated to
# one a chip), 36 Gated DeltaNet layers of 16 key and 32 value heads of 128 and a 4-tap conv.
KV_TOKEN_LAYER = 2 * 1 * 256 * 2  # K and V, one head, bfloat16
CONV = (4 - 1) * (2 * 16 * 128 + 32 * 128) // 8 * 2  # the last 3 inputs of its channels, bfloat16
RECURRENT = 32 // 8 * 128 * 128 * 4  # its value heads' float32 states
STATE_LAYER = CONV + RECURRENT


# (target, page tokens, the next smaller page the backend could take): 17 pages of 16 tokens hold
# a layer's state on TPU; the GPU kernels' pages are powers of two.
@pytest.mark.parametrize(("target", "tokens", "smaller"), [("v6e-8", 16 * 17, 16 * 16), ("h100x8", 512, 256)])
def test_80b_page_holds_a_state_and_counts_every_layer(target, tokens, smaller):
    setup = StepSetup(model_config("qwen3-next-80b-a3b"), target, tp_size=8)
    assert setup.tokens_per_page == tokens
    assert smaller * KV_TOKEN_LAYER < STATE_LAYER <= tokens * KV_TOKEN_LAYER
    assert kv_page_bytes(setup) == 12 * tokens * KV_TOKEN_LAYER + 36 * STATE_LAYER
    bytes_ = hybrid_page_bytes(setup.config, tokens, 1, "bfloat16", "bfloat16", setup.backend, 8)
    assert (bytes_.kv_bytes_per_token, bytes_.state_bytes_per_request) == (
        12 * KV_TOKEN_LAYER,
        36 * STATE_LAYER,
    )


def test_80b_shipped_config_has_the_model_cards_size_and_pattern():
    config = model_config("qwen3-next-80b-a3b")
    assert config.state_layers == tuple(i for i in range(48) if i % 4 != 3)
    weights = StepSetup(config, "v6e-8", tp_size=8).abstract_model().weight_bytes
    assert weights == pytest.approx(2 * 80e9, rel=0.01)  # 80B parameters in bfloat16
    assert depths_for(config) == (4, 8)  # the short programs hold whole runs of the pattern


def test_the_runner_serves_the_hybrid_program_the_planner_compiles(tmp_path):
    model_dir = save_tiny_qwen3_next(str(tmp_path / "qwen3_next"), seed=2)
    limits = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=32)
    runner = Runner(RunnerConfig(model_path=model_dir, dtype="bfloat16", attention_backend="xla", **limits))
    runner.load_model()
    runner.initialize_kv_cache(8)
    setup = StepSetup(runner.model_config, "v6e-1", dtype="bfloat16", attention_backend="xla", **limits)
    assert setup.tokens_per_page == 32  # a layer's 32-token page holds its state
    planned = step_program(setup, 8, device=runner.device)
    assert planned.layout == runner.step_program.layout == KVLayout.for_model(runner.model_config)
    assert [(c.shape, c.dtype) for c in planned.caches] == [(c.shape, c.dtype) for c in runner.kv_caches]
    assert planned.context == runner.step_program.context
    for tokens, seqs in ((4, 4), (32, 1)):  # a decode batch and a prefill chunk
        shape = step_shape(setup, tokens, seqs)
        packed, dims = pack_inputs(padding_inputs(*shape, runner.num_groups))
        served = runner.step_program.forward.trace(
            runner._state_leaves, runner.kv_caches, packed, runner._no_feed, dims=dims
        )
        assert planned.lower(shape).as_text() == served.lower().as_text()


def test_80b_decode_reads_the_attention_layers_kv_and_each_requests_states():
    # 12 attention layers read 100 tokens' KV; 36 state layers read and write a state a request.
    setup = StepSetup(model_config("qwen3-next-80b-a3b"), "v6e-8", tp_size=8)
    want = 2 * (12 * 100 * KV_TOKEN_LAYER + 2 * 36 * STATE_LAYER)
    assert kv_bytes_read(setup, 2, 100) == want
