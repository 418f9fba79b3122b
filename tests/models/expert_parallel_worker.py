# SPDX-License-Identifier: Apache-2.0
"""Run by `test_expert_parallel.py` in a process with 4 simulated CPU devices, for one tiny model
directory: its weights streamed onto meshes of 2 and 4 devices (or the sizes asked for) with the
experts split by index (`models.sharding`'s `expert_parallel=True`, as the runner places them
under `--enable-expert-parallel`), its MoE layers told so (`models.moe.use_expert_parallel`),
against the same model on one device: prefill logits, greedy tokens, each expert array's
per-device shape, and the collectives of the compiled prefill. `--more` also compares int8 (per
channel and grouped) and fp8 experts at 4 devices, and counts the collectives with the MoE
layers not told (a check that the count sees moved weights); `--layer` compares the first MoE
layer alone (DeepSeek's latent attention has a cache of its own). Prints `REPORT {json}`."""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig
from models.moe import use_expert_parallel
from tests.tpu_platform.tensor_parallel_weights_worker import (
    _caches,
    _forward,
    _metadata,
    arrays,
    greedy,
    prefill_logits,
)
from tpu_platform.mesh import tensor_parallel_mesh
from tpu_platform.planner.hlo import hlo_collectives
from tpu_platform.runner_state import weight_sharding
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared

DTYPE = "float32"
PROMPT = [1, 5, 9, 17, 33, 65, 100, 7, 3, 250, 12]
NEW_TOKENS = 6


def load(model_dir: str, ep: int, *, flagged: bool = True, quantization: str = "none") -> nnx.Module:
    """The model streamed onto `ep` devices with its experts by index (one device for 1);
    `flagged=False`: its MoE layers not told so (they then compute as if split inside each
    expert, and XLA has to move the weights to match); `quantization` as `Preparation`'s."""
    if ep == 1:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        sharding = functools.partial(weight_sharding, tensor_parallel_mesh(ep), expert_parallel=True)
    _, model = load_prepared(model_dir, Preparation(DTYPE, tp_size=ep, quantization=quantization), sharding)
    if ep > 1 and flagged:
        assert use_expert_parallel(model) > 0
    return model


def expert_shapes(model: nnx.Module) -> dict[str, list[list[int]]]:
    """Each expert array's global shape and its first device's share."""
    return {
        name: [list(array.shape), list(array.addressable_shards[0].data.shape)]
        for name, array in arrays(model).items()
        if ".experts." in f".{name}."
    }


def collectives(model: nnx.Module, config: ModelConfig, ep: int) -> list[tuple[str, int]]:
    """Kind and result elements of each collective in the compiled prefill of `PROMPT`."""
    kv, stacked = _caches(config, ep)
    positions, md = _metadata(0, len(PROMPT), stacked)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(PROMPT, jnp.int32)
    lowered = _forward.lower(graphdef, state, kv, ids, jnp.asarray(positions), md, True)
    return [(c.kind, sum(c.result_elements)) for c in hlo_collectives(lowered.compile().as_text())]


def model_report(model_dir: str, more: bool = False, sizes: tuple[int, ...] = (2, 4)) -> dict:
    config = ModelConfig.from_pretrained(model_dir)
    reference = load(model_dir, 1)
    want = prefill_logits(reference, config, 1, PROMPT)
    report = {
        "expert_elements": config.hidden_size * config.moe_intermediate_size,
        "tokens_1": greedy(reference, config, 1, PROMPT, NEW_TOKENS),
        "scale": float(np.abs(want).max()),
    }
    for ep in sizes:
        model = load(model_dir, ep)
        got = prefill_logits(model, config, ep, PROMPT)
        report[f"max_diff_{ep}"] = float(np.abs(got - want).max())
        report[f"tokens_{ep}"] = greedy(model, config, ep, PROMPT, NEW_TOKENS)
        report[f"experts_{ep}"] = expert_shapes(model)
        report[f"collectives_{ep}"] = collectives(model, config, ep)
    if more:  # the check that the count sees moved weights, once
        report["collectives_unflagged"] = collectives(load(model_dir, 4, flagged=False), config, 4)
    if more:  # int8 and fp8 expert stacks with their scales (per channel or group) split alike
        for quantization in ("int8", "fp8", "int8-g16"):
            want = prefill_logits(load(model_dir, 1, quantization=quantization), config, 1, PROMPT)
            got = prefill_logits(load(model_dir, 4, quantization=quantization), config, 4, PROMPT)
            report[f"{quantization}_max_diff_4"] = float(np.abs(got - want).max())
    return report


def first_moe_layer(model: nnx.Module) -> nnx.Module:
    return next(layer.mlp for layer in model.model.layers if hasattr(type(layer.mlp), "expert_parallel"))


def layer_report(model_dir: str, sizes: tuple[int, ...] = (2, 4)) -> dict:
    """The first MoE layer (routed and shared experts) on `[T, D]` random hidden states."""
    config = ModelConfig.from_pretrained(model_dir)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(len(PROMPT), config.hidden_size)), jnp.float32)
    want = np.asarray(jax.jit(lambda layer, x: layer(x))(first_moe_layer(load(model_dir, 1)), x))
    report = {"scale": float(np.abs(want).max()), "tokens_by_hidden": len(PROMPT) * config.hidden_size}
    for ep in sizes:
        model = load(model_dir, ep)
        _, md = _metadata(0, len(PROMPT), {"mesh": tensor_parallel_mesh(ep)})
        layer = first_moe_layer(model)
        program = jax.jit(lambda layer, x, md: layer(x, md))
        got = program(layer, x, md)
        report[f"max_diff_{ep}"] = float(np.abs(np.asarray(got) - want).max())
        hlo = program.lower(layer, x, md).compile().as_text()
        report[f"collectives_{ep}"] = [(c.kind, sum(c.result_elements)) for c in hlo_collectives(hlo)]
        report[f"experts_{ep}"] = expert_shapes(model)
    return report


def main(model_dir: str, mode: str, sizes: tuple[int, ...]) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    if mode == "--layer":
        report = layer_report(model_dir, sizes)
    else:
        report = model_report(model_dir, mode == "--more", sizes)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    # argv: the model directory, the mode, and the mesh sizes as "2,4" (default both)
    sizes = tuple(int(n) for n in sys.argv[3].split(",")) if len(sys.argv) > 3 else (2, 4)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "--model", sizes)
