# SPDX-License-Identifier: Apache-2.0
"""Serving across two hosts, each a process on this machine with 2 simulated CPU devices, joined
through the path a pod's hosts take (vLLM's multi-node options, `jax.distributed`, gloo
collectives), one tiny model at TP=4 across both, verifying n-gram drafts on the global mesh:
vLLM's OpenAI server on host 0 answers completions with transformers' greedy tokens (one device,
decoding without drafts), also under chunked prefill and preemption; one pair of hosts serves the
module. Two hosts verifying a draft model's, an EAGLE-3 head's or an MTP layer's drafts (a pair of
their own each, `make test-full`) answer with their target's transformers greedy tokens, drafts kept.
Killing host 1 ends host 0 with a clear error, non-zero, within the bound; a host that never
joins ends the other within `--distributed-timeout-seconds` (`make test-full`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.plugin_shim.multihost_launch import (
    completions,
    free_port,
    kill_host,
    metric,
    start_host,
    wait_healthy,
)
from tests.plugin_shim.predictive_drafters import (
    save_damped_deepseek_with_mtp_layer,
    save_damped_llama_with_eagle3_head,
)
from tests.tiny_models import save_damped_tiny_llama

pytestmark = pytest.mark.slow  # four vLLM processes and two JAX hosts

NEW_TOKENS = 6
# --distributed-timeout-seconds: the join's and a silent host's bound. The join starts when a
# host's worker starts, and host 0's worker comes up behind its API server and engine processes:
# on a loaded 2-core machine that is tens of seconds after the headless host's.
TIMEOUT_S = 60
# Chunked prefill (an 8-token step), 8 pages of 16 tokens for four long sequences (preemption).
CROWDED_TOKENS = 12
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, seed=0)
KV = dict(block_size=16, num_gpu_blocks_override=8)
SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 2},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}
SPECULATED_TOKENS = 24  # enough for the looping model's text to repeat itself
GREEDY = prompts([5, 13, 2], seed=3)
CROWDED = [prompts([40], seed=7)[0] + tail[1:] for tail in prompts([3, 9, 6, 12], seed=8)]


def _options(engine: dict) -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in engine.items()]


def _serve(timeout_s: int) -> list[str]:
    return [
        *_options({**ENGINE, **KV}),
        "--no-enable-prefix-caching",  # the crowded prompts share a prefix: it would leave pages free
        "--tensor-parallel-size=4",
        f"--distributed-timeout-seconds={timeout_s}",
    ]


SERVE = _serve(TIMEOUT_S)
# A lone host has no join to wait for: the bound it must keep can be short.
LONE_TIMEOUT_S = 10


@contextlib.contextmanager
def _two_hosts(model: str, serve: list[str], tmp) -> Iterator[tuple[int, list, list]]:
    """Host 1 (headless) and host 0 (the OpenAI server on the port given), both with `serve`'s
    options; the port, the processes and the logs (host 0's first), killed when the block ends."""
    master, port = free_port(), free_port()
    started = [start_host(1, model, serve, master, tmp, None), start_host(0, model, serve, master, tmp, port)]
    procs, logs = [p for p, _ in started[::-1]], [log for _, log in started[::-1]]
    try:
        wait_healthy(port, procs, logs, timeout=800)
        yield port, procs, logs
    finally:
        for proc in procs:
            kill_host(proc)


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> str:
    """A tiny Llama whose layers' outputs are damped: its greedy text falls into loops that n-gram
    drafts predict, while every layer still changes the logits (some drafts fail)."""
    return save_damped_tiny_llama(str(tmp_path_factory.mktemp("looping")), seed=2, scale=0.02)


@pytest.fixture(scope="module")
def reference(looping_model) -> dict[str, list[list[int]]]:
    """Transformers' greedy decoding in one process (one device), without drafts: the tokens
    every pair of hosts must give."""
    hf = LlamaForCausalLM.from_pretrained(looping_model, dtype=torch.float32).eval()
    return {
        "greedy": [hf_greedy(hf, p, SPECULATED_TOKENS) for p in GREEDY],
        "crowded": [hf_greedy(hf, p, CROWDED_TOKENS) for p in CROWDED],
    }


def _speculating(method: str, looping_model: str) -> list[str]:
    """`SERVE` with drafts of `method` (the draft model: the target itself)."""
    drafter = {} if method == "ngram" else {"model": looping_model}
    return [*SERVE, f"--speculative-config={json.dumps({**SPECULATION[method], **drafter})}"]


def _drafts_kept(port: int, method: str) -> tuple[float, float]:
    drafted = metric(port, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(port, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"{method}: {accepted:.0f} of {drafted:.0f} drafts kept")
    return accepted, drafted


def _speculating_checkpoints(method: str, looping_model: str, tmp) -> tuple[str, dict, object]:
    """The target, the speculative config's drafter options and the target's transformers
    reference for `method`: the looping model (drafting for itself as the draft model), or a
    damped target whose EAGLE-3 head or MTP layer drafts tokens it often keeps."""
    if method == "eagle3":
        target, head = save_damped_llama_with_eagle3_head(str(tmp / "target"), str(tmp / "head"), seed=5)
        return target, {"model": head}, LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    if method == "mtp":
        target = save_damped_deepseek_with_mtp_layer(str(tmp / "target"), seed=21)
        hf = DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager")
        return target, {}, hf
    return (
        looping_model,
        {"model": looping_model},
        LlamaForCausalLM.from_pretrained(looping_model, dtype=torch.float32),
    )


# n-gram drafts: the module's own pair of hosts (`hosts`, below). The others, `make test-full`: a
# drafter that runs on the global mesh (every host calls its programs in step).
@pytest.fixture(params=[pytest.param(m, marks=pytest.mark.full) for m in ("draft_model", "eagle3", "mtp")])
def speculating_hosts(request, looping_model, tmp_path):
    """Both hosts at TP=4 serving a target with drafts of `request.param`'s method; a pair of
    its own, up only for its test. Yields the method, host 0's port, the target and its
    transformers reference."""
    target, drafter, hf = _speculating_checkpoints(request.param, looping_model, tmp_path)
    serve = [*SERVE, f"--speculative-config={json.dumps({**SPECULATION[request.param], **drafter})}"]
    with _two_hosts(target, serve, tmp_path) as (port, _, _):
        yield request.param, port, target, hf.eval()


def test_two_hosts_verify_drafts_to_the_tokens_of_no_speculation(speculating_hosts):
    """Runs first, before the module's hosts start. Host 0's scheduler sends its worker's drafts
    to both hosts in the step's inputs; both run the verification and the drafter's programs
    (draft model, EAGLE-3 head, MTP layer) on the global mesh. Greedy tokens: transformers',
    decoding without drafts."""
    method, port, target, hf = speculating_hosts
    for batch, new in ((GREEDY, SPECULATED_TOKENS), (CROWDED, CROWDED_TOKENS)):
        assert completions(port, target, batch, new) == [hf_greedy(hf, p, new) for p in batch]
    accepted, drafted = _drafts_kept(port, method)
    assert 0 < accepted <= drafted


@pytest.fixture(scope="module")
def hosts(looping_model, tmp_path_factory):
    """Host 1 (headless) and host 0 (the OpenAI server on `port`), both serving `looping_model`
    at TP=4 and verifying n-gram drafts: one pair for the module's tests."""
    serve, tmp = _speculating("ngram", looping_model), tmp_path_factory.mktemp("hosts")
    with _two_hosts(looping_model, serve, tmp) as (port, procs, logs):
        yield {"port": port, "host0": procs[0], "host1": procs[1], "log0": logs[0]}


def test_two_hosts_at_tp4_verify_ngram_drafts_to_the_one_device_tokens(hosts, looping_model, reference):
    """Host 0's scheduler sends its worker's drafts to both hosts in the step's inputs; both run
    the verification on the global mesh. Drafts kept and drafts rejected."""
    assert completions(hosts["port"], looping_model, GREEDY, SPECULATED_TOKENS) == reference["greedy"]
    assert "drives JAX devices: cpu:0, cpu:1 (of 4 on 2 hosts)" in hosts["log0"].read_text()
    accepted, drafted = _drafts_kept(hosts["port"], "ngram")
    assert 0 < accepted < drafted


def test_two_hosts_under_chunked_prefill_and_preemption(hosts, looping_model, reference):
    before = metric(hosts["port"], "vllm:num_preemptions_total")
    assert completions(hosts["port"], looping_model, CROWDED, CROWDED_TOKENS) == reference["crowded"]
    assert metric(hosts["port"], "vllm:num_preemptions_total") > before


def test_killing_host_1_ends_host_0_with_a_clear_error_in_bounded_time(hosts, looping_model):
    """Runs last: it ends the hosts."""
    kill_host(hosts["host1"])
    start = time.monotonic()
    with pytest.raises(Exception, match="500"):
        completions(hosts["port"], looping_model, GREEDY[:1], NEW_TOKENS)  # a step that needs host 1
    code = hosts["host0"].wait(timeout=TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    log = hosts["log0"].read_text()
    assert code != 0, log[-4000:]
    assert elapsed < TIMEOUT_S + 60
    assert "another host died or left mid-step; restart every host" in log


# `make test-full`: JAX's own join bound; make test checks that vLLM's option reaches it
# (tests/plugin_shim/test_multihost_config.py) and host 0 ending when host 1 dies (above).
@pytest.mark.full
def test_a_host_that_never_joins_ends_the_other_within_the_timeout(looping_model, tmp_path):
    proc, log = start_host(0, looping_model, _serve(LONE_TIMEOUT_S), free_port(), tmp_path, free_port())
    start = time.monotonic()
    try:
        code = proc.wait(timeout=LONE_TIMEOUT_S + 240)  # the timeout after vLLM's and JAX's start
    finally:
        kill_host(proc)
    text = log.read_text()
    assert code != 0, text[-4000:]
    assert time.monotonic() - start < LONE_TIMEOUT_S + 240
    assert "joining 2 hosts as host 0 at 127.0.0.1" in text
    assert f"waiting up to {LONE_TIMEOUT_S} s for every host to join" in text


@pytest.mark.full  # two more hosts started; make test ends host 0 when host 1 dies mid-step
def test_killing_host_0_ends_the_headless_host_within_the_timeout(looping_model, tmp_path):
    """Host 1 idles between steps: JAX's coordination service (host 0's) stops answering, and
    after `--distributed-timeout-seconds` of silence host 1's worker is ended, then its host."""
    master, port = free_port(), free_port()
    host1, log1 = start_host(1, looping_model, SERVE, master, tmp_path, None)
    host0, log0 = start_host(0, looping_model, SERVE, master, tmp_path, port)
    try:
        wait_healthy(port, [host0, host1], [log0, log1], timeout=800)
        kill_host(host0)
        start = time.monotonic()
        code = host1.wait(timeout=TIMEOUT_S + 120)
        elapsed = time.monotonic() - start
    finally:
        kill_host(host0)
        kill_host(host1)
    text = log1.read_text()
    assert code != 0, text[-4000:]
    assert elapsed < TIMEOUT_S + 120
    assert "vllm-xla serve: exiting with status 1" in text
