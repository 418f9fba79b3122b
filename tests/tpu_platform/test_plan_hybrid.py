# SPDX-License-Identifier: Apache-2.0
"""The planner on hybrid models (Gated DeltaNet layers beside full attention,
`tpu_platform.planner.hybrid`): a block id costs a KV page in every attention layer and a
request's state in every state layer, with pages raised until one holds a layer's state, as the
platform serves them; Qwen3-Next-80B-A3B's figures by hand, and the block ids its requests' states
take before its tokens' (1 + k a state group under speculative decoding with k drafts). A tiny
Qwen3-Next runner serves the step program the planner builds for it (the same text, the same
caches), state pools included, and with n-gram speculation its verification with 1 + k state
blocks a request."""

from __future__ import annotations

import dataclasses

import pytest

from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.program_text import program_text
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.planner.depth import depths_for
from tpu_platform.planner.hybrid import cache_tokens, hybrid_page_bytes, request_state_blocks
from tpu_platform.planner.kv import KVFit, kv_bytes_read
from tpu_platform.planner.plan import StepSetup, kv_page_bytes, model_config, step_program, step_shape
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.speculation import SpeculationConfig
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


@pytest.mark.slow  # the abstract 80B model's shapes take seconds to trace
def test_80b_shipped_config_has_the_model_cards_size_and_pattern():
    config = model_config("qwen3-next-80b-a3b")
    assert config.state_layers == tuple(i for i in range(48) if i % 4 != 3)
    weights = StepSetup(config, "v6e-8", tp_size=8).abstract_model().weight_bytes
    assert weights == pytest.approx(2 * 80e9, rel=0.01)  # 80B parameters in bfloat16
    assert depths_for(config) == (4, 8)  # the short programs hold whole runs of the pattern


def test_80b_requests_hold_their_state_blocks_before_tokens_1_plus_k_under_speculation():
    # 48 layers in 4 groups of 12: three of Gated DeltaNet layers (a block a request each, 1 + 4
    # with 4 drafts), one of full attention (a block each 272 tokens on v6e).
    plain = StepSetup(model_config("qwen3-next-80b-a3b"), "v6e-8", tp_size=8, max_num_seqs=64)
    drafts = dataclasses.replace(plain, speculative_tokens=4)
    assert (plain.kv_layout.state_columns, drafts.kv_layout.state_columns) == (1, 5)
    assert (request_state_blocks(plain.kv_layout), request_state_blocks(drafts.kv_layout)) == (3, 15)
    page = plain.tokens_per_page
    fit = lambda setup: KVFit(setup, 0, 0, 1, 10_000, None, None, None, 0)  # noqa: E731
    assert fit(plain).kv_tokens == (10_000 - 64 * 3) * page == 2_667_776
    assert fit(drafts).kv_tokens == (10_000 - 64 * 15) * page == 2_458_880
    assert cache_tokens(drafts.kv_layout, 64 * 15, page, 64) == 0  # all of them states
    llama = StepSetup(model_config("llama-3.1-8b"), "v6e-1", speculative_tokens=4)
    assert fit(llama).kv_tokens == 10_000 * llama.tokens_per_page  # no state: one group, every page


# Two programs of seconds each: the fast tier keeps the verification's (the state groups' 1 + k
# blocks a request beside the plain step's layers); the plain step is the slow tier's.
@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 2], ids=["plain", "2_drafts"])
def test_the_runner_serves_the_hybrid_program_the_planner_compiles(tmp_path, k):
    model_dir = save_tiny_qwen3_next(str(tmp_path / "qwen3_next"), seed=2)
    limits = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=32)
    speculation = SpeculationConfig(num_tokens=k) if k else None
    config = RunnerConfig(
        model_path=model_dir, dtype="bfloat16", attention_backend="xla", speculation=speculation, **limits
    )
    runner = Runner(config)
    runner.load_model()
    runner.initialize_kv_cache(8)
    setup = StepSetup(
        runner.model_config, "v6e-1", dtype="bfloat16", attention_backend="xla", speculative_tokens=k,
        **limits,
    )  # fmt: skip
    assert setup.tokens_per_page == 32  # a layer's 32-token page holds its state
    planned = step_program(setup, 8, device=runner.device)
    layout = KVLayout.for_model(runner.model_config)
    assert planned.layout == runner.step_program.layout == dataclasses.replace(layout, state_columns=1 + k)
    assert [(c.shape, c.dtype) for c in planned.caches] == [(c.shape, c.dtype) for c in runner.kv_caches]
    assert planned.context == runner.step_program.context
    # A decode batch and a prefill chunk; with drafts, a verification of 4 requests' 1 + k rows.
    steps = ((4, 4), (32, 1)) if not k else ((4 * (1 + k), 4),)
    for tokens, seqs in steps:
        shape = step_shape(setup, tokens, seqs)
        packed, dims = pack_inputs(padding_inputs(*shape, runner.num_groups))
        served = runner.step_program.forward.trace(
            runner._state_leaves, runner.kv_caches, packed, runner._no_feed, dims=dims
        )
        assert program_text(planned.lower(shape)) == program_text(served.lower())


def test_80b_decode_reads_the_attention_layers_kv_and_each_requests_states():
    # 12 attention layers read 100 tokens' KV; 36 state layers read and write a state a request.
    setup = StepSetup(model_config("qwen3-next-80b-a3b"), "v6e-8", tp_size=8)
    want = 2 * (12 * 100 * KV_TOKEN_LAYER + 2 * 36 * STATE_LAYER)
    assert kv_bytes_read(setup, 2, 100) == want
