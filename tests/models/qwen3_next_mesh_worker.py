# SPDX-License-Identifier: Apache-2.0
"""Run by `test_qwen3_next_on_mesh.py` in a process with 4 simulated CPU devices (and by
`test_qwen3_5_quantized_on_mesh.py` with 2): a tiny hybrid model streamed onto a mesh of each
asked size (as the runner loads it: `load_prepared` onto the rules table's shardings, a
quantized checkpoint in its own values and layout: `int8_quantization`) with its caches split
as the runner allocates them (`tpu_platform.state_cache.allocate_layer_caches`), driven
directly for two ragged steps: two prompts at once (one longer than the gated delta rule's
64-token chunk), then a decode and a 3-token chunk continuing from the carried states. Writes
every row's logits, and the placement of a few arrays, as JSON.

`python -m tests.models.qwen3_next_mesh_worker MODEL_DIR TP[,TP..] OUT.json`
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import AttentionMetadata, ModelConfig
from models.checkpoint_kinds import checkpoint_values
from models.sharding import kv_heads_on_mesh
from tests.tpu_platform.tensor_parallel_weights_worker import describe, shardings
from tpu_platform.mesh import tensor_parallel_mesh
from tpu_platform.state_cache import allocate_layer_caches
from tpu_platform.step_program import KVLayout
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import load_prepared

PAGE, PAGES = 16, 8
# Each sequence's pages (its first: its state slot in the Gated DeltaNet layers' pools).
SEQ_PAGES = [[3, 1, 2, 4, 5, 7], [6]]
# The first step's prompt lengths; the second step's new tokens (a decode, and a 3-token chunk).
PROMPT_LENGTHS = (70, 9)
CONTINUATIONS = [[11], [12, 13, 14]]


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[1, *rng.integers(3, 384, n - 1).tolist()] for n in PROMPT_LENGTHS]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _forward(graphdef, state, caches, ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, caches = model(ids, positions, caches, md)
    return model.compute_logits(hidden), caches


def _step(model, caches, seqs, starts, mesh):
    """One ragged step of `seqs[i]` from position `starts[i]`: every row's logits, the caches."""
    lens = [len(s) for s in seqs]
    positions = np.concatenate([np.arange(st, st + n) for n, st in zip(lens, starts, strict=True)])
    per_seq = np.split(positions, np.cumsum(lens)[:-1])
    slots = np.concatenate(
        [np.asarray(SEQ_PAGES[i])[p // PAGE] * PAGE + p % PAGE for i, p in enumerate(per_seq)]
    )
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray([st + n for n, st in zip(lens, starts, strict=True)], jnp.int32),
        page_indices=jnp.asarray([p + [0] * (len(SEQ_PAGES[0]) - len(p)) for p in SEQ_PAGES], jnp.int32),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        backend="xla",
        mesh=mesh,
    )
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.concatenate(seqs), jnp.int32)
    logits, caches = _forward(graphdef, state, caches, ids, jnp.asarray(positions, jnp.int32), md)
    return np.asarray(logits, np.float32), caches


def run(model_dir: str, tp: int) -> dict:
    config = ModelConfig.from_pretrained(model_dir)
    # a quantized checkpoint served as it ships, as the runner prepares it
    quantization = int8_quantization(model_dir) if checkpoint_values(model_dir) else "none"
    preparation = Preparation("float32", tp_size=tp, quantization=quantization)
    _, model = load_prepared(model_dir, preparation, shardings(tp))
    mesh = tensor_parallel_mesh(tp)
    layout = KVLayout.for_model(config)
    heads = kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp)
    flat = allocate_layer_caches(config, layout, PAGES, PAGE, heads, jnp.float32, jnp.float32, "xla", mesh)
    caches = jax.tree.unflatten(layout.caches_def, flat)
    conv_pool, recurrent_pool = caches[config.state_layers[0]]
    placed = {"conv_pool": describe(conv_pool), "recurrent_pool": describe(recurrent_pool)}
    ps = prompts()
    first, caches = _step(model, caches, ps, [0, 0], mesh)
    second, _ = _step(model, caches, CONTINUATIONS, [len(p) for p in ps], mesh)
    state = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    for name, array in state.items():
        if ".layers.0." in name or ".layers.3.self_attn." in name:
            placed[name] = describe(array)
    return {"first": first.tolist(), "second": second.tolist(), "placed": placed}


def main(model_dir: str, sizes: str, out_path: str) -> None:
    report = {tp: run(model_dir, int(tp)) for tp in sizes.split(",")}
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
