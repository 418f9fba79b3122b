# SPDX-License-Identifier: Apache-2.0
"""Run by `test_gemma4_moe_on_mesh.py` in a process with 2 simulated CPU devices, for the tiny
Gemma 4 MoE checkpoint: its weights streamed onto one device, onto a TP=2 mesh (experts split
inside each expert) and onto 2 devices under expert parallelism (experts split by index,
the MoE layers told so), float and int8: each one's prefill logits, greedy tokens and the
per-device shape of layer 0's expert stacks. Prints `REPORT {json}`."""

from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np

from models import ModelConfig
from models.moe import use_expert_parallel
from tests.tpu_platform.tensor_parallel_weights_worker import arrays, greedy, prefill_logits
from tpu_platform.mesh import tensor_parallel_mesh
from tpu_platform.runner_state import weight_sharding as _weight_sharding
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared

PROMPT = [1, 5, 9, 17, 33, 65, 100, 7, 3, 250, 12, 40, 41, 300, 8, 77, 19, 23]  # longer than the window
NEW_TOKENS = 6
# name -> (devices, expert parallel, quantization)
RUNS = {
    "tp1": (1, False, "none"),
    "tp2": (2, False, "none"),
    "ep2": (2, True, "none"),
    "int8_tp1": (1, False, "int8"),
    "int8_tp2": (2, False, "int8"),
}


def run(model_dir: str, config: ModelConfig, devices: int, expert_parallel: bool, quantization: str) -> dict:
    if devices == 1:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        mesh = tensor_parallel_mesh(devices)
        sharding = functools.partial(_weight_sharding, mesh, expert_parallel=expert_parallel)
    preparation = Preparation("float32", tp_size=devices, quantization=quantization)
    _, model = load_prepared(model_dir, preparation, sharding)
    if expert_parallel:
        assert use_expert_parallel(model) == config.num_layers
    experts = {
        name.rsplit(".", 2)[-2]: [list(a.shape), list(a.addressable_shards[0].data.shape)]
        for name, a in arrays(model).items()
        if name.startswith("model.layers.0.moe.experts.") and name.endswith(".kernel")
    }
    return {
        "logits": prefill_logits(model, config, devices, PROMPT).tolist(),
        "tokens": greedy(model, config, devices, PROMPT, NEW_TOKENS),
        "experts": experts,
    }


def main(model_dir: str) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    config = ModelConfig.from_pretrained(model_dir)
    report = {name: run(model_dir, config, *spec) for name, spec in RUNS.items()}
    print("REPORT " + json.dumps(report, default=np.asarray))


if __name__ == "__main__":
    main(sys.argv[1])
