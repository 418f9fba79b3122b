# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles the pooling program (`tpu_platform.pooling`) for a compile-only target.

`python -m tests.aot.pooling_compile TARGET` (run by `toolchains.run_worker`) prints one JSON line:
per task and pooling method at a prefill-sized step, the compiled program's output shape and
memory analysis. Weights are abstract (`nnx.eval_shape`): nothing is allocated, only compiled.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from models import ModelConfig, build
from tpu_platform.planner.targets import compile_only_devices
from tpu_platform.pooling import PoolingConfig, make_pooler

EMBEDDER = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
)  # fmt: skip
CLASSIFIER = dataclasses.replace(EMBEDDER, architecture="Qwen3ForSequenceClassification", num_labels=2)
TOKENS, SEQS = 512, 8
CASES = [
    (EMBEDDER, PoolingConfig(task="embed", method="LAST")),
    (EMBEDDER, PoolingConfig(task="embed", method="MEAN")),
    (CLASSIFIER, PoolingConfig(task="classify", method="LAST", activation="softmax", logit_sigma=2.0)),
]


def compile_pooling(target_name: str, config: ModelConfig, pooling: PoolingConfig) -> dict:
    sharding = SingleDeviceSharding(compile_only_devices(target_name)[0])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(config, jnp.bfloat16)))
    leaves, state_def = jax.tree.flatten(state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        (
            leaves,
            jax.ShapeDtypeStruct((TOKENS, config.hidden_size), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, SEQS), jnp.int32),
        ),
    )
    compiled = make_pooler(graphdef, state_def, pooling).trace(*abstract).lower().compile()
    out = compiled.out_info
    return {
        "task": pooling.task,
        "method": pooling.method,
        "out_shape": list(out.shape),
        "out_dtype": str(out.dtype),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def main(argv: list[str]) -> None:
    (target_name,) = argv
    print(json.dumps([compile_pooling(target_name, config, pooling) for config, pooling in CASES]))


if __name__ == "__main__":
    main(sys.argv[1:])
