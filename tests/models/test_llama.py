# SPDX-License-Identifier: Apache-2.0
"""Llama forward pass against transformers (fp32), prefill and ragged mixed batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaForCausalLM

from models import AttentionMetadata, ModelConfig, build, load_model, load_weights, pack_for_native_dense
from models.linear import PackedKernel
from pallas_kernels import allocate_kv_cache
from tests.tiny_models import save_tiny_llama

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))
    config, model = load_model(path)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, config, model, hf


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids], dtype=torch.long)).logits[0].numpy()


def _run(config, model, caches, seqs, starts, pages, cache_pages=0, caches_per_array=0):
    """One ragged step: seqs[i] = new token ids of sequence i, starting at position starts[i].
    `cache_pages`: the caches are stacked, that many pages a layer, `caches_per_array` an array
    (0: all in one)."""
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    positions = np.concatenate(
        [np.arange(st, st + len(s)) for s, st in zip(seqs, starts, strict=True)]
    ).astype(np.int32)
    slots = np.concatenate(
        [
            np.asarray(pages[i])[p // PAGE] * PAGE + p % PAGE
            for i, p in enumerate(np.split(positions, np.cumsum([len(s) for s in seqs])[:-1]))
        ]
    ).astype(np.int32)
    width = max(len(p) for p in pages)
    table = np.array([list(p) + [0] * (width - len(p)) for p in pages], np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        kv_lens=jnp.asarray([st + len(s) for s, st in zip(seqs, starts, strict=True)], jnp.int32),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), jnp.int32),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        cache_pages=cache_pages,
        caches_per_array=caches_per_array,
    )
    graphdef, state = nnx.split(model)
    logits, caches = _logits(graphdef, state, caches, jnp.asarray(ids), jnp.asarray(positions), md)
    return np.asarray(logits), caches


# One compile of the whole step (what the runner runs) rather than an op at a time: a tiny model's
# step compiles in less time than its ops take eagerly.
@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, caches, ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, caches = model(ids, positions, caches, md)
    return model.compute_logits(hidden), caches


@functools.partial(jax.jit, static_argnums=0)
def _hidden(graphdef, state, caches, ids, positions, md):
    return nnx.merge(graphdef, state)(ids, positions, caches, md)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _with_aux(graphdef, state, caches, ids, positions, md, aux_layers):
    return nnx.merge(graphdef, state)(ids, positions, caches, md, aux_layers=aux_layers)


def _caches(config, stacked=False, backend="xla"):
    """One float32 cache of 32 pages a layer: an array each, or all in one array (the runner's)."""
    count, pages = (1, 32 * config.num_layers) if stacked else (config.num_layers, 32)
    return [
        allocate_kv_cache(pages, PAGE, config.num_kv_heads, config.head_dim, jnp.float32, backend=backend)
        for _ in range(count)
    ]


@pytest.mark.slow  # the head's capture is checked in tpu_platform/test_eagle3.py's fast tests
def test_the_trunk_hands_an_eagle3_head_the_residual_stream_entering_its_layers(tiny):
    """`aux_layers` (EAGLE-3): the hidden states entering layers 0 and 1 (transformers'
    `hidden_states[0]` and `[1]`) and the last layer's output before the norm, side by side."""
    _, config, model, hf = tiny
    ids = [1, 5, 9, 20, 33, 7, 100, 200, 3, 17]
    md = AttentionMetadata(
        slot_mapping=jnp.arange(len(ids), dtype=jnp.int32) + PAGE, kv_lens=jnp.asarray([len(ids)], jnp.int32),
        page_indices=jnp.asarray([[1]], jnp.int32), cu_q_lens=jnp.asarray([0, len(ids)], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )  # fmt: skip
    tokens, positions = jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)
    graphdef, state = nnx.split(model)
    hidden, _, aux = _with_aux(graphdef, state, _caches(config), tokens, positions, md, (0, 1, 2))
    plain = jax.eval_shape(_hidden, graphdef, state, _caches(config), tokens, positions, md)
    assert len(plain) == 2  # nothing more unless asked
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    d = config.hidden_size
    for i in (0, 1):
        np.testing.assert_allclose(aux[:, i * d : (i + 1) * d], expected[i][0].numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(model.model.norm(aux[:, 2 * d :]), hidden, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(hidden, expected[2][0].numpy(), atol=1e-4, rtol=1e-4)  # HF's last: normed


# Stacked caches: the fast tier checks them in `test_layers_split_over_stacked_arrays_...` (two layers
# in one array, a third in another); the ragged batch over them is the slow tier's.
@pytest.mark.parametrize(
    "stacked",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["cache_per_layer", "stacked_caches"],
)
def test_ragged_prefill_then_mixed_decode_match_transformers(tiny, stacked):
    _, config, model, hf = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 16, 33)]  # exact page multiple too
    pages = [[1], [9, 2], [6, 7, 5]]  # neither contiguous nor in order
    caches = _caches(config, stacked)
    cache_pages = 32 if stacked else 0
    # Step 1: all three prompts in one ragged prefill; the logits of every position of each.
    logits, caches = _run(config, model, caches, prompts, [0, 0, 0], pages, cache_pages)
    starts = np.cumsum([0, *(len(p) for p in prompts)])
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[starts[i] : starts[i + 1]], _hf_logits(hf, p), atol=1e-4, rtol=1e-4)
    # Step 2: one decode token for seq 0 and 1, and a 2-token chunk for seq 2 (mixed batch).
    new = [[11], [12], [13, 14]]
    logits, caches = _run(config, model, caches, new, [len(p) for p in prompts], pages, cache_pages)
    rows = np.cumsum([len(n) for n in new]) - 1
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[rows[i]], _hf_logits(hf, p + new[i])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # the fast tier's bfloat16 model: the packed one below
def test_bf16_serving_dtype_close_to_fp32(tiny):
    path, config, _, hf = tiny
    model = build(config, jnp.bfloat16)
    load_weights(model, path)
    ids = [1, 5, 9, 20, 33, 7]
    caches = [
        allocate_kv_cache(8, PAGE, config.num_kv_heads, config.head_dim, jnp.bfloat16, backend="xla")
        for _ in range(config.num_layers)
    ]
    logits, _ = _run(config, model, caches, [ids], [0], [[1]])
    ref = _hf_logits(hf, ids)
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()


def test_layers_split_over_stacked_arrays_match_transformers(tmp_path):
    # Three layers, two to an array: layer 2 is the second array's first cache.
    path = save_tiny_llama(str(tmp_path / "three_layers"), num_hidden_layers=3)
    config, model = load_model(path)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    caches = [
        allocate_kv_cache(pages, PAGE, config.num_kv_heads, config.head_dim, jnp.float32, backend="xla")
        for pages in (2 * 32, 32)
    ]
    prompt, more = [5, 9, 20, 33, 7, 100, 200, 3, 17, 250, 251, 4, 8, 15, 16, 23, 42], [11, 12]
    step = functools.partial(_run, config, model, cache_pages=32, caches_per_array=2)
    _, caches = step(caches, [prompt], [0], [[3, 1]])
    logits, caches = step(caches, [more], [len(prompt)], [[3, 1]])
    want = _hf_logits(hf, prompt + more)[-2:]
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
    written = [set(np.flatnonzero(np.asarray(c).any(axis=(0, 2)))) for c in caches]  # [2K, pages, S*D]
    assert written == [{1, 3, 33, 35}, {1, 3}]  # layers 0 and 1 in array 0, layer 2 in array 1


def test_unsupported_architecture_is_named():
    config = ModelConfig(
        architecture="FooForCausalLM",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    with pytest.raises(ValueError, match=r"'FooForCausalLM' is not supported.*LlamaForCausalLM"):
        build(config)


def test_sharded_checkpoint_and_half_precision_load(tmp_path):
    path = str(tmp_path / "sharded")
    save_tiny_llama(path)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = _hf_logits(hf, [1, 2, 3, 4])
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")  # bf16 shards + index
    config, model = load_model(path)
    logits, _ = _run(config, model, _caches(config), [[1, 2, 3, 4]], [0], [[1]])
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.slow  # every served model's projections are fused: the fast tier's runner tests serve them
def test_fused_projections_replace_the_checkpoint_ones_and_compute_the_same(tiny):
    """`load_model` fuses q/k/v and gate/up; a model only built and loaded keeps the checkpoint's
    projections. Both match transformers."""
    path, config, fused, hf = tiny
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert attention.qkv_proj is not None and mlp.gate_up_proj is not None
    assert not hasattr(attention, "q_proj") and not hasattr(mlp, "gate_proj")
    unfused = build(config)
    load_weights(unfused, path)
    assert unfused.model.layers[0].self_attn.qkv_proj is None
    ids = [5, 9, 2, 7, 7, 1]
    ref = _hf_logits(hf, ids)
    for model in (fused, unfused):
        logits, _ = _run(config, model, _caches(config), [ids], [0], [[3]])
        np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("tied", [False, True])
def test_host_load_then_packing_gives_the_device_load_weights(tmp_path, tied):
    """`on_host=True` leaves every weight a NumPy array (what the runner packs before its one
    transfer); put on the device, the packed weights are those of a device load packed there."""
    path = save_tiny_llama(str(tmp_path), tie_word_embeddings=tied)
    _, on_device = load_model(path, jnp.bfloat16)
    _, on_host = load_model(path, jnp.bfloat16, on_host=True)
    device_leaves, host_leaves = jax.tree.leaves(nnx.state(on_device)), jax.tree.leaves(nnx.state(on_host))
    assert all(isinstance(x, jax.Array) for x in device_leaves)
    assert all(isinstance(x, np.ndarray) for x in host_leaves)
    assert pack_for_native_dense(on_device) == pack_for_native_dense(on_host) > 0
    put = jax.device_put(nnx.state(on_host))
    for want, got in zip(jax.tree.leaves(nnx.state(on_device)), jax.tree.leaves(put), strict=True):
        assert want.dtype == got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])  # tied: the slow tier's
def test_packed_bf16_model_computes_what_the_unpacked_one_does(dense_kernels, tmp_path, tied):
    """`pack_for_native_dense` moves every Linear (and a tied head's copy) onto the native dense
    kernel (its best path here); the logits
    stay those of the XLA bfloat16 model and close to transformers' float32 ones."""
    path = save_tiny_llama(str(tmp_path), tie_word_embeddings=tied)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    config, plain = load_model(path, jnp.bfloat16)
    _, packed = load_model(path, jnp.bfloat16)
    assert pack_for_native_dense(packed) == 4 * config.num_layers + 1  # qkv, o, gate/up, down; the head
    assert isinstance(packed.model.layers[0].mlp.down_proj.kernel, PackedKernel)
    ids = [1, 5, 9, 20, 33, 7, 3]
    bf16_caches = [
        allocate_kv_cache(8, PAGE, config.num_kv_heads, config.head_dim, jnp.bfloat16, backend="xla")
        for _ in range(config.num_layers)
    ]
    got, _ = _run(config, packed, bf16_caches, [ids], [0], [[1]])
    want, _ = _run(config, plain, bf16_caches, [ids], [0], [[1]])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=0.02 * scale)
    assert np.abs(got - _hf_logits(hf, ids)).max() < 0.05 * scale


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])  # tied: the slow tier's
def test_packed_float32_model_computes_what_transformers_does(native_kernels, tmp_path, tied):
    """With `float32`, `pack_for_native_dense` moves a float32 model's Linears (and a tied head's
    copy) onto the float32 native kernel; bfloat16 packing alone leaves them on XLA."""
    from pallas_kernels import cpu

    if not cpu.dense_f32_usable(native_kernels):
        pytest.skip("this CPU (or its kernel) has no AVX2 with FMA")
    path = save_tiny_llama(str(tmp_path), tie_word_embeddings=tied)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    config, model = load_model(path, jnp.float32)
    assert pack_for_native_dense(model) == 0  # float32 kernels stay unless asked for
    assert pack_for_native_dense(model, float32=True) == 4 * config.num_layers + 1
    assert model.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.float32
    ids = [1, 5, 9, 20, 33, 7, 3]
    got, _ = _run(config, model, _caches(config), [ids], [0], [[1]])
    ref = _hf_logits(hf, ids)
    np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max())


# The fast tier checks the backend whose dense kernels rely on the zeros; XLA's is the slow tier's.
@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.slow), "cpu_native"])
def test_padding_tokens_stay_zero_through_every_layer(tiny, request, backend):
    """A step's padding tokens (past `cu_q_lens[num_seqs]`) have zero hidden states out of every
    layer, on which the CPU's dense kernels skip them; the real tokens' states are those of the
    same step unpadded."""
    if backend == "cpu_native":
        request.getfixturevalue("native_kernels")
    _, config, model, _ = tiny
    seqs, real = [[1, 5, 9, 20, 33], [7, 3, 11, 2]], 9
    graphdef, state = nnx.split(model)
    ids, positions, md = _padded_step(seqs, num_tokens=16, num_slots=4, backend=backend)
    hidden, _ = _hidden(graphdef, state, _caches(config, backend=backend), ids, positions, md)
    ids, positions, md = _padded_step(seqs, num_tokens=real, num_slots=2, backend=backend)
    want, _ = _hidden(graphdef, state, _caches(config, backend=backend), ids, positions, md)
    np.testing.assert_array_equal(np.asarray(hidden)[real:], 0)
    np.testing.assert_allclose(np.asarray(hidden)[:real], np.asarray(want), rtol=1e-5, atol=1e-5)


def _padded_step(seqs, *, num_tokens, num_slots, backend):
    """Token ids, positions and metadata of a prefill of `seqs` (a page each), padded to
    `num_tokens` tokens (id 0, slot -1) and `num_slots` sequence slots."""
    lens = [len(s) for s in seqs]
    real = sum(lens)
    ids = np.zeros(num_tokens, np.int32)
    ids[:real] = np.concatenate(seqs)
    positions = np.zeros(num_tokens, np.int32)
    positions[:real] = np.concatenate([np.arange(n) for n in lens])
    slots = np.full(num_tokens, -1, np.int32)
    slots[:real] = np.concatenate([(i + 1) * PAGE + np.arange(n) for i, n in enumerate(lens)])
    cu = np.full(num_slots + 1, real, np.int32)
    cu[: len(seqs) + 1] = np.concatenate([[0], np.cumsum(lens)])
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        kv_lens=jnp.asarray(lens + [0] * (num_slots - len(seqs)), jnp.int32),
        page_indices=jnp.asarray([[i + 1] for i in range(num_slots)], jnp.int32),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        backend=backend,
    )
    return jnp.asarray(ids), jnp.asarray(positions), md
