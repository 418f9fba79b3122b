# SPDX-License-Identifier: Apache-2.0
"""A checkpoint's weights streamed straight onto their devices, one tensor at a time.

`load_model` fills the whole model on the host, then prepares and transfers it: the host holds
every weight at once (twice, during the transfer). Serving on devices, `stream_model` never does:
the served model's structure comes from `nnx.eval_shape` (build, `prepare_for_serving` and the
caller's own preparation on abstract values: no weights), and each checkpoint tensor is read,
transposed and cast, then put on its device or its `NamedSharding` (`models.sharding`) and
dropped. A fused q/k/v or gate/up parameter waits for its parts (a few tensors of one layer:
checkpoints list a layer's tensors together), an expert-stacked parameter for its experts; a
tied head's `[D, V]` copy is made from the embedding as it passes. So the host holds a few
tensors at a time beyond what its own (CPU) device keeps, and a device receives only its slice
of a split weight.

int8 weights (`models.quantization`) stream alike: where the served model has a kernel's scale,
a float kernel is quantized on the host as it is read (`models.int8.quantize`, per output column
or per group of inputs of each column, as the served scale's shape says: quantizing a part
before fusing gives the fused kernel's own values), and its
scale travels beside it as one more tensor: a fused projection's scales wait for their siblings
and are re-blocked exactly like the kernels' columns (`models.sharding.fuse_parts`), then placed
split like those columns. A pre-quantized checkpoint's int8 kernels and scales
(`models.compressed_tensors`, a GGUF's Q8_0 weights: `models.gguf_reader`) take the same way
without quantizing here; a scale whose layout is not the served one is refused by name. fp8
weights (`models.fp8`) alike: a float kernel the served model holds as fp8 is quantized to fp8,
one it holds as int4 (a 4-bit checkpoint's model, `models.int4`) to int4.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from models import fp8, int4
from models.checkpoint_kinds import gguf_q8_0_embedding_blocks
from models.config import ModelConfig
from models.expert_stacks import ExpertStacks
from models.int8 import group_size
from models.linear import Int4Bases, PackedKernel, is_packed_int4, quantizer_for, unpacked_shape
from models.loader import (
    give_input_orders,
    iter_parameters,
    keep_checkpoint_float_layers,
    prepare_for_serving,
)
from models.local_reads import Box
from models.mxfp4 import zero_padded
from models.registry import build
from models.sharding import MODEL_AXIS, fuse_parts, fused_parts, parameter_sharding
from pallas_kernels.cpu import float16_scales

# (dotted path of a served parameter, its host value, its abstract served Variable) -> the array
# on its device(s).
Place = Callable[[str, np.ndarray, nnx.Variable], jax.Array]
# (dotted path of a served expert-stacked `[E, ...]` parameter, its abstract served Variable) ->
# the experts this process's devices hold of it (`models.sharding.addressable_rows`), None for all.
LocalExperts = Callable[[str, nnx.Variable], Collection[int] | None]
# (dotted path of a served parameter, its abstract served Variable) -> the box of it this
# process's devices hold (`models.sharding.addressable_box`), None for all of it.
LocalBox = Callable[[str, nnx.Variable], Box | None]


@dataclasses.dataclass
class HostBytes:
    """The most host bytes a streamed load held at once: the tensor being placed (a fused one's
    parts and the fused result), the parts waiting for the rest of their fused parameter, and
    the partial expert stacks. Read by tests; one per load."""

    peak: int = 0
    tensors: int = 0  # how many tensors were placed

    def observe(self, held: int) -> None:
        self.peak = max(self.peak, held)
        self.tensors += 1


def served_abstract(
    model: nnx.Module,
    config: ModelConfig,
    tp_size: int,
    prepare: Callable[[nnx.Module], object] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """The served model's structure and its state's shapes and dtypes (`prepare_for_serving` at
    `tp_size`, then `prepare`), from a built model without touching its values."""

    def serve(model: nnx.Module) -> nnx.Module:
        prepare_for_serving(model, config, tp_size)
        if prepare is not None:
            prepare(model)
        return model

    return nnx.split(nnx.eval_shape(serve, model))


def default_place(mesh: Mesh | None) -> Place:
    """Each array on JAX's default device, or on `mesh` with the rules table's sharding."""
    if mesh is None:
        device = jax.devices()[0]
        return lambda path, value, served: jax.device_put(value, device)
    return lambda path, value, served: jax.device_put(value, parameter_sharding(path, value.shape, mesh))


def stream_model(
    path: str,
    dtype: jnp.dtype = jnp.float32,
    *,
    mesh: Mesh | None = None,
    tp_size: int | None = None,
    prepare: Callable[[nnx.Module], object] | None = None,
    place: Place | None = None,
    host_bytes: HostBytes | None = None,
    local_experts: LocalExperts | None = None,
    local_box: LocalBox | None = None,
) -> tuple[ModelConfig, nnx.Module]:
    """The model at `path` prepared for serving at `tp_size` (default: `mesh`'s size, else 1),
    each weight streamed to its device(s) by `place` (default: `default_place(mesh)`).

    `prepare`: a further preparation of the served model (e.g. packing kernels), applied here to
    its abstract structure only; `place` then receives each parameter as `load_model` leaves it
    and returns it as that preparation has it (its abstract Variable says which: a
    `PackedKernel`, say). `host_bytes` records the most host bytes held at once.
    `local_experts` (a host of several under expert parallelism): the experts whose tensors are
    read, the others' left unread on disk and their slots zeros in what `place` receives (it
    must then send each device only experts it names). `local_box` alike: the part of a split
    weight this host's devices hold, read alone (a slice read) where the checkpoint's tensor is
    the served parameter as it is (not fused, quantized, packed, padded or repeated here)."""
    config = ModelConfig.from_pretrained(path)
    if tp_size is None:
        tp_size = 1 if mesh is None else mesh.shape[MODEL_AXIS]
    model = build(config, dtype)  # host zeros, never written: their pages are never touched
    give_input_orders(model, path)  # a GPTQ act-order checkpoint's: part of the served structure
    keep_checkpoint_float_layers(model, path)  # and the float layers of a quantized one
    graphdef, abstract = served_abstract(model, config, tp_size, prepare)
    served = {".".join(map(str, key)): var for key, var in nnx.to_flat_state(abstract)}
    stacks = ExpertStacks(None if local_experts is None else _by_loaded_name(local_experts, served))
    placed = _stream(
        model, config, path, served, tp_size, place or default_place(mesh), host_bytes or HostBytes(), stacks,
        local_box,
    )  # fmt: skip
    for name, var in served.items():
        var.set_value(placed[name])
    return config, nnx.merge(graphdef, abstract)


def _stream(
    model: nnx.Module,
    config: ModelConfig,
    path: str,
    served: dict[str, nnx.Variable],
    tp_size: int,
    place: Place,
    host_bytes: HostBytes,
    stacks: ExpertStacks,
    local_box: LocalBox | None = None,
) -> dict[str, jax.Array]:
    """Every served parameter placed, from the checkpoint's tensors in their order."""
    part_of = {part: (name, i) for name in served for i, part in enumerate(fused_parts(name))}
    # A tied head's `[D, V]` copy (`Embedding.transpose_for_head`), made from the embedding.
    head_copies = {
        name.removesuffix("head_kernel") + "embedding": name
        for name in served
        if name.endswith(".head_kernel")
    }
    _check_sources(model, served, part_of, head_copies)
    quantized = _quantized_kernels(served, part_of)
    padded = _padded_parameters(model, served)
    heads = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    pending: dict[str, list[np.ndarray | None]] = {}
    placed: dict[str, jax.Array] = {}

    # the scales of kernels served with float16 scales and bases, until their offsets come
    halved = {n.removesuffix("_offset") + "_scale" for n, var in served.items() if isinstance(var, Int4Bases)}
    scales: dict[str, np.ndarray] = {}

    def waiting_bytes() -> int:
        parts = sum(p.nbytes for ps in pending.values() for p in ps if p is not None)
        return parts + stacks.held_bytes() + sum(s.nbytes for s in scales.values())

    offsets = {name for name in served if name.endswith(".kernel_offset")}
    offsets |= {part for name in offsets for part in fused_parts(name)}
    made_here = set(part_of) | set(quantized) | set(padded) | set(head_copies) | halved | offsets
    parts = None if local_box is None else _as_stored(local_box, model, served, made_here)
    int8, int4_blocks = bool(quantized), bool(offsets)
    blocks = _float16_head_blocks(path, head_copies, served)
    loaded = iter_parameters(
        model, path, stacks, int8=int8, int4_blocks=int4_blocks, parts=parts, q8_0_embedding=blocks
    )
    for ours, value in _with_scales(loaded, quantized, offsets):
        if ours in part_of:
            name, index = part_of[ours]
            parts = pending.setdefault(name, [None] * len(fused_parts(name)))
            parts[index] = value
            if any(p is None for p in parts):
                host_bytes.observe(waiting_bytes())
                continue
            value = fuse_parts(name, pending.pop(name), **heads, tp_size=tp_size)
            host_bytes.observe(waiting_bytes() + sum(p.nbytes for p in parts) + value.nbytes)
            ours = name
        else:
            host_bytes.observe(waiting_bytes() + value.nbytes)
        if ours.endswith(("_scale", "_offset")) and tuple(value.shape) != tuple(
            served[ours].get_value().shape
        ):
            raise ValueError(
                f"the checkpoint's weight scale or offset {ours} has shape {tuple(value.shape)}, the served "
                f"model {tuple(served[ours].get_value().shape)}: its layout (per channel or "
                "grouped, and the group size) is not the one this model was prepared for"
            )
        if ours in padded:  # mxfp4 experts padded to whole blocks a device (`models.gpt_oss`)
            value = zero_padded(value, padded[ours])
        if ours in halved:  # float16 scales need their offsets: each base is m - 8 s
            scales[ours] = value
            continue
        if isinstance(served[ours], Int4Bases):
            scale_name = ours.removesuffix("_offset") + "_scale"
            scale, value = float16_scales(scales.pop(scale_name), value)
            placed[scale_name] = place(scale_name, scale, served[scale_name])
        placed[ours] = place(ours, value, served[ours])
        if ours in head_copies:
            for name, copy in _with_scales(
                _tied_head(head_copies[ours], value, served, blocks), quantized, offsets
            ):
                placed[name] = place(name, copy, served[name])
    return placed


def _by_loaded_name(
    local_experts: LocalExperts, served: dict[str, nnx.Variable]
) -> Callable[[str], Collection[int] | None]:
    """`local_experts` by a loaded stack's path: a fused stack's parts (`fused_parts`) are split
    by expert like the stack they make; a path served under no name of its own reads every expert."""
    part_of = {part: name for name in served for part in fused_parts(name)}

    def local(ours: str) -> Collection[int] | None:
        name = part_of.get(ours, ours)
        return local_experts(name, served[name]) if name in served else None

    return local


def _as_stored(
    local_box: LocalBox, model: nnx.Module, served: dict[str, nnx.Variable], made_here: set[str]
) -> Callable[[str], Box | None]:
    """`local_box` by a loaded parameter's path, for those served as they are loaded (same
    shape, no packing, none `made_here`: fused, quantized, padded or copied); None (read whole)
    for the others. A checkpoint's stacked `[E, ...]` experts are such parameters (their box, by
    expert under expert parallelism); per-expert tensors are skipped whole instead
    (`local_experts`)."""
    loaded = {".".join(map(str, key)): var for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def part(ours: str) -> Box | None:
        var = served.get(ours)
        if var is None or ours in made_here or isinstance(var, PackedKernel):
            return None
        if tuple(var.get_value().shape) != tuple(loaded[ours].get_value().shape):
            return None  # KV heads repeated for the mesh
        return local_box(ours, var)

    return part


def _padded_parameters(model: nnx.Module, served: dict[str, nnx.Variable]) -> dict[str, tuple[int, ...]]:
    """The served shapes of the parameters `prepare_for_serving` pads with zeros (GPT-OSS's mxfp4
    experts on a mesh their blocks do not split on: `models.gpt_oss`)."""
    loaded = {".".join(map(str, key)): var for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return {
        name: tuple(served[name].get_value().shape)
        for name, var in loaded.items()
        if _MXFP4_EXPERTS.search(name)
        and name in served
        and tuple(var.get_value().shape) != tuple(served[name].get_value().shape)
    }


_MXFP4_EXPERTS = re.compile(r"\.experts\.(gate_up_proj_(blocks|scales|bias)|down_proj_(blocks|scales))$")


def _scale_name(kernel: str) -> str:
    """The dotted path of an int8 kernel's scale: `kernel_scale` beside `kernel`, `head_scale`
    beside a tied head's `head_kernel`."""
    return (
        kernel.removesuffix("head_kernel") + "head_scale"
        if kernel.endswith(".head_kernel")
        else kernel + "_scale"
    )


def _quantized_kernels(
    served: dict[str, nnx.Variable], part_of: dict[str, tuple[str, int]]
) -> dict[str, tuple[int | None, np.dtype]]:
    """The loaded kernels the served model holds as int8 or fp8 with a scale (a fused kernel's
    parts under their own names), each with its inputs per scale (`models.int8.group_size`: None
    per channel) and its values' dtype."""
    found = {}
    for name in served:
        if name.endswith(("kernel", "head_kernel")) and _scale_name(name) in served:
            kernel = served[name].get_value()
            shapes = (kernel.shape, served[_scale_name(name)].get_value().shape)
            packed = isinstance(served[name], PackedKernel)
            four_bit = packed and is_packed_int4(kernel)  # 4-bit values, quantized as such
            dtype = int4.INT4_DTYPE if four_bit else np.dtype(kernel.dtype)
            if packed:  # the group size of the `[K, N]` kernel it packs
                shapes = (unpacked_shape(kernel), shapes[1])
            found[name] = (group_size(*shapes), dtype)
    return found | {part: found[name] for part, (name, _) in part_of.items() if name in found}


def _float16_head_blocks(
    path: str, head_copies: dict[str, str], served: dict[str, nnx.Variable]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The GGUF's Q8_0 embedding blocks where a tied head's scales are served in float16
    (`Preparation.float16_head_scales`), read once: the head's copy is them as they are (the
    embedding's values rounded to the model's dtype would not give back each block's float16 d)
    and the embedding is made from them. None for any other head."""
    if not any(_float16_scales(head, served) for head in head_copies.values()):
        return None
    blocks = gguf_q8_0_embedding_blocks(path)
    if blocks is None:
        raise ValueError(f"{path}: a tied head with float16 scales needs a GGUF whose embedding is Q8_0")
    return blocks


def _float16_scales(head: str, served: dict[str, nnx.Variable]) -> bool:
    scale = _scale_name(head)
    return scale in served and served[scale].get_value().dtype == np.float16


def _tied_head(
    head: str,
    embedding: np.ndarray,
    served: dict[str, nnx.Variable],
    blocks: tuple[np.ndarray, np.ndarray] | None,
) -> list[tuple[str, np.ndarray]]:
    """A tied head's `[D, V]` copy from the loaded embedding, to be quantized as served; or, where
    its scales are served in float16, the file's own Q8_0 `blocks` (`_float16_head_blocks`)."""
    if _float16_scales(head, served):
        return [(head, blocks[0].T), (_scale_name(head), blocks[1].T)]
    return [(head, embedding.T)]


def _with_scales(
    params: Iterable[tuple[str, np.ndarray]],
    quantized: dict[str, int | None],
    offsets: set[str] = frozenset(),
) -> Iterator[tuple[str, np.ndarray]]:
    """`params` (`(dotted path, host value)`) with each float kernel that the served model holds
    as int8 or fp8 quantized on the host (in its groups where grouped), followed by its scale as
    a parameter of its own (and zero offsets where the served model has `offsets` for it: an
    affine int4 layout, `models.int4`); a kernel that is quantized already (a pre-quantized
    checkpoint's, whose scale comes from the checkpoint) and every other parameter pass as they are."""
    for ours, value in params:
        if ours in quantized and _unquantized(value.dtype):
            size, dtype = quantized[ours]
            q, scale = quantizer_for(dtype)(value, size)
            yield ours, q
            yield _scale_name(ours), scale
            if ours + "_offset" in offsets:
                yield ours + "_offset", np.zeros_like(scale)
        else:
            yield ours, value


def _unquantized(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and not fp8.is_fp8(dtype)  # int4 is not floating


def _check_sources(
    model: nnx.Module,
    served: dict[str, nnx.Variable],
    part_of: dict[str, tuple[str, int]],
    head_copies: dict[str, str],
) -> None:
    """A served parameter that no loaded parameter fills is a bug in a model's definition: named
    before any tensor is read."""
    loaded = {".".join(map(str, key)) for key, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    filled = {part_of[p][0] if p in part_of else p for p in loaded} | {
        head_copies[p] for p in loaded & set(head_copies)
    }
    filled |= {_scale_name(name) for name in filled if name.endswith("kernel")}  # int8: made or read
    filled |= {name + "_offset" for name in filled if name.endswith(".kernel")}  # affine int4: alike
    orphans = sorted(set(served) - filled)
    if orphans:
        raise ValueError(f"{type(model).__name__}: no checkpoint parameter fills {orphans[:5]}")
