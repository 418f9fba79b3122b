# SPDX-License-Identifier: Apache-2.0
"""The runner's start-up phases and the weights' source: which source a model's weights come from
(a converted directory, then the weights cache, then the checkpoint) and why; and a runner used
before a phase has run names that phase instead of failing on a missing attribute."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.tiny_models import save_tiny_llama
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.runner_state import PhaseNotRun
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import CachedRequests, NewRequest, StepUpdate
from tpu_platform.weights.converted import convert
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.source import CACHED, CHECKPOINT, CONVERTED, load_served_weights

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("runner_phases_llama")), seed=5)


def _served(model_path: str, **config):
    config = RunnerConfig(model_path=model_path, **config)
    return load_served_weights(config, jnp.dtype(jnp.float32), None, _ON_DEVICE)


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]


def test_the_weights_come_from_the_first_source_that_has_them_and_say_why(tiny_dir, tmp_path):
    cache_dir = str(tmp_path / "cache")
    plain = _served(tiny_dir)  # no weights cache asked for: the checkpoint
    assert plain.source.name == CHECKPOINT and "load_format='auto'" in plain.source.reason
    no_dir = _served(tiny_dir, load_format="npcache")
    assert no_dir.source.name == CHECKPOINT and "no cache directory" in no_dir.source.reason

    stored = _served(tiny_dir, load_format="npcache", cache_dir=cache_dir)
    assert stored.source.name == CHECKPOINT and "stored there" in stored.source.reason
    assert os.listdir(os.path.join(cache_dir, "weights"))  # the entry the next start reads
    cached = _served(tiny_dir, load_format="npcache", cache_dir=cache_dir)
    assert cached.source.name == CACHED and "float32-none" in cached.source.reason
    assert str(cached.source) == f"{CACHED} ({cached.source.reason})"  # as the start-up log says it

    converted_dir = str(tmp_path / "converted")
    convert(tiny_dir, converted_dir, Preparation("float32"))
    other_cache = str(tmp_path / "other_cache")
    converted = _served(converted_dir, load_format="npcache", cache_dir=other_cache)
    # Before the weights cache: nothing read from it, nothing stored there.
    assert converted.source.name == CONVERTED and converted_dir in converted.source.reason
    assert not os.path.exists(os.path.join(other_cache, "weights"))
    for served in (stored, cached, converted):
        assert served.config == plain.config
        for got, expected in zip(_weights(served.model), _weights(plain.model), strict=True):
            np.testing.assert_array_equal(got, expected)


def _one_prompt() -> StepUpdate:
    request = NewRequest("a", [1, 2, 3], [[0]], 0, SamplingOptions(temperature=0.0))
    no_others = {"cached": CachedRequests.of([]), "finished_req_ids": set()}
    return StepUpdate(new_requests=[request], num_scheduled_tokens={"a": 3}, **no_others)


def test_a_step_before_its_phase_names_the_phase(tiny_dir):
    runner = Runner(
        RunnerConfig(
            model_path=tiny_dir, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=16,
            native_dense=False,
        )
    )  # fmt: skip
    assert runner.loaded is None and runner.steps is None
    for call in (lambda: runner.execute(_one_prompt()), runner.warm_up, runner.kv_page_bytes):
        with pytest.raises(PhaseNotRun, match=r"which has not run on this runner: call load_model\(\)"):
            call()
    both = r"call load_model\(\), then initialize_kv_cache\(num_pages\) first"
    with pytest.raises(PhaseNotRun, match=both):
        _ = runner.table

    runner.load_model()
    assert runner.steps is None and runner.model_config is runner.loaded.config
    for call in (lambda: runner.execute(_one_prompt()), runner.warm_up):
        with pytest.raises(PhaseNotRun, match=r"Runner\.\w+ is made by initialize_kv_cache\(num_pages\)"):
            call()
    with pytest.raises(AttributeError, match="made once by its phase"):
        runner.model_config = None  # a record's attribute is never assigned on its own

    runner.initialize_kv_cache(num_pages=4)
    runner.execute(_one_prompt())  # the request the failed calls left no trace of
    assert runner.sample().req_ids == ["a"]
