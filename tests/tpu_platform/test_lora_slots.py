# SPDX-License-Identifier: Apache-2.0
"""The runner's adapter cache and device slots (`tpu_platform.lora_slots`): vLLM's LRU worker
manager semantics (max_cpu_loras cached, pinned ones kept, max_loras slots taken least recently
used first) and slot arrays on the device that hold exactly the active adapters' values."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model
from models.lora import attach_lora
from tests.tiny_models import save_tiny_llama
from tpu_platform.lora_slots import LoraConfig, LoraSlots, LoraUnavailable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("lora_slots") / "llama"))


def _slots(model_dir, agree=None, **config):
    _, model = load_model(model_dir)
    config = LoraConfig(**config)
    sites = attach_lora(model, max_loras=config.max_loras, max_rank=config.max_lora_rank, dtype=jnp.float32)
    state = jax.device_put(nnx.state(model), jax.devices()[0])
    leaves = jax.tree.leaves(state)
    slots = (
        LoraSlots(config, sites, state, leaves)
        if agree is None
        else LoraSlots(config, sites, state, leaves, agree)
    )
    return slots, leaves


def _adapter(root, slots, seed):
    """A PEFT adapter of rank 2 on q_proj and down_proj of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for site in slots.sites.values():
        for part, width in zip(site.parts, site.widths, strict=True):
            if part.endswith(("q_proj", "down_proj")):
                tensors[f"base_model.model.{part}.lora_A.weight"] = rng.normal(size=(2, site.in_features))
                tensors[f"base_model.model.{part}.lora_B.weight"] = rng.normal(size=(width, 2))
    path = os.path.join(root, f"adapter{seed}")
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.astype(np.float32) for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors")
    )
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"]}, f
        )
    return f"adapter{seed}", path


def _device_slot(slots, leaves, slot):
    """Site -> (a, b) values of `slot` on the device."""
    return {
        key: (np.asarray(leaves[ia])[slot], np.asarray(leaves[ib])[slot])
        for key, (ia, ib) in slots._index.items()
    }


def _assert_slot_holds(slots, leaves, slot, lora_id):
    adapter = slots._cache[lora_id]
    for key, (a, b) in _device_slot(slots, leaves, slot).items():
        want = adapter.slot_values.get(key)
        if want is None:
            assert not a.any() and not b.any(), key
        else:
            np.testing.assert_array_equal(a, want[0])
            np.testing.assert_array_equal(b, want[1])


def test_host_cache_evicts_least_recently_used_unpinned(model_dir, tmp_path):
    slots, _ = _slots(model_dir, max_loras=2, max_lora_rank=4, max_cpu_loras=3)
    for i in (1, 2, 3):
        assert slots.add(i, *_adapter(tmp_path, slots, i))
    assert not slots.add(1, *_adapter(tmp_path, slots, 1))  # there already: now most recently used
    assert slots.pin(2)
    slots.add(4, *_adapter(tmp_path, slots, 4))  # evicts 3 (1 was used again, 2 is pinned)
    assert slots.ids() == {1, 2, 4}
    slots.add(5, *_adapter(tmp_path, slots, 5))
    assert slots.ids() == {2, 4, 5}
    with pytest.raises(ValueError, match="is not loaded; add it before pinning"):
        slots.pin(1)


def test_a_step_puts_its_adapters_in_slots_and_evicts_the_least_recently_used(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=2, max_lora_rank=4, max_cpu_loras=4)
    for i in (1, 2, 3):
        slots.add(i, *_adapter(tmp_path, slots, i))
    h = {i: slots.handle(i) for i in (1, 2, 3)}
    got = slots.slots_for(np.array([0, h[1], h[2], h[1]], np.int32))
    assert got[0] == 0 and got[1] == got[3] and {got[1], got[2]} == {1, 2}
    _assert_slot_holds(slots, leaves, got[1], 1)
    _assert_slot_holds(slots, leaves, got[2], 2)
    slots.slots_for(np.array([h[2]], np.int32))  # 2 is now more recently used than 1
    (slot3,) = slots.slots_for(np.array([h[3]], np.int32))
    assert slot3 == got[1]  # 1's slot
    _assert_slot_holds(slots, leaves, slot3, 3)
    assert slots.remove(3)
    assert all(not a.any() and not b.any() for a, b in _device_slot(slots, leaves, slot3).values())
    with pytest.raises(ValueError, match="a step uses 3 LoRA adapters but max_loras=2"):
        slots.slots_for(np.array([h[1], h[2], slots.handle(7)], np.int32))
    with pytest.raises(ValueError, match="LoRA adapter id 7 was never added"):
        slots.slots_for(np.array([slots.handle(7)], np.int32))


def test_an_adapter_named_by_a_request_is_read_when_a_step_needs_it(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=1, max_lora_rank=2)
    name, path = _adapter(tmp_path, slots, 9)
    slots.remember(2**40, name, path)  # vLLM ids are any positive int (a resolver hashes names)
    (slot,) = slots.slots_for(np.array([slots.handle(2**40)], np.int32))
    assert slot == 1 and slots.ids() == {2**40}
    _assert_slot_holds(slots, leaves, slot, 2**40)


def _step(slots, leaves, lora_ids):
    """One step whose rows use `lora_ids`: each row's slot, checked to hold its adapter."""
    got = slots.slots_for(np.array([slots.handle(i) for i in lora_ids], np.int32))
    for lora_id, slot in zip(lora_ids, got, strict=True):
        _assert_slot_holds(slots, leaves, slot, lora_id)
    return got


def test_mixed_traffic_over_more_adapters_than_cached_keeps_every_step_adapter(model_dir, tmp_path):
    """With 2 slots and 2 cached adapters, a step of a slotted adapter and a missing one read
    the missing one by evicting an adapter the step does not use (it used to evict the slotted
    one the step had just placed, a KeyError that ended the engine)."""
    slots, leaves = _slots(model_dir, max_loras=2, max_lora_rank=4, max_cpu_loras=2)
    for i in (1, 2, 3):
        slots.remember(i, *_adapter(tmp_path, slots, i))
    _step(slots, leaves, [1])
    _step(slots, leaves, [2])
    _step(slots, leaves, [1, 3])  # 1 is slotted but least recently cached: 2 goes
    assert slots.ids() == {1, 3}
    rng = np.random.default_rng(0)
    for _ in range(40):  # random steps of one or two of the three adapters
        _step(slots, leaves, sorted(rng.choice([1, 2, 3], size=rng.integers(1, 3), replace=False)))


def test_a_live_requests_adapter_is_never_evicted_nor_read_again(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=1, max_lora_rank=4, max_cpu_loras=1)
    paths = {i: _adapter(tmp_path, slots, i) for i in (1, 2, 3)}
    for i, where in paths.items():
        slots.remember(i, *where)
    slots.acquire(slots.handle(1))
    _step(slots, leaves, [1])
    os.remove(os.path.join(paths[1][1], "adapter_model.safetensors"))  # read again: it would fail
    _step(slots, leaves, [2])  # the cache holds 2 for a while: 1 is in use
    _step(slots, leaves, [3])
    assert slots.ids() == {1, 3}
    _step(slots, leaves, [1])  # from the cache, not the (gone) file
    slots.release(slots.handle(1))
    _step(slots, leaves, [2])  # 1 is no longer in use: evicted
    assert slots.ids() == {2}


def test_an_adapter_that_cannot_be_read_at_a_step_changes_nothing(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=2, max_lora_rank=4, max_cpu_loras=2)
    for i in (1, 2):
        slots.remember(i, *_adapter(tmp_path, slots, i))
    slots.remember(3, "gone", str(tmp_path / "gone"))
    before = _step(slots, leaves, [1, 2])
    with pytest.raises(LoraUnavailable, match=r"'gone': no adapter_config\.json") as raised:
        slots.slots_for(np.array([slots.handle(1), slots.handle(3)], np.int32))
    assert raised.value.lora_ids == (3,)
    assert slots.ids() == {1, 2}
    np.testing.assert_array_equal(_step(slots, leaves, [1, 2]), before)


def test_removing_an_adapter_in_use_waits_for_its_last_request(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=1, max_lora_rank=4)
    slots.add(1, *_adapter(tmp_path, slots, 1))
    slots.acquire(slots.handle(1))
    (slot,) = _step(slots, leaves, [1])
    assert slots.remove(1) and slots.ids() == set()
    _step(slots, leaves, [1])  # its request goes on with it
    slots.release(slots.handle(1))
    assert all(not a.any() and not b.any() for a, b in _device_slot(slots, leaves, slot).values())
    with pytest.raises(LoraUnavailable, match="id 1 was never added"):
        slots.slots_for(np.array([slots.handle(1)], np.int32))


def test_another_path_for_a_loaded_id_needs_load_inplace(model_dir, tmp_path):
    slots, leaves = _slots(model_dir, max_loras=1, max_lora_rank=4)
    name, path = _adapter(tmp_path, slots, 1)
    other = _adapter(tmp_path, slots, 2)[1]
    assert slots.add(1, name, path) and not slots.add(1, name, path)
    with pytest.raises(ValueError, match=r"is loaded from .*adapter1.*load_inplace=True"):
        slots.add(1, name, other)
    (slot,) = _step(slots, leaves, [1])
    assert slots.add(1, name, other, replace=True)
    _assert_slot_holds(slots, leaves, slot, 1)  # the slot holds the new weights


class _TwoHosts:
    """Two hosts' agreement (`hosts.agree_across_hosts`) where the other host read
    `other_error` / `other_digest` (None: the same values as this one)."""

    def __init__(self, other_error, other_digest):
        self.other = (other_error, other_digest)

    def __call__(self, error, digest):
        other_error, other_digest = self.other
        return [(error, digest), (other_error, digest if other_digest is None else other_digest)]


@pytest.mark.parametrize(
    "other_error, other_digest, named",
    [
        (
            "LoRA adapter 'x': no adapter_config.json",
            None,
            "refused on every host: host 1: .*no adapter_config",
        ),
        (None, b"another", "the hosts read different files \\(hosts \\[0\\] vs \\[1\\]\\)"),
    ],
)
def test_an_adapter_one_host_refuses_is_refused_on_every_host(
    model_dir, tmp_path, other_error, other_digest, named
):
    hosts = _TwoHosts(other_error, other_digest)
    slots, leaves = _slots(model_dir, agree=hosts, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match=named):
        slots.add(1, *_adapter(tmp_path, slots, 1))
    assert slots.ids() == set()
    slots.remember(1, *_adapter(tmp_path, slots, 1))
    with pytest.raises(LoraUnavailable, match=named):  # a step's read is agreed on alike
        slots.slots_for(np.array([slots.handle(1)], np.int32))
    assert all(not a.any() and not b.any() for a, b in _device_slot(slots, leaves, 1).values())
    hosts.other = (None, None)  # the other host read the same values
    assert slots.add(1, *_adapter(tmp_path, slots, 1))
    _step(slots, leaves, [1])
