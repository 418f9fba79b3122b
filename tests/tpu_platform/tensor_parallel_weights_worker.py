# SPDX-License-Identifier: Apache-2.0
"""Run in a process of its own with 8 simulated CPU devices (`test_tensor_parallel_weights.py`).

For one model directory: streams its weights onto a 4-way mesh (recording the loader's peak
host bytes and each array's placement), writes its prepared weights at TP=2
as a converted model directory, restores that at TP=1 and TP=4 and loads the source at those
sizes too, and prints, as JSON, how each restored array compares with the source's (bit for bit,
sharding, bytes per device) and both models' greedy tokens."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import AttentionMetadata, ModelConfig
from models.sharding import kv_heads_on_mesh
from models.weight_stream import HostBytes
from pallas_kernels import allocate_kv_cache
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array
from tpu_platform.mesh import tensor_parallel_mesh
from tpu_platform.runner_state import weight_sharding
from tpu_platform.weights.converted import PREPARED_DIR, converted_weights, restore_converted
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared, metadata_for, save_prepared

DTYPE = "float32"
PAGE = 16
PAGES = 4


def shardings(tp: int):
    """What the runner restores and streams onto at `tp`."""
    if tp == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return functools.partial(weight_sharding, tensor_parallel_mesh(tp))


def arrays(model: nnx.Module) -> dict[str, jax.Array]:
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}


def describe(array: jax.Array) -> dict:
    return {
        "spec": [None if s is None else str(s) for s in getattr(array.sharding, "spec", ())],
        "bytes": int(array.nbytes),
        "device_bytes": sorted(int(s.data.nbytes) for s in array.addressable_shards),
        "devices": len(array.sharding.device_set),
    }


@functools.partial(jax.jit, static_argnums=(0, 6))
def _forward(graphdef, state, kv_caches, ids, positions, md, every_position=False):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(ids, positions, kv_caches, md)
    return model.compute_logits(hidden if every_position else hidden[-1:]), kv_caches


def _caches(config: ModelConfig, tp: int) -> tuple[list[jax.Array], dict]:
    """Empty KV caches of `PAGES` pages at `tp`, and the metadata fields a mesh's caches need."""
    mesh = tensor_parallel_mesh(tp)
    heads = kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp)
    if mesh is None:
        kv = [allocate_kv_cache(PAGES, PAGE, heads, config.head_dim, jnp.float32, backend="xla")
              for _ in range(config.num_layers)]  # fmt: skip
        return kv, {}
    kv = allocate_stacked_caches(
        config.num_layers, PAGES, PAGE, heads, config.head_dim, jnp.float32, "xla", mesh
    )
    per_array = caches_per_array(config.num_layers, PAGES, PAGE)
    return kv, {"cache_pages": PAGES, "caches_per_array": per_array, "mesh": mesh}


def _metadata(done: int, new: int, stacked: dict) -> tuple[np.ndarray, AttentionMetadata]:
    """The positions and metadata of one step of `new` tokens after `done` (one sequence)."""
    positions = np.arange(done, done + new, dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(positions),  # pages 0, 1, .. in order: slot == position
        kv_lens=jnp.asarray([done + new], jnp.int32),
        page_indices=jnp.asarray([list(range(PAGES))], jnp.int32),
        cu_q_lens=jnp.asarray([0, new], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        backend="xla",
        **stacked,
    )
    return positions, md


def prefill_logits(model: nnx.Module, config: ModelConfig, tp: int, prompt: list[int]) -> np.ndarray:
    """The float32 logits `[len(prompt), V]` of one prefill of `prompt` at `tp`."""
    kv, stacked = _caches(config, tp)
    positions, md = _metadata(0, len(prompt), stacked)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(prompt, jnp.int32)
    logits, _ = _forward(graphdef, state, kv, ids, jnp.asarray(positions), md, True)
    return np.asarray(logits, np.float32)


def greedy(
    model: nnx.Module,
    config: ModelConfig,
    tp: int,
    prompt: list[int],
    new_tokens: int,
    to_host: Callable[[jax.Array], np.ndarray] = np.asarray,
) -> list[int]:
    """Greedy tokens after `prompt`: one prefill, then one decode step a token (`to_host`: the
    logits as this host reads them; across hosts, gathered from every host's devices)."""
    kv, stacked = _caches(config, tp)
    graphdef, state = nnx.split(model)
    done, new, out = 0, list(prompt), []
    for _ in range(new_tokens):
        positions, md = _metadata(done, len(new), stacked)
        logits, kv = _forward(graphdef, state, kv, jnp.asarray(new, jnp.int32), jnp.asarray(positions), md)
        done += len(new)
        new = [int(np.argmax(to_host(logits)[-1]))]
        out.append(new[0])
    return out


def streamed(model_dir: str, tp: int) -> dict:
    """Streams the model onto `tp` devices; its placement and the host bytes held."""
    host_bytes = HostBytes()
    _, model = load_prepared(model_dir, Preparation(DTYPE, tp_size=tp), shardings(tp), host_bytes)
    placed = {name: describe(array) for name, array in arrays(model).items()}
    return {"loader_peak": host_bytes.peak, "tensors": host_bytes.tensors, "arrays": placed}


def written_at_two(model_dir: str, out: str) -> None:
    """A converted model directory whose checkpoint was written from a 2-way sharded model."""
    preparation = Preparation(DTYPE, tp_size=2)
    config, model = load_prepared(model_dir, preparation, shardings(2))
    os.makedirs(out)
    shutil.copy(os.path.join(model_dir, "config.json"), out)
    state = nnx.state(model)
    save_prepared(os.path.join(out, PREPARED_DIR), state, metadata_for(config, preparation, state))


def main(model_dir: str, scratch: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    report = {"streamed": streamed(model_dir, 4), "restored": {}}
    converted = os.path.join(scratch, "converted")
    written_at_two(model_dir, converted)
    config = ModelConfig.from_pretrained(model_dir)
    prompt = [1, 5, 9, 17, 33, 65, 100, 7]
    for tp in (1, 4):
        preparation = Preparation(DTYPE, tp_size=tp)
        _, source = load_prepared(model_dir, preparation, shardings(tp))
        restored = restore_converted(converted_weights(converted), config, preparation, shardings(tp))
        expected = arrays(source)
        got = arrays(restored)
        report["restored"][str(tp)] = {
            "same_structure": nnx.graphdef(source) == nnx.graphdef(restored)
            and expected.keys() == got.keys(),
            "arrays": {
                name: {
                    **describe(array),
                    "equal": array.dtype == expected[name].dtype
                    and np.asarray(array).tobytes() == np.asarray(expected[name]).tobytes(),
                    "same_sharding": array.sharding == expected[name].sharding,
                }
                for name, array in got.items()
            },
            "tokens": greedy(restored, config, tp, prompt, 6),
            "source_tokens": greedy(source, config, tp, prompt, 6),
        }
    report["damaged"] = damaged_restore(converted, config)
    print("REPORT " + json.dumps(report))


def damaged_restore(converted: str, config: ModelConfig) -> str:
    """The error restoring the TP=2 checkpoint at TP=4 once its array files are cut in half."""
    for root, _, files in os.walk(os.path.join(converted, PREPARED_DIR)):
        for name in files:
            path = os.path.join(root, name)
            if f"{os.sep}d{os.sep}" in path:
                os.truncate(path, os.path.getsize(path) // 2)
    try:
        restore_converted(converted_weights(converted), config, Preparation(DTYPE, tp_size=4), shardings(4))
    except ValueError as error:
        return str(error)
    return ""


if __name__ == "__main__":
    main(*sys.argv[1:])
