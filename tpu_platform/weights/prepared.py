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
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import ModelConfig, PackedKernel, build, pack_for_native_dense
from models.checkpoint_kinds import checkpoint_values, int8_group_size
from models.linear import is_packed_int4, keep_float_layers, packed_for_native_dense
from models.quantization import (
    FP8_METHODS,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_tied_head_int8,
)
from models.sharding import addressable_box, addressable_rows, fused_layout, fused_parts
from models.weight_stream import HostBytes, served_abstract, stream_model

FORMAT = "vllm-xla prepared weights"
# The prepared layout's version: a change to how the state is derived (fusion order, packing)
# that keeps every shape must bump it, so that older checkpoints are refused.
LAYOUT_VERSION = 1

# An array's path in the prepared state (e.g. ("model", "layers", "0", "mlp", "down_proj",
# "kernel")) and its abstract value -> the sharding it is restored onto; or one sharding for all.
ShardingFor = jax.sharding.Sharding | Callable[[tuple[str, ...], jax.ShapeDtypeStruct], jax.sharding.Sharding]

_PACKINGS = ("none", "native", "native+f32")
_QUANTIZATIONS = ("none", "int8", "fp8", "int4", "int4z")  # and "int8-g<G>" ...: one scale per G inputs
_GROUPED = re.compile(r"(int8|fp8|int4|int4z)-g([1-9][0-9]*)")


class UnusableCheckpoint(Exception):
    """A prepared-weights checkpoint that cannot serve this model as prepared here (foreign,
    damaged, another layout or preparation); the message names what differs."""


@dataclasses.dataclass(frozen=True)
class Preparation:
    """How the loaded weights were prepared, beyond the model itself.

    `packing`: "none" (XLA's dots), "native" (bfloat16 kernels packed for the native CPU dense
    kernel) or "native+f32" (float32 kernels too: CPUs whose best path is AVX2). `tp_size`: the
    tensor-parallel size the weights were laid out for (fused projections one block a device, KV
    heads repeated up to it: `models.sharding`). `quantization`: "none", "int8" (every float
    dense kernel int8 with a scale per output channel: `models.quantization`) or "int8-g<G>"
    (the dense projections' and the head's scales per group of G inputs of each column, as a
    GGUF's Q8_0 weights (G = 32) or a compressed-tensors `group` checkpoint hold them:
    `int8_quantization`). The two int8 layouts are distinct preparations (names, cache entries).
    "fp8" and "fp8-g<G>" alike with float8_e4m3fn values (`models.fp8`; the head stays in the
    model's dtype: `models.quantization.quantize_fp8`). "int4" and "int4-g<G>" alike with int4
    values (`models.int4`: a 4-bit checkpoint's, `models.quantization.quantize_int4`), held as
    int4 on TPU and GPU and as int8 on CPU: `backend` names the platform (None: JAX's default
    backend; the planner's compile-only targets name theirs). "int4z" and "int4z-g<G>": int4 with
    an offset per scale (`kernel_offset`, `models.int4`: a checkpoint with zero points or group
    minimums, AWQ, asymmetric GPTQ, GGUF Q4). Packed for the native CPU kernels, a 4-bit
    preparation holds a tied head's copy in int8 (`quantize_tied_head_int8`), in the same groups.
    `float16_scales`: packed so, the int4z kernels hold float16 scales and bases instead of
    float32 scales and offsets (`models.linear.halve_int4_scales`: a GGUF whose projections are
    all Q4_0 or Q4_1, `models.checkpoint_kinds.gguf_float16_scales`, whose blocks hold exactly
    those).
    `float16_head_scales`: packed so, a tied head's grouped int8 copy holds float16 scales (a GGUF
    whose embedding is Q8_0, `models.checkpoint_kinds.gguf_q8_0_embedding`: each block's own d).
    """

    dtype: str
    packing: str = "none"
    tp_size: int = 1
    quantization: str = "none"
    backend: str | None = None  # the platform int4 values are held for (`int4.held_dtype`)
    float16_scales: bool = False
    float16_head_scales: bool = False

    def __post_init__(self) -> None:
        if self.float16_head_scales and (self.packing == "none" or self.fp8 or self.int8_group_size is None):
            raise ValueError(
                f"float16 head scales are for a grouped int8 head packed for the native CPU int8 kernel, "
                f"not {self.quantization!r} weights packed {self.packing!r}"
            )
        if self.float16_scales and not (self.quantization.startswith("int4z") and self.packing != "none"):
            raise ValueError(
                f"float16 scales are for int4z kernels packed for the native CPU int4 kernel, not "
                f"{self.quantization!r} weights packed {self.packing!r}"
            )
        if self.packing not in _PACKINGS:
            raise ValueError(f"packing {self.packing!r} is not one of {_PACKINGS}")
        if self.quantization not in _QUANTIZATIONS and not _GROUPED.fullmatch(self.quantization):
            raise ValueError(
                f"quantization {self.quantization!r} is not one of {_QUANTIZATIONS}, int8-g<group "
                "size>, fp8-g<group size>, int4-g<group size> or int4z-g<group size>"
            )

    @property
    def int8(self) -> bool:
        """Whether the dense kernels are quantized (int8 or fp8 values with scales)."""
        return self.quantization != "none"

    @property
    def fp8(self) -> bool:
        return self.quantization.startswith("fp8")

    @property
    def int4(self) -> bool:
        return self.quantization.startswith("int4")

    @property
    def int8_group_size(self) -> int | None:
        """The inputs sharing a weight scale: None per channel (or not quantized)."""
        grouped = _GROUPED.fullmatch(self.quantization)
        return int(grouped.group(2)) if grouped else None

    @classmethod
    def for_dense_isa(
        cls,
        dtype: str,
        dense_isa: str | None,
        tp_size: int = 1,
        quantization: str = "none",
        *,
        float16_scales: bool = False,
        float16_head_scales: bool = False,
    ) -> Preparation:
        """The preparation of a runner whose native dense kernel runs `dense_isa` (None: XLA's
        dots), on `tp_size` devices; `float16_scales` and `float16_head_scales` where the
        weights allow them and the kernels are packed (else ignored)."""
        packing = "none" if dense_isa is None else "native+f32" if dense_isa == "avx2" else "native"
        halves = float16_scales and packing != "none" and quantization.startswith("int4z")
        grouped = _GROUPED.fullmatch(quantization) is not None and not quantization.startswith("fp8")
        heads = float16_head_scales and packing != "none" and grouped
        return cls(
            jnp.dtype(dtype).name,
            packing,
            tp_size,
            quantization,
            float16_scales=halves,
            float16_head_scales=heads,
        )

    @property
    def name(self) -> str:
        halves = ("-f16scales" if self.float16_scales else "") + (
            "-f16head" if self.float16_head_scales else ""
        )
        int8 = f"-{self.quantization}{halves}" if self.int8 else ""
        return f"{self.dtype}-{self.packing}{int8}" + (f"-tp{self.tp_size}" if self.tp_size > 1 else "")

    def apply(self, model: nnx.Module) -> int:
        """Quantizes and packs `model`'s kernels as this preparation does (after
        `prepare_for_serving`); returns how many kernels were packed."""
        if self.int8:  # before packing: the int8 kernels pack for the native int8 kernel
            if self.int4:
                affine = self.quantization.startswith("int4z")
                quantize_int4(model, self.int8_group_size, self.backend, affine=affine)
                if self.packing != "none":  # a tied head on the native int8 kernel, not bfloat16
                    quantize_tied_head_int8(model, self.int8_group_size)
            else:
                (quantize_fp8 if self.fp8 else quantize_int8)(model, self.int8_group_size)
        if self.packing == "none":
            return 0
        return pack_for_native_dense(
            model,
            float32=self.packing == "native+f32",
            int4=self.int4,
            float16_scales=self.float16_scales,
            float16_head_scales=self.float16_head_scales,
        )

    def served_value(self, value: np.ndarray, served: nnx.Variable) -> np.ndarray:
        """One parameter as `prepare_for_serving` leaves it, as this preparation has it: packed
        when its abstract served Variable is a `PackedKernel` (`stream_model`'s `place`)."""
        if not isinstance(served, PackedKernel):
            return value
        four_bit = is_packed_int4(served.get_value())  # the abstract served value: how it was packed
        return packed_for_native_dense(value, float32=self.packing == "native+f32", int4=four_bit)


def int8_quantization(path: str, method: str | None = None) -> str:
    """The `Preparation.quantization` serving the model at `path` with vLLM's `quantization`
    `method`: the values its checkpoint holds quantized (`models.checkpoint_kinds.checkpoint_values`),
    else fp8 for an fp8 method (`models.quantization.FP8_METHODS`) and int8 for the others; in its
    own quantized weights' layout where it holds them as they are
    (`models.checkpoint_kinds.int8_group_size`: a GGUF's Q8_0 blocks, a compressed-tensors `group`
    checkpoint, a block-fp8 checkpoint), else per channel."""
    values = checkpoint_values(path) or ("fp8" if method in FP8_METHODS else "int8")
    size = int8_group_size(path)
    return values if size is None else f"{values}-g{size}"


def abstract_prepared(
    config: ModelConfig, preparation: Preparation, float_layers: Sequence[str] = ()
) -> tuple[nnx.GraphDef, nnx.State]:
    """The prepared model's structure and its state's shapes and dtypes, without any weights:
    the model is built (host zeros, never written: no memory) and prepared under `nnx.eval_shape`.
    `float_layers`: the layers its checkpoint kept in float (`models.linear.float_layers`), which
    the preparation leaves so."""
    model = build(config, jnp.dtype(preparation.dtype))
    keep_float_layers(model, float_layers)
    return served_abstract(model, config, preparation.tp_size, preparation.apply)


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
