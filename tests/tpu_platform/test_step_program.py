# SPDX-License-Identifier: Apache-2.0
"""The step program the runner serves is the one the planner and the compile-only tests compile.

A runner is started on a tiny Llama (CPU, the `xla` attention backend, XLA's dots) and the
planner builds its step program for the same model from abstract weights
(`tpu_platform.planner.plan.step_program`, which `tests/aot/` compiles for TPU and GPU targets), here for
the local CPU. Both come from `step_program.build_step_program`: the programs must lower to the
same text, with the runner's own placed weights and caches as with the planner's abstract ones,
and name the same cached executables. With LoRA enabled the two programs take the adapter slots
(more arguments than without), still equal. So do a tiny DeepSeek-V3 (its latent cache) and a
tiny GPT-OSS (attention sinks, a sliding and a full layer in two KV-cache groups). The KV
layouts and a layout built from groups are checked by hand-worked cases."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from tests.models.tiny_checkpoints import save_tiny
from tests.models.tiny_deepseek import save_tiny_deepseek
from tests.program_text import program_text
from tests.tiny_models import save_tiny_llama
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.lora_slots import LoraConfig
from tpu_platform.planner.plan import StepSetup, first_layers, model_config, step_program, step_shape
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.step_program import KVLayout

NUM_PAGES = 8
LIMITS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16)
LORA = LoraConfig(max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=5)


def _runner(model_dir: str, lora: LoraConfig | None, layout: KVLayout | None = None) -> Runner:
    config = RunnerConfig(
        model_path=model_dir,
        dtype="bfloat16",
        attention_backend="xla",
        native_dense=False,
        lora=lora,
        **LIMITS,
    )
    runner = Runner(config)
    runner.load_model()
    runner.initialize_kv_cache(NUM_PAGES, layout)
    return runner


def _planned(runner: Runner, lora: LoraConfig | None):
    setup = StepSetup(
        runner.model_config, "v6e-1", dtype="bfloat16", attention_backend="xla", lora=lora, **LIMITS
    )
    return setup, step_program(setup, NUM_PAGES, device=runner.device)


def _served_text(runner: Runner, shape: tuple[int, int, int]) -> str:
    """The runner's program lowered on the arguments it serves with: its placed weights and
    allocated caches, host inputs, its feed."""
    packed, dims = pack_inputs(padding_inputs(*shape, runner.num_groups))
    forward = runner.step_program.forward
    traced = forward.trace(runner._state_leaves, runner.kv_caches, packed, runner._no_feed, dims=dims)
    return program_text(traced.lower())


@pytest.mark.parametrize("lora", [None, LORA], ids=["base", "lora"])
def test_the_runner_serves_the_program_the_planner_compiles(model_dir, lora):
    runner = _runner(model_dir, lora)
    setup, planned = _planned(runner, lora)
    assert planned.context == runner.step_program.context  # the same cached executables' names
    for tokens, seqs in ((4, 4), (32, 1)):  # a decode batch and a prefill chunk
        shape = step_shape(setup, tokens, seqs)
        assert shape == runner.buckets.shape_for(tokens, seqs)
        assert program_text(planned.lower(shape)) == _served_text(runner, shape)


@pytest.mark.parametrize("kind", ["deepseek", "gpt-oss"])
def test_latent_and_sliding_models_serve_the_program_the_planner_compiles(tmp_path, kind):
    if kind == "deepseek":
        model_dir = save_tiny_deepseek("v3_noaux_yarn", str(tmp_path), seed=3)
    else:
        model_dir = save_tiny("GptOssForCausalLM", str(tmp_path), seed=3)
    config = model_config(model_dir)
    layout = KVLayout.for_model(config)  # what the worker builds from vLLM's groups
    assert (layout.num_groups, bool(config.latent_cache_width)) == (
        (1, True) if kind == "deepseek" else (2, False)
    )
    runner = _runner(model_dir, None, layout)
    setup, planned = _planned(runner, None)
    assert planned.layout == runner.step_program.layout
    assert [(c.shape, c.dtype) for c in planned.caches] == [(c.shape, c.dtype) for c in runner.kv_caches]
    assert planned.context == runner.step_program.context
    shape = step_shape(setup, 4, 4)
    assert program_text(planned.lower(shape)) == _served_text(runner, shape)


def test_lora_adds_the_adapter_slots_to_the_program(model_dir):
    base, lora = (_planned(_runner(model_dir, config), config)[1] for config in (None, LORA))
    extra = len(lora.state) - len(base.state)
    # An A and a B slot array at each adapter site: q/k/v (fused), o, gate/up (fused), down.
    assert extra == 2 * 4 * model_config(model_dir).num_layers
    slots = [leaf for leaf in lora.state if leaf.shape[0] == LORA.max_loras + 1 and leaf.ndim == 3]
    assert len(slots) == extra
    shape = (8, 4, 4)
    assert program_text(lora.lower(shape)) != program_text(base.lower(shape))


def test_kv_layout_from_groups():
    # Gemma-2-like: layers 0, 2, 4 slide, 1, 3, 5 do not; vLLM's groups list them in order.
    layout = KVLayout.from_groups([[0, 2, 4], [1, 3, 5]], 6)
    assert layout == KVLayout((0, 1, 0, 1, 0, 1), (0, 0, 1, 1, 2, 2), 3, 2)
    assert KVLayout.from_groups([range(4)], 4) == KVLayout((), (), 4, 1)
    with pytest.raises(ValueError, match="must hold each of the 3 layers once; missing \\[2\\]"):
        KVLayout.from_groups([[0, 1]], 3)


def test_kv_layout_for_a_model_groups_every_nth_layer_of_a_kind():
    # Gemma-3-like 5:1 pattern over 12 layers: sliding 0-4 and 6-10, full 5 and 11 -> groups of
    # 2 layers, the sliding ones in 5 groups of every 5th sliding layer: (0, 6), (1, 7), ...
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(12))
    gemma3 = dataclasses.replace(first_layers(model_config("gemma-2-9b"), 12), layer_sliding_windows=windows)
    layout = KVLayout.for_model(gemma3)
    assert (layout.num_groups, layout.num_caches) == (6, 2)
    assert layout.layer_groups == (0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5)
    assert layout.layer_caches == (0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1)
    # 12 sliding and 13 full layers: one group of each kind, 13 wide (no 12 groups of one).
    windows = (512,) * 12 + (None,) * 13
    assert KVLayout.for_model(dataclasses.replace(gemma3, num_layers=25, layer_sliding_windows=windows)) == (
        KVLayout((0,) * 12 + (1,) * 13, tuple(range(12)) + tuple(range(13)), 13, 2)
    )


def test_a_model_cut_to_its_first_layers_keeps_their_widths_and_windows():
    gemma = model_config("gemma-2-9b")
    cut = first_layers(gemma, 4)
    assert (cut.num_layers, cut.hidden_size, cut.layer_sliding_windows) == (
        4, gemma.hidden_size, gemma.layer_sliding_windows[:4]
    )  # fmt: skip
    assert first_layers(gemma, 0) is gemma
    with pytest.raises(ValueError, match="cannot cut 42 layers to 50"):
        first_layers(gemma, 50)


def test_device_given_only_at_tp1():
    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-4", tp_size=4)
    with pytest.raises(ValueError, match="one-device one: use tp_size=1"):
        step_program(setup, 4, device=jax.devices()[0])
