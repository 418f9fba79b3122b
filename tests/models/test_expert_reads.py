# SPDX-License-Identifier: Apache-2.0
"""A host that holds only some experts (one of several under expert parallelism: the runner's
`load_prepared` asks the shardings which, `models.sharding.addressable_rows`) reads only those
experts' tensors: a tiny Qwen3-MoE streamed with `local_experts` naming experts 2-5 of 8 reads
every other tensor whole and, of the experts, only 2-5's weights and their scales (fp8 blocks'
`weight_scale_inv`, AWQ's `qzeros` and `scales`), counted from outside the loader
(`counted_reads`). Those experts' slots hold what the whole read gives, the others zeros. The
two-host proof (host 0 reads experts 0-3, host 1 4-7, transformers' tokens) is
`tests/tpu_platform/test_expert_parallel_hosts.py`."""

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
from tpu_platform.weights.prepared import Preparation, int8_quantization

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
    path: str, quantization: str, local: frozenset[int] | None
) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """The bytes read of each tensor, and the expert stacks, of `path` streamed as the runner
    prepares it (`quantization`), on one device."""
    preparation = Preparation("float32", quantization=quantization)
    place = lambda name, value, served: jax.device_put(preparation.served_value(value, served))  # noqa: E731
    held = None if local is None else (lambda name, served: local)
    with counting_reads() as read:
        _, model = stream_model(path, prepare=preparation.apply, place=place, local_experts=held)
    stacks = _expert_arrays(model)
    return read, stacks


def _expert_arrays(model) -> dict[str, np.ndarray]:
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model))
    return {
        ".".join(map(str, key)): np.asarray(var.get_value())
        for key, var in flat
        if ".experts." in "." + ".".join(map(str, key)) + "."
    }


# float as it is and quantized to int8 on the host as it is read; fp8 and AWQ as they ship. AWQ's
# expert modules hold three tensors each (values, zero points, scales); the other two take the
# same skip (`models.loader._reads`) and are `make test-full`'s.
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
