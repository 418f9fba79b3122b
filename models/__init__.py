# SPDX-License-Identifier: Apache-2.0
"""Flax NNX model definitions for XLA devices (pure JAX, no vLLM).

Shape legend used throughout: T tokens in the step, D hidden size, F MLP size, V vocab,
N query heads, K kv heads, H head dim, R sequences, P pages per sequence, E experts.

One file per architecture (llama, qwen2, qwen3, gemma2, gemma3, mixtral, qwen3_moe) assembles
the shared blocks of `layers.py` (attention, MLPs, decoder blocks, trunk, LM head) and `moe.py`
(routing and the routed expert matmul), and holds its HF-name table `hf_param_map`.

Entry points: `ModelConfig.from_pretrained(path)`, `build(config, dtype, rngs)`,
`load_weights(model, path)` (a built model's parameters are host zeros until then; loading
transposes and casts on the host and puts the weights on the device in one transfer, or leaves
them on the host with `on_host=True`); a model is called as
`model(input_ids[T], positions[T], kv_caches, metadata) -> (hidden[T, D], kv_caches)` and
`model.compute_logits(hidden) -> logits[.., V]`, `kv_caches` being a list of one cache array a
layer or of arrays holding several (`AttentionMetadata.cache_pages`). On a CPU with AMX,
AVX-512 BF16 or AVX2, `pack_for_native_dense(model)` moves the bfloat16 dense layers onto
`pallas_kernels.cpu.native_dense` (int8 ones onto `native_dense_int8`), and
`attach_rope_tables(model, max_positions)` has the attention layers gather their RoPE rotations
from tables instead of computing them.

Out-of-tree architectures: `register_architecture(name, ModelClass, config_class=...)` serves a
checkpoint whose `config.json` names `name` with a plugin's Flax model (contract: docs/models.md);
`supported_architectures()` lists the built-in and registered ones.

Tensor parallelism: `load_model(path, dtype, tp_size=N)` prepares the weights for N devices
(fused projections in one block a device, KV heads repeated when fewer than N) and
`models.sharding` places them on the mesh from its rules table (`parameter_spec`,
`state_shardings`, `place_state`); a model called with `AttentionMetadata.mesh` runs attention
per device under `jax.shard_map`. `stream_model(path, dtype, mesh=mesh)` loads a model for
serving without the host ever holding it: each tensor goes from the checkpoint straight to its
device or sharding (`models.weight_stream`).
"""

from models.config import ModelConfig
from models.linear import PackedKernel
from models.loader import load_model, load_weights, prepare_for_serving
from models.metadata import AttentionMetadata
from models.registry import SUPPORTED_ARCHITECTURES, build, register_architecture, supported_architectures
from models.serving_passes import attach_rope_tables, pack_for_native_dense
from models.weight_stream import stream_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "ModelConfig",
    "PackedKernel",
    "attach_rope_tables",
    "build",
    "load_model",
    "load_weights",
    "pack_for_native_dense",
    "prepare_for_serving",
    "register_architecture",
    "stream_model",
    "supported_architectures",
]
