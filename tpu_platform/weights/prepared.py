# SPDX-License-Identifier: Apache-2.0
"""A model's prepared weights as an Orbax checkpoint, restored straight onto target shardings.

Loading a checkpoint parses it, casts every tensor to the model's dtype, fuses projections and
(on a CPU with the native dense kernel) packs kernels: the prepared state. An Orbax checkpoint of
it holds two items: `state`, its arrays nested by parameter path, and `metadata`, a small JSON
object (format, layout version, architecture, preparation, a digest of every array's path, shape
and dtype, an optional cache key, the library versions). The model's structure is never stored:
it is rebuilt from the model's `config.json` and the preparation (`abstract_prepared`), and the
checkpoint is restored into that abstract state with a `jax.sharding.Sharding` per array, so a
checkpoint written with one sharding restores onto another (more or fewer devices), and one
laid out for another tensor-parallel size has its fused projections re-blocked on the way.
`load_prepared` makes the prepared state from the source weights, streamed tensor by tensor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import ModelConfig
from models.sharding import addressable_box, addressable_rows, fused_layout, fused_parts
from models.weight_stream import HostBytes, stream_model
from tpu_platform.weights.preparation import Preparation, abstract_prepared

FORMAT = "vllm-xla prepared weights"
# The prepared layout's version: a change to how the state is derived (fusion order, packing)
# that keeps every shape must bump it, so that older checkpoints are refused.
LAYOUT_VERSION = 1

# An array's path in the prepared state (e.g. ("model", "layers", "0", "mlp", "down_proj",
# "kernel")) and its abstract value -> the sharding it is restored onto; or one sharding for all.
ShardingFor = jax.sharding.Sharding | Callable[[tuple[str, ...], jax.ShapeDtypeStruct], jax.sharding.Sharding]


class UnusableCheckpoint(Exception):
    """A prepared-weights checkpoint that cannot serve this model as prepared here (foreign,
    damaged, another layout or preparation); the message names what differs."""


def load_prepared(
    path: str, preparation: Preparation, shardings: ShardingFor, host_bytes: HostBytes | None = None
) -> tuple[ModelConfig, nnx.Module]:
    """The model at `path` (safetensors or GGUF) prepared so, each tensor streamed from the
    checkpoint straight onto its sharding (`models.weight_stream`): quantized and packed on the
    host on its way where the preparation does, and never the whole model on the host at once.
    One host of several reads only what its devices hold: an expert stack's own experts (under
    expert parallelism) and a split weight's own box (`models.weight_stream.stream_model`); the
    rest is zeros that no device receives."""

    def place(name: str, value: np.ndarray, served: nnx.Variable) -> jax.Array:
        value = preparation.served_value(value, served)
        sharding = _sharding(shardings, tuple(name.split(".")), value)
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        # Each host its own shards: `device_put` would first check, across the hosts, that they
        # hold the same whole value, which they do not (each read only its own experts).
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def local(held: Callable) -> Callable[[str, nnx.Variable], Any]:
        def of(name: str, served: nnx.Variable) -> Any:
            value = served.get_value()
            return held(_sharding(shardings, tuple(name.split(".")), value), value.shape)

        return of

    hosts = jax.process_count() > 1  # one host holds every weight whole: it reads them whole
    return stream_model(
        path, jnp.dtype(preparation.dtype), tp_size=preparation.tp_size, prepare=preparation.apply,
        place=place, host_bytes=host_bytes, local_experts=local(addressable_rows) if hosts else None,
        local_box=local(addressable_box) if hosts else None,
    )  # fmt: skip


def structure_digest(state: nnx.State) -> str:
    """A hash of every array's path, shape and dtype: what a checkpoint must match to restore."""
    rows = [(_path(path), tuple(leaf.shape), jnp.dtype(leaf.dtype).name) for path, leaf in _leaves(state)]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def metadata_for(
    model_config: ModelConfig,
    preparation: Preparation,
    state: nnx.State,
    float_layers: Sequence[str] = (),
    **extra: Any,
) -> dict:
    """The checkpoint's JSON metadata for `state` (abstract or concrete) prepared so;
    `float_layers`: its model's (`models.linear.float_layers`), which a restore marks again."""
    import orbax.checkpoint as ocp

    if float_layers:
        extra["float_layers"] = list(float_layers)

    return {
        "format": FORMAT,
        "layout": LAYOUT_VERSION,
        "architecture": model_config.architecture,
        "preparation": preparation.name,
        "structure": structure_digest(state),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "orbax": ocp.__version__},
        **extra,
    }


def save_prepared(directory: str, state: nnx.State, metadata: dict) -> None:
    """Writes `state`'s arrays (host or device, any sharding) and `metadata` as an Orbax
    checkpoint at `directory`, which must not exist; Orbax writes it under a temporary name and
    renames it when complete, so a reader never sees part of one."""
    import orbax.checkpoint as ocp

    _checkpointer().save(
        os.path.abspath(directory),
        ocp.args.Composite(state=ocp.args.PyTreeSave(_nested(state)), metadata=ocp.args.JsonSave(metadata)),
    )


def read_metadata(directory: str) -> dict:
    """The checkpoint's JSON metadata; UnusableCheckpoint when it is not one of ours."""
    import orbax.checkpoint as ocp

    if not os.path.isdir(os.path.join(directory, "metadata")):
        raise UnusableCheckpoint(f"{directory} is not a prepared-weights checkpoint (no metadata item)")
    try:
        restored = _checkpointer().restore(
            os.path.abspath(directory), ocp.args.Composite(metadata=ocp.args.JsonRestore())
        )
    except Exception as error:  # Orbax and TensorStore raise many kinds
        raise UnusableCheckpoint(f"{directory}: unreadable metadata ({error})") from error
    metadata = restored["metadata"]
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise UnusableCheckpoint(f"{directory} is not a prepared-weights checkpoint ({FORMAT!r})")
    return metadata


def restore_prepared(
    directory: str,
    model_config: ModelConfig,
    preparation: Preparation,
    shardings: ShardingFor,
    expected: dict | None = None,
    *,
    tp_size: int | None = None,
) -> nnx.Module:
    """The prepared model with its weights restored from `directory` onto `shardings` (each array
    read straight into its shards). UnusableCheckpoint when the checkpoint is not one of ours,
    holds another layout, architecture, preparation (`preparation`: what it must hold) or
    structure, differs from `expected`'s entries (e.g. a cache key), or is damaged.

    `tp_size`: the tensor-parallel size to serve at (default: the preparation's). The fused q/k/v
    and gate/up parameters of a checkpoint laid out for another are re-blocked (`_reblocked`);
    every other array is the same at any TP size and restores as it is.

    The arrays are read (by TensorStore's threads, in the shapes the checkpoint records) while
    this thread rebuilds the model's structure from its config (Python: holds the interpreter);
    the two must then agree on every array's path, shape and dtype."""
    metadata = read_metadata(directory)
    wanted = {
        "layout": LAYOUT_VERSION,
        "architecture": model_config.architecture,
        "preparation": preparation.name,
        **(expected or {}),
    }
    _refuse_differences(directory, metadata, wanted)
    served = dataclasses.replace(preparation, tp_size=tp_size or preparation.tp_size)
    reblock = served != preparation
    if reblock and preparation.packing != "none":
        raise UnusableCheckpoint(f"{directory}: packed kernels serve at tensor_parallel_size=1 only")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="restore") as pool:
        reading = pool.submit(_restore_arrays, directory, _reading(shardings) if reblock else shardings)
        kept = metadata.get("float_layers", ())
        graphdef, abstract = abstract_prepared(model_config, preparation, kept)
        if reblock:
            graphdef, served_state = abstract_prepared(model_config, served, kept)
        restored = reading.result()
    _refuse_differences(directory, metadata, {"structure": structure_digest(abstract)})
    try:
        state = _from_nested(abstract, restored)
    except KeyError as error:
        raise UnusableCheckpoint(f"{directory} lacks the array {error}") from error
    del restored
    if structure_digest(state) != metadata["structure"]:
        raise UnusableCheckpoint(f"{directory}: its arrays are not those its metadata describes")
    if reblock:
        arrays = {key: var.get_value() for key, var in nnx.to_flat_state(state)}
        del state
        state = _reblocked(arrays, served_state, shardings, model_config, preparation.tp_size, served.tp_size)
    return nnx.merge(graphdef, state)


def _reading(shardings: ShardingFor) -> ShardingFor:
    """`shardings`, except that a fused parameter read to be re-blocked is split over the target
    devices even where its stored shape would be replicated (no device holds it whole)."""

    def sharding(path: tuple[str, ...], leaf: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
        target = _sharding(shardings, path, leaf)
        if not fused_parts(".".join(path)) or not isinstance(target, NamedSharding):
            return target
        if not target.is_fully_replicated or target.mesh.size == 1:
            return target
        for axis in reversed(range(len(leaf.shape))):
            if leaf.shape[axis] % target.mesh.size == 0:
                spec = [None] * len(leaf.shape)
                spec[axis] = target.mesh.axis_names
                return NamedSharding(target.mesh, PartitionSpec(*spec))
        return target

    return sharding


def _reblocked(
    arrays: dict[tuple, jax.Array],
    served: nnx.State,
    shardings: ShardingFor,
    config: ModelConfig,
    from_tp: int,
    to_tp: int,
) -> nnx.State:
    """`served` (abstract, at `to_tp`) filled from the restored `arrays` (laid out for
    `from_tp`): each fused parameter, one at a time, gathered to the host, re-blocked with
    `models.sharding.fused_layout` (KV heads repeated or un-repeated too) and put on its
    sharding, its restored copy dropped before the next; every other array as it is."""
    heads = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    for key, var in nnx.to_flat_state(served):
        array = arrays.pop(key)
        name = ".".join(map(str, key))
        if fused_parts(name):
            value = fused_layout(name, np.asarray(array), **heads, from_tp=from_tp, to_tp=to_tp)
            del array
            array = jax.device_put(value, _sharding(shardings, tuple(name.split(".")), value))
        var.set_value(array)
    return served


def _refuse_differences(directory: str, metadata: dict, wanted: dict) -> None:
    differing = sorted(k for k, v in wanted.items() if metadata.get(k) != v)
    if differing:
        found = {k: metadata.get(k) for k in differing}
        expected_values = {k: wanted[k] for k in differing}
        raise UnusableCheckpoint(f"{directory} holds other weights: {found}, expected {expected_values}")


def _restore_arrays(directory: str, shardings: ShardingFor) -> dict:
    """The checkpoint's arrays, nested by path (`_nested`), each read onto its sharding."""
    import orbax.checkpoint as ocp

    checkpointer = _checkpointer()
    path = os.path.abspath(directory)
    try:
        recorded = checkpointer.metadata(path).item_metadata["state"].tree
        target = _with_shardings(
            jax.tree.map(lambda array: jax.ShapeDtypeStruct(array.shape, array.dtype), recorded), shardings
        )
        arrays = ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
        )
        return checkpointer.restore(path, ocp.args.Composite(state=arrays))["state"]
    except Exception as error:  # a missing or truncated file: Orbax and TensorStore raise many kinds
        raise UnusableCheckpoint(f"{directory}: unreadable arrays ({error})") from error


def _checkpointer():  # -> ocp.Checkpointer (Orbax is imported only where checkpoints are used)
    """Synchronous: a store or restore is done when it returns. Arrays uncompressed: weights
    compress little, and decoding zstd made restores markedly slower."""
    import orbax.checkpoint as ocp

    handler = ocp.CompositeCheckpointHandler(
        state=ocp.PyTreeCheckpointHandler(use_compression=False), metadata=ocp.JsonCheckpointHandler()
    )
    return ocp.Checkpointer(handler)


def _with_shardings(abstract: Any, shardings: ShardingFor) -> Any:
    def place(key_path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        sharding = _sharding(shardings, _path(_key_names(key_path)), leaf)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, abstract)


def _sharding(shardings: ShardingFor, path: tuple[str, ...], leaf: Any) -> jax.sharding.Sharding:
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    return shardings(path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))


def _leaves(state: nnx.State) -> list[tuple[tuple, Any]]:
    return [(_key_names(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _key_names(key_path: tuple) -> tuple:
    """The names along a JAX key path, without a Variable's own `value` field at its end."""
    if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and key_path[-1].name == "value":
        key_path = key_path[:-1]
    names = []
    for key in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(getattr(key, attr))
                break
    return tuple(names)


def _path(names: tuple) -> tuple[str, ...]:
    return tuple(str(name) for name in names)


def _nested(state: nnx.State) -> dict:
    """`state`'s arrays as nested dicts with string keys (what Orbax names its arrays by)."""
    tree: dict = {}
    for names, leaf in _leaves(state):
        node = tree
        for name in _path(names)[:-1]:
            node = node.setdefault(name, {})
        node[str(names[-1])] = leaf
    return tree


def _from_nested(abstract: nnx.State, nested: dict) -> nnx.State:
    """`abstract` with each array replaced by its counterpart in `nested` (see `_nested`)."""

    def find(key_path: tuple, _: Any) -> Any:
        node = nested
        for name in _path(_key_names(key_path)):
            node = node[name]
        return node

    return jax.tree_util.tree_map_with_path(find, abstract)
