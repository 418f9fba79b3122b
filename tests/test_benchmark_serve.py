# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/_serve.server_command`: the serve workload's server takes each peer's own options,
so our int8 peer's server quantizes its weights as its offline engine does and no other peer's
does (the serve figures of `throughput.py --peers xla-int8` are int8's)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def scripts():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # `_serve` imports `_peers` as the scripts do
        yield load_benchmark("_peers", register=True), load_benchmark("_serve")


@pytest.mark.parametrize("peer", ["xla", "xla-int8", "xla-bf16", "vllm-cpu"])
def test_a_peers_server_quantizes_as_its_offline_engine(scripts, peer):
    peers, serve = scripts
    command = serve.server_command("/models/m", 8000, "bfloat16", "auto", peers.quantization_of(peer))
    quantized = "--quantization" in command
    assert quantized == (peer == "xla-int8")
    if quantized:
        assert command[command.index("--quantization") + 1] == "int8_per_channel_weight_only"
    assert command[command.index("--model") + 1] == "/models/m"
