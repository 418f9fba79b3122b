# SPDX-License-Identifier: Apache-2.0
"""A host that holds only some experts (one of several under expert parallelism: the runner's
`load_prepared` asks the shardings which, `models.sharding.addressable_rows`) reads only those
experts' tensors: a tiny Qwen3-MoE streamed with `local_experts` naming experts 2-5 of 8 reads
every other tensor whole and, of the experts, only 2-5's weights and their scales (fp8's
`weight_scale`, AWQ's `qzeros` and `scales`), counted from outside the loader
(`counted_reads`). Those experts' slots hold what the whole read gives, the others zeros. The
two-host proof (host 0 reads experts 0-3, host 1 4-7, transformers' tokens) is
`tests/tpu_platform/test_expert_parallel_hosts.py`. A weight split across hosts alike: with
`local_box` naming half of each matrix, a tensor that is its parameter as it is (o_proj,
down_proj, the embedding, the head, the routers) is read in half (a slice read), the fused ones
and the per-expert ones whole, and that half holds what the whole read gives; GPT-OSS's stacked
`[E, ...]` experts (mxfp4 blocks and scales, or float) are read in their local experts' rows."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from models.sharding import addressable_rows
from models.weight_stream import stream_model
from tests.models.awq_checkpoints import write_awq
from tests.models.counted_reads import counting_reads, tensor_bytes
from tests.models.fp8_checkpoints import write_compressed_fp8
from tests.models.tiny_checkpoints import save_tiny
from tpu_platform.weights.preparation import Preparation, int8_quantization

LOCAL = frozenset({2, 3, 4, 5})
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _expert(name: str) -> int | None:
    match = _EXPERT.search(name)
    return None if match is None else int(match.group(1))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return save_tiny("Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("expert_reads") / "float"), seed=2)


def _checkpoint(kind: str, source: str, tmp_path) -> str:
    if kind == "fp8":
        return write_compressed_fp8(source, str(tmp_path / "fp8"), "FP8_DYNAMIC")
    if kind == "awq":
        return write_awq(source, str(tmp_path / "awq"), group_size=16)[0]
    return source


def _streamed(
    path: str, quantization: str, local: frozenset[int] | None, local_box=None
) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """The bytes read of each tensor, and every array, of `path` streamed as the runner prepares
    it (`quantization`), on one device."""
    preparation = Preparation("float32", quantization=quantization)
    place = lambda name, value, served: jax.device_put(preparation.served_value(value, served))  # noqa: E731
    held = None if local is None else (lambda name, served: local)
    with counting_reads() as read:
        _, model = stream_model(
            path, prepare=preparation.apply, place=place, local_experts=held, local_box=local_box
        )
    return read, _arrays(model)


def _arrays(model, experts: bool = True) -> dict[str, np.ndarray]:
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model))
    names = {".".join(map(str, key)): var for key, var in flat}
    return {
        name: np.asarray(var.get_value()) for name, var in names.items() if (".experts." in name) == experts
    }


# float as it is and quantized to int8 on the host as it is read; fp8 and AWQ as they ship. AWQ's
# expert modules hold three tensors each (values, zero points, scales); the other two take the
# same skip (`models.local_reads.expert_reads`) and are `make test-full`'s.
_KINDS = [
    "float",
    pytest.param("int8_at_load", marks=pytest.mark.full),
    pytest.param("fp8", marks=pytest.mark.full),
    "awq",
]


@pytest.mark.parametrize("kind", _KINDS)
def test_a_host_reads_only_the_experts_its_devices_hold(kind, source, tmp_path):
    path = _checkpoint(kind, source, tmp_path)
    quantization = {"float": "none", "int8_at_load": "int8"}.get(kind) or int8_quantization(path)
    sizes = tensor_bytes(path)
    whole_read, whole = _streamed(path, quantization, None)
    part_read, part = _streamed(path, quantization, LOCAL)
    assert whole_read == sizes  # every tensor read once, whole
    assert {_expert(name) for name in sizes} == {None, *range(8)}
    assert part_read == {name: size for name, size in sizes.items() if _expert(name) in (None, *LOCAL)}
    assert whole.keys() == part.keys() and len(whole) >= 6  # gate, up, down (and scales) of 2 layers
    others = sorted(set(range(8)) - LOCAL)
    for name, stack in whole.items():
        np.testing.assert_array_equal(part[name][sorted(LOCAL)], stack[sorted(LOCAL)], err_msg=name)
        if not name.endswith(("_scale", "_offset")):  # (int8 at load gives zeros a scale of 1)
            assert not part[name][others].any(), name  # never read: zeros, never sent to a device


def test_addressable_rows_on_one_host_are_all_of_them():
    """One process holds every device: every expert is local, so nothing is left unread."""
    mesh = jax.make_mesh((len(jax.devices()),), ("model",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    assert addressable_rows(sharding, (8, 4, 4)) is None
    assert addressable_rows(jax.sharding.SingleDeviceSharding(jax.devices()[0]), (8, 4)) is None


def _first_half_of_columns(name: str, served) -> tuple[slice, ...] | None:
    shape = served.get_value().shape
    return (slice(None), slice(0, shape[1] // 2)) if len(shape) == 2 else None


def test_a_host_reads_only_its_box_of_a_split_weight(source):
    sizes = tensor_bytes(source)
    read, _ = _streamed(source, "none", None, local_box=_first_half_of_columns)
    halved = {name for name, size in read.items() if size != sizes[name]}
    assert read.keys() == sizes.keys() and all(2 * read[name] == sizes[name] for name in halved)
    layers = range(3)  # 0 and 2 MoE, 1 dense
    assert halved == {
        "model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight",
        *(f"model.layers.{i}.self_attn.o_proj.weight" for i in layers),
        "model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight",  # the routers
    }  # fmt: skip
    # the box holds the whole read's values (the rest zeros, which no device receives here)
    _, whole = stream_model(source)
    _, part = stream_model(source, local_box=_first_half_of_columns)
    want, got = _arrays(whole, experts=False), _arrays(part, experts=False)
    for name in want:
        half = (slice(None), slice(0, want[name].shape[1] // 2)) if want[name].ndim == 2 else ...
        np.testing.assert_array_equal(got[name][half], want[name][half], err_msg=name)


def _experts_two_to_five(name: str, served) -> tuple[slice, ...] | None:
    return (slice(2, 6),) if ".experts." in name else None


@pytest.mark.parametrize("kind", ["mxfp4", pytest.param("dequantized", marks=pytest.mark.full)])
def test_a_host_reads_only_its_experts_of_stacked_expert_tensors(kind, tmp_path):
    """GPT-OSS keeps its experts stacked (`[E, ...]` tensors: mxfp4 blocks and their scales, or
    float): a host holding experts 2-5 reads those rows of each (slice reads), blocks and scales
    alike, and they hold what the whole read gives."""
    from tests.models.mxfp4_checkpoint import save_tiny_gpt_oss_mxfp4

    paths = dict(zip(("mxfp4", "dequantized"), save_tiny_gpt_oss_mxfp4(str(tmp_path), seed=3), strict=True))
    path = paths[kind]
    sizes = tensor_bytes(path)
    read, part = _streamed(path, "none", None, local_box=_experts_two_to_five)
    _, whole = _streamed(path, "none", None)
    stacked = {name for name in sizes if ".experts." in name}
    assert stacked and read == {n: s // 2 if n in stacked else s for n, s in sizes.items()}
    assert part.keys() == whole.keys()
    for name, stack in whole.items():
        np.testing.assert_array_equal(part[name][2:6], stack[2:6], err_msg=name)
        assert not part[name][:2].any() and not part[name][6:].any(), name
