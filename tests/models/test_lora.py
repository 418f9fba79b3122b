# SPDX-License-Identifier: Apache-2.0
"""LoRA slots on fused projections (`models.lora`) against NumPy merged weights, and PEFT adapter
files refused by name when they do not fit (`models.lora_files`)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from models.linear import Linear
from models.lora import LoraSite, LoraWeights, attach_lora, set_lora_tokens, site_slot_values
from models.lora_files import read_adapter
from models.sharding import repeat_kv_heads


def _linear(rng, in_features, out_features):
    linear = Linear(in_features, out_features, bias=False, dtype=jnp.float32)
    linear.kernel.set_value(rng.normal(size=(in_features, out_features)).astype(np.float32))
    return linear


@pytest.mark.parametrize("blocks, repeats", [(1, 1), (2, 1), (4, 4)])
def test_fused_projection_update_is_each_part_merged(blocks, repeats):
    """q/k/v fused (in `blocks` interleaved blocks, as for tensor parallelism; the one KV head
    repeated `repeats` times, as on a mesh of more devices than KV heads) with two adapters of
    ranks 3 and 2 (max 4) give, token by token, the fused projection of the merged parts."""
    rng = np.random.default_rng(0)
    d, widths, max_rank, head_dim = 8, (8, 4, 4), 4, 4
    parts = [_linear(rng, d, w) for w in widths]
    names = ("q", "k", "v")
    repeated = (8, 4 * repeats, 4 * repeats)
    site = LoraSite(names, repeated, d, blocks, head_repeats=(1, repeats, repeats), head_dim=head_dim)
    adapters = []
    for rank, targets in ((3, ("q", "k", "v")), (2, ("k",))):
        adapters.append(
            {
                n: (rng.normal(size=(d, rank)), rng.normal(size=(rank, w)))
                for n, w in zip(names, widths, strict=True)
                if n in targets
            }
        )
    fused = Linear.concatenated([_repeated(p, n, repeats) for p, n in zip(parts, names, strict=True)], blocks)
    a = np.zeros((3, d, 3 * max_rank), np.float32)
    b = np.zeros((3, 3 * max_rank, sum(repeated)), np.float32)
    for slot, adapter in enumerate(adapters, start=1):
        a[slot], b[slot] = site_slot_values(site, adapter, max_rank)
    fused.lora = LoraWeights(a, b)
    slots = np.array([0, 1, 2, 1, 0, 2])
    x = rng.normal(size=(slots.size, d)).astype(np.float32)
    set_lora_tokens(fused, jnp.asarray(slots))
    got = np.asarray(fused.product(jnp.asarray(x)))
    for t, slot in enumerate(slots):
        merged = []
        for name, part in zip(names, parts, strict=True):
            kernel = np.asarray(part.kernel[...], np.float64)
            if slot and name in adapters[slot - 1]:
                pa, pb = adapters[slot - 1][name]
                kernel = kernel + pa @ pb
            merged.append(Linear(d, kernel.shape[1], bias=False, dtype=jnp.float32))
            merged[-1].kernel.set_value(kernel.astype(np.float32))
            merged[-1] = _repeated(merged[-1], name, repeats)
        want = np.asarray(Linear.concatenated(merged, blocks).kernel[...])
        np.testing.assert_allclose(got[t], x[t] @ want, rtol=1e-4, atol=1e-4)


def _repeated(linear, name, repeats):
    """A k or v part with its one head repeated (`sharding.repeat_kv_heads`), q as it is."""
    if name == "q" or repeats == 1:
        return linear
    kernel = repeat_kv_heads(np.asarray(linear.kernel[...]), 1, repeats, axis=1)
    out = Linear(kernel.shape[0], kernel.shape[1], bias=False, dtype=jnp.float32)
    out.kernel.set_value(kernel)
    return out


def test_a_model_without_slots_ignores_the_step_slots():
    linear = _linear(np.random.default_rng(1), 4, 4)
    set_lora_tokens(linear, jnp.zeros(3, jnp.int32))
    x = jnp.ones((3, 4))
    np.testing.assert_allclose(linear.product(x), x @ linear.kernel[...], rtol=1e-6)


def _sites():
    prefix = "model.layers.0"
    return {
        f"{prefix}.self_attn.qkv_proj": LoraSite(
            tuple(f"{prefix}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")), (8, 4, 4), 8
        ),
        f"{prefix}.self_attn.o_proj": LoraSite((f"{prefix}.self_attn.o_proj",), (8,), 8),
    }


def _write(path, tensors, **config):
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **config}, f)
    return path


def _pair(module, rank=2, in_features=8, out_features=8):
    return {
        f"base_model.model.{module}.lora_A.weight": np.ones((rank, in_features), np.float32),
        f"base_model.model.{module}.lora_B.weight": np.ones((out_features, rank), np.float32),
    }


Q = "model.layers.0.self_attn.q_proj"


def test_an_adapter_reads_into_its_sites_with_the_scaling_folded_in(tmp_path):
    adapter = read_adapter("ok", _write(str(tmp_path), _pair(Q)), _sites(), 4)
    assert adapter.targets == ("q_proj",) and adapter.scaling == 2.0
    a, b = adapter.slot_values["model.layers.0.self_attn.qkv_proj"]
    assert a.shape == (8, 12) and b.shape == (12, 16)
    np.testing.assert_array_equal(a[:, :2], 1) and np.testing.assert_array_equal(a[:, 2:], 0)
    np.testing.assert_array_equal(b[:2, :8], 2.0) and np.testing.assert_array_equal(b[:, 8:], 0)
    assert "model.layers.0.self_attn.o_proj" not in adapter.slot_values


@pytest.mark.parametrize(
    "tensors, config, named",
    [
        (_pair(Q, rank=8), dict(r=8), "'bad': rank r=8 exceeds max_lora_rank=4"),
        (
            {k: v for k, v in _pair(Q).items() if "lora_B" in k},
            {},
            f"missing tensor base_model.model.{Q}.lora_A",
        ),
        (_pair(Q) | _pair("lm_head"), {}, "target module 'lm_head' cannot carry an adapter"),
        (_pair(Q) | _pair("model.embed_tokens"), {}, "target module 'model.embed_tokens' cannot carry"),
        (_pair("model.layers.0.mlp.gate_proj"), {}, "'model.layers.0.mlp.gate_proj' is not in this model"),
        (_pair(Q, in_features=6), {}, "needs \\(2, 8\\) and \\(8, 2\\)"),
        (_pair(Q), dict(target_modules=["q_proj", "o_proj"]), "target module 'o_proj' has no tensors"),
        (
            _pair(Q),
            dict(target_modules=["q_proj", "lm_head"]),
            "target modules \\['lm_head'\\] are not supported",
        ),
        (_pair(Q), dict(use_dora=True), "DoRA"),
        (_pair(Q), dict(bias="all"), "bias='all'"),
        (_pair(Q), dict(peft_type="IA3"), "peft_type 'IA3'"),
    ],
)
def test_a_broken_adapter_is_refused_naming_it_and_the_problem(tmp_path, tensors, config, named):
    with pytest.raises(ValueError, match=named) as raised:
        read_adapter("bad", _write(str(tmp_path), tensors, **config), _sites(), 4)
    assert "'bad'" in str(raised.value)


def test_a_missing_adapter_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no adapter_config\.json in"):
        read_adapter("gone", str(tmp_path / "gone"), _sites(), 4)


def test_attach_gives_every_dense_projection_zeroed_slots(tmp_path):
    from models import load_model
    from tests.tiny_models import save_tiny_llama

    _, model = load_model(save_tiny_llama(str(tmp_path / "llama")))
    sites = attach_lora(model, max_loras=2, max_rank=4, dtype=jnp.float32)
    assert sorted(k.split(".", 3)[3] for k in sites if ".layers.0." in k) == [
        "mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj",
    ]  # fmt: skip
    qkv = model.model.layers[0].self_attn.qkv_proj.lora
    assert qkv.a.shape == (3, 64, 12) and qkv.b.shape == (3, 12, 64 + 2 * 32)
    assert not np.asarray(qkv.a[...]).any()
