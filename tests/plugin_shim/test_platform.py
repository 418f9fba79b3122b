# SPDX-License-Identifier: Apache-2.0
"""Activation rules, configuration and request validation of the platform."""

import inspect
import logging
import os
import pathlib
import re

import pytest
from vllm import SamplingParams

import plugin_shim
from plugin_shim import devices, translate
from tests.tiny_models import save_tiny_llama
from tpu_platform import envs
from tpu_platform.envs import read_env


def test_register_is_inactive_without_tpu_or_opt_in(monkeypatch):
    monkeypatch.delenv("VLLM_XLA_PLATFORM", raising=False)
    monkeypatch.setattr(devices, "detect_tpu", lambda: False)
    assert plugin_shim.register() is None


def test_register_activates_for_a_named_device_kind(monkeypatch):
    for kind in ("tpu", "gpu", "cpu"):
        monkeypatch.setenv("VLLM_XLA_PLATFORM", kind)
        assert plugin_shim.register() == "plugin_shim.platform.XlaPlatform"


def test_register_activates_on_a_visible_tpu(monkeypatch):
    monkeypatch.delenv("VLLM_XLA_PLATFORM", raising=False)
    monkeypatch.setattr(devices, "detect_tpu", lambda: True)
    assert plugin_shim.register() == "plugin_shim.platform.XlaPlatform"


def test_no_accelerator_runtime_here_means_cpu():
    assert devices.detect_tpu() is False
    assert devices.detect_device_kind() == "cpu"


def test_bad_environment_values_are_named():
    with pytest.raises(ValueError, match="VLLM_XLA_PLATFORM='cuda' is not valid; use one of tpu, gpu, cpu"):
        read_env({"VLLM_XLA_PLATFORM": "cuda"})
    with pytest.raises(ValueError, match="VLLM_XLA_CPU_KV_CACHE_GB='lots' is not a number"):
        read_env({"VLLM_XLA_CPU_KV_CACHE_GB": "lots"})
    env = read_env({"XDG_CACHE_HOME": "/x"})
    assert (env.platform, env.attention_backend, env.cache_dir) == (None, "auto", "/x/vllm-xla")
    assert (env.strict_compile, env.cpu_async_scheduling) == (False, False)
    assert read_env({"VLLM_XLA_CPU_ASYNC_SCHEDULING": "1"}).cpu_async_scheduling
    assert not read_env({"VLLM_XLA_CPU_ASYNC_SCHEDULING": "no"}).cpu_async_scheduling
    with pytest.raises(ValueError, match="VLLM_XLA_CPU_ASYNC_SCHEDULING='on' is not valid; use 1"):
        read_env({"VLLM_XLA_CPU_ASYNC_SCHEDULING": "on"})


def test_every_knob_read_is_listed_and_documented():
    read = set(re.findall(r'"(VLLM_XLA_[A-Z_]+)"', inspect.getsource(read_env)))
    assert read == set(envs.VARIABLES)
    page = (pathlib.Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(VLLM_XLA_[A-Z_]+)`", page, re.M))
    assert documented == set(envs.VARIABLES)


def test_unknown_knobs_are_named_with_the_nearest_known_one():
    environ = {
        "VLLM_XLA_CPU_KV_CACHE_GIB": "2",
        "VLLM_XLA_PLATFORM": "cpu",
        "VLLM_XLA_ZZZ": "1",
        "VLLM_X": "1",
    }
    assert envs.unknown_variables(environ) == [
        "unknown vllm-xla environment variable VLLM_XLA_CPU_KV_CACHE_GIB: "
        "did you mean VLLM_XLA_CPU_KV_CACHE_GB?",
        "unknown vllm-xla environment variable VLLM_XLA_ZZZ: known ones: " + ", ".join(envs.VARIABLES),
    ]
    assert envs.unknown_variables({name: "1" for name in envs.VARIABLES}) == []


@pytest.fixture
def xla_warnings():
    """The warnings of the platform's `vllm.xla` logger (vLLM's loggers do not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("vllm.xla")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_vllm_validates_our_knobs_as_ours(monkeypatch, tmp_path, xla_warnings):
    """vLLM's environment check (run by `EngineArgs.create_engine_config`) no longer calls our
    knobs unknown, names a misspelt one, still checks vLLM's own, and fails when asked to."""
    from vllm.engine.arg_utils import EngineArgs

    from plugin_shim.platform import XlaPlatform

    for name in [n for n in os.environ if n.startswith("VLLM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setenv("VLLM_XLA_CPU_KV_CACHE_GB", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's own: known to it
    XlaPlatform.validate_environ(hard_fail=True)
    assert xla_warnings == []
    monkeypatch.setenv("VLLM_XLA_STRICT_COMPIL", "1")
    monkeypatch.setenv("VLLM_NOT_A_KNOB", "1")
    XlaPlatform.validate_environ(hard_fail=False)
    assert sorted(r.getMessage() for r in xla_warnings) == [
        "Unknown vLLM environment variable detected: VLLM_NOT_A_KNOB",
        "unknown vllm-xla environment variable VLLM_XLA_STRICT_COMPIL: did you mean VLLM_XLA_STRICT_COMPILE?",
    ]
    with pytest.raises(ValueError, match="VLLM_XLA_STRICT_COMPIL: did you mean VLLM_XLA_STRICT_COMPILE"):
        XlaPlatform.validate_environ(hard_fail=True)
    with pytest.raises(ValueError, match="VLLM_XLA_STRICT_COMPIL: did you mean"):  # vLLM's own call
        EngineArgs(model=str(tmp_path), fail_on_environ_validation=True).create_engine_config()


@pytest.mark.parametrize(
    ("device", "keep", "asked", "expected"),
    [
        ("cpu", "0", True, False),  # the CPU device: off, as vLLM's CPU backend does
        ("cpu", "1", True, True),  # VLLM_XLA_CPU_ASYNC_SCHEDULING=1 keeps it
        ("cpu", "0", False, False),
        ("tpu", "0", True, True),  # accelerators keep vLLM's choice
        ("gpu", "0", True, True),
        ("gpu", "0", False, False),
    ],
)
def test_async_scheduling_is_off_on_the_cpu_device_unless_kept(monkeypatch, device, keep, asked, expected):
    from types import SimpleNamespace

    from plugin_shim.platform import _async_scheduling_off_on_cpu

    monkeypatch.setenv("VLLM_XLA_PLATFORM", device)
    monkeypatch.setenv("VLLM_XLA_CPU_ASYNC_SCHEDULING", keep)
    scheduler = SimpleNamespace(async_scheduling=asked)
    _async_scheduling_off_on_cpu(scheduler)
    assert scheduler.async_scheduling is expected


def test_sampling_params_translate_and_unsupported_ones_are_rejected():
    params = SamplingParams(temperature=0.5, top_k=5, seed=3, min_tokens=2, stop_token_ids=[7], logprobs=2)
    options = translate.sampling_options(params)
    assert (options.temperature, options.top_k, options.seed, options.min_tokens, options.logprobs) == (
        0.5, 5, 3, 2, 2,
    )  # fmt: skip
    assert 7 in options.stop_token_ids
    with pytest.raises(ValueError, match="logprob_token_ids"):
        translate.sampling_options(SamplingParams(logprob_token_ids=[1, 2]))


@pytest.mark.parametrize(
    ("kwargs", "entries"),
    [
        (dict(logit_bias={t: 1.0 for t in range(5000)}), 5000),
        (dict(logit_bias={t: 1.0 for t in range(4000)}, min_tokens=3, stop_token_ids=list(range(97))), 4097),
        (dict(logit_bias={t: 1.0 for t in range(4000)}, bad_words=[f"w{i}" for i in range(49)]), 4098),
    ],
)
def test_requests_wider_than_the_warmed_sparse_list_are_refused_by_name(kwargs, entries):
    from vllm.exceptions import VLLMValidationError

    from plugin_shim.platform import XlaPlatform

    limit = f"needs {entries} sampler entries, more than vllm-xla's limit of 4096"
    with pytest.raises(ValueError, match=limit) as raised:
        XlaPlatform.validate_request(None, SamplingParams(**kwargs))
    assert isinstance(raised.value, VLLMValidationError)  # vLLM's server answers 400, not 500


def test_requests_at_the_sparse_limit_pass():
    from plugin_shim.platform import XlaPlatform

    XlaPlatform.validate_request(None, SamplingParams(logit_bias={t: 1.0 for t in range(4096)}))
    # Stop ids count only while min_tokens holds them back.
    params = SamplingParams(logit_bias={t: 1.0 for t in range(4000)}, stop_token_ids=list(range(500)))
    XlaPlatform.validate_request(None, params)


def test_kv_cache_dtype_maps_vllm_names_and_rejects_the_rest():
    from types import SimpleNamespace

    from plugin_shim.cache_dtype import runner_kv_cache_dtype

    def runner_dtype(name, skip=()):
        return runner_kv_cache_dtype(SimpleNamespace(cache_dtype=name, kv_cache_dtype_skip_layers=list(skip)))

    assert runner_dtype("auto") is None  # the model's dtype
    assert runner_dtype("bfloat16") == "bfloat16"
    assert runner_dtype("fp8") == runner_dtype("fp8_e4m3") == "float8_e4m3fn"
    assert runner_dtype("fp8_e5m2") == "float8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_inc' is not supported by vllm-xla; use auto"):
        runner_dtype("fp8_inc")
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers"):
        runner_dtype("fp8", skip=["model.layers.0"])


def test_load_formats_we_honour_pass_and_the_rest_are_named(tmp_path):
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from plugin_shim.platform import LOAD_FORMATS, runner_load_format

    for name in LOAD_FORMATS:
        assert runner_load_format(SimpleNamespace(load_format=name)) == name
    with pytest.raises(
        ValueError, match="load_format 'pt' is not supported by vllm-xla; use auto, safetensors, npcache"
    ):
        runner_load_format(SimpleNamespace(load_format="pt"))
    with pytest.raises(ValueError, match="vllm-xla model-dir --gguf FILE"):
        runner_load_format(SimpleNamespace(load_format="gguf"))
    # vLLM's own configuration step refuses it, before any engine starts.
    model_dir = save_tiny_llama(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="load_format 'pt' is not supported by vllm-xla"):
        EngineArgs(model=model_dir, max_model_len=128, load_format="pt").create_engine_config()
    config = EngineArgs(model=model_dir, max_model_len=128, load_format="npcache").create_engine_config()
    assert config.load_config.load_format == "npcache"


def test_engine_process_is_forked_unless_jax_runs_here(monkeypatch):
    """vLLM's default start (fork) is kept while JAX has no backend in this process (a front end
    never starts one); once JAX runs here, a fork would copy XLA without its threads: spawn."""
    import sys
    from types import SimpleNamespace

    import jax

    from plugin_shim.platform import _engine_start_method, jax_runs_here

    jax.devices()  # JAX runs in this (test) process
    assert jax_runs_here()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")  # restored after the test
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    _engine_start_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # asked for, and unsafe here
    _engine_start_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"

    idle = SimpleNamespace(backends_are_initialized=lambda: False)  # imported, no backend yet
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", idle)
    assert not jax_runs_here()
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    _engine_start_method()
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ  # vLLM's own default: fork
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # a user's choice stays
    _engine_start_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.delitem(sys.modules, "jax._src.xla_bridge")
    assert not jax_runs_here()  # JAX never imported


_ENGINE_PROCESS_SCRIPT = """
import os, sys
if sys.argv[2] == "jax-first":
    import jax
    jax.devices()  # JAX runs in this process before vLLM starts its engine process
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    print("METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"), len(out[0].outputs[0].token_ids))
"""


@pytest.mark.slow
# The forked start is also every OpenAI server test's (their front end runs no JAX): `make test-full`.
@pytest.mark.parametrize(
    ("order", "method"), [("jax-first", "spawn"), pytest.param("vllm-only", "fork", marks=pytest.mark.full)]
)
def test_engine_process_starts_and_answers_with_jax_running_or_not(tmp_path, order, method):
    """`vllm.LLM` with its engine in a process of its own: forked when the caller runs no JAX,
    spawned when it does (a fork there deadlocks), and both answer."""
    import subprocess
    import sys

    from tests.tiny_models import save_tiny_llama

    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=3)
    script = tmp_path / "engine_process.py"
    script.write_text(_ENGINE_PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    done = subprocess.run(
        [sys.executable, str(script), model_dir, order], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"METHOD {method} 3" in done.stdout
