# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism across data-parallel replicas (`tpu_platform.replica_step`: 8 replicas of one
chip each, or 4 of 2 chips each, each replica attending to its own 64 decode sequences, the
routed experts split by index over the 8 chips), compiled by the real compilers at full width:
Qwen3-30B-A3B's first 2 layers on a v6e-8 (`make test`, both forms; 8x H100 and a 2k-token
prefill a replica in `make test-full`) and a DeepSeek-V3-shaped step (one dense layer, one with
256 routed experts and a shared one) on a v6e-8 (`make test-full`, both forms).

A chip holds E / 8 whole experts (as the planner counts them) and its replica's share of every
other weight; no buffer is as large as a whole expert stack (no expert weight moves). In a
decode step the replicas exchange exactly the experts' part: per MoE layer the gather of every
replica's tokens (`[R x 64, hidden]`) and routing (weights and expert ids), and the scatter of
the sums back (`[64, hidden]` a replica); attention, the embedding and the logits exchange
nothing across replicas. Inside a replica of 2 chips the rest is its tensor parallelism, nothing
larger than its own step's rows (or its logits). In a prefill step the TPU compiler may carry
the scatter as an all-reduce of the gathered rows and a permute; nothing exchanged is larger
than those rows.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from importlib import resources

import pytest

from tests.aot.toolchains import run_worker

CHIPS, DECODE_ROWS, PREFILL_TOKENS = 8, 64, 2048
# Of the 2 layers compiled, DeepSeek-V3's first is dense.
QWEN = {"hidden": 2048, "experts": 128, "expert_width": 768, "top_k": 8, "vocab": 151936, "moe_layers": 2}
DEEPSEEK = {
    "hidden": 7168,
    "experts": 256,
    "expert_width": 2048,
    "top_k": 8,
    "vocab": 129280,
    "moe_layers": 1,
}
# model:chips:layers, experts over replicas of one chip (dp) or of two (dp2)
QWEN_CASE, FULL = "qwen3-30b-a3b:8:2", pytest.mark.full
CASES = [
    pytest.param(("tpu", f"v6e-8:{QWEN_CASE}:dp", "decode", QWEN), id="qwen3-v6e-8-decode"),
    pytest.param(("tpu", f"v6e-8:{QWEN_CASE}:dp2", "decode", QWEN), id="qwen3-v6e-8-dp4xtp2-decode"),
    pytest.param(("tpu", f"v6e-8:{QWEN_CASE}:dp", "prefill", QWEN), id="qwen3-v6e-8-prefill", marks=FULL),
    pytest.param(("cuda", f"h100x8:{QWEN_CASE}:dp", "decode", QWEN), id="qwen3-h100x8-decode", marks=FULL),
    pytest.param(
        ("cuda", f"h100x8:{QWEN_CASE}:dp2", "decode", QWEN), id="qwen3-h100x8-dp4xtp2-decode", marks=FULL
    ),
    pytest.param(("tpu", "v6e-8:{deepseek}:8:2:dp", "decode,prefill", DEEPSEEK), id="deepseek", marks=FULL),
    pytest.param(("tpu", "v6e-8:{deepseek}:8:2:dp2", "decode", DEEPSEEK), id="deepseek-dp4xtp2", marks=FULL),
]

pytestmark = pytest.mark.timeout(3600)


def _deepseek_two_layers(tmp_path_factory) -> str:
    """DeepSeek-V3's shipped configuration cut to 2 layers, the first dense."""
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "deepseek-v3.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=2, first_k_dense_replace=1)
    path = tmp_path_factory.mktemp("deepseek") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> tuple[dict, str, dict]:
    platform, spec, stages, model = request.param
    if "{deepseek}" in spec:
        spec = spec.format(deepseek=_deepseek_two_layers(tmp_path_factory))
    (row,) = run_worker(platform, "expert_parallel_worker", stages, spec)
    per_replica = int(spec.rsplit(":dp", 1)[1] or 1)
    return row, stages, {**model, "replicas": CHIPS // per_replica, "per_replica": per_replica}


def test_a_chip_holds_its_eighth_of_the_experts_whole_and_no_expert_weight_moves(case):
    row, stages, model = case
    expert_kernels = 3 * model["hidden"] * model["expert_width"] * 2  # gate, up, down in bfloat16
    assert row["chip_expert_bytes"] == model["moe_layers"] * (model["experts"] // CHIPS) * expert_kernels
    assert row["planned_weight_bytes"] == row["placed_weight_bytes"]
    for stage in stages.split(","):
        assert row["steps"][stage]["expert_sized_buffers"] == [], stage


def _exchanged(collectives: list[dict]) -> Counter:
    """Each array a step's collectives give, as (kind, dtype, elements): one compiler combines
    the gathers of a layer into one collective, another gathers the routing as `[D, T, k]`."""
    arrays: Counter = Counter()
    for collective in collectives:
        for array in collective["results"].split(", "):
            dtype, dims = array.rstrip("]").split("[")
            elements = math.prod(int(d) for d in dims.split(",") if d)
            arrays[(collective["kind"], dtype, elements)] += collective["count"]
    return arrays


def test_a_decode_step_exchanges_the_experts_tokens_routing_and_sums_only(case):
    row, stages, model = case
    if "decode" not in stages:
        pytest.skip("a prefill step")
    gathered, hidden, k = model["replicas"] * DECODE_ROWS, model["hidden"], model["top_k"]
    layers = model["moe_layers"]
    want = Counter({
        ("all-gather", "bf16", gathered * hidden): layers,  # every replica's tokens
        ("all-gather", "f32", gathered * k): layers,  # their routing weights
        ("all-gather", "s32", gathered * k): layers,  # and expert ids
        ("reduce-scatter", "bf16", DECODE_ROWS * hidden): layers,  # each replica's sums
    })  # fmt: skip
    exchanged = _exchanged(row["steps"]["decode"]["collectives"])
    assert Counter({array: n for array, n in exchanged.items() if array in want}) == want
    inside = [array for array in exchanged if array not in want]  # a replica's tensor parallelism
    if model["per_replica"] == 1:
        assert inside == []
    else:
        assert inside and all(
            elements <= DECODE_ROWS * max(hidden, model["vocab"]) for *_, elements in inside
        )


def test_a_prefill_step_exchanges_nothing_larger_than_the_gathered_rows(case):
    row, stages, model = case
    if "prefill" not in stages:
        pytest.skip("a decode step")
    gathered = model["replicas"] * PREFILL_TOKENS
    for collective in row["steps"]["prefill"]["collectives"]:
        rows = int(collective["results"].split("[", 1)[1].split(",", 1)[0])
        assert rows <= gathered + gathered // 16, collective  # the compiler may pad a little
