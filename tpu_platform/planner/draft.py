# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding's programs and memory for a compile-only target: the verification of k
drafts a request (from a verify shape's rows, `speculation.verdict.make_verify_rows`, or from
hidden states, `make_verify`), a draft model's k-step draft loop
(`speculation.draft_model.make_draft_loop`), an EAGLE-3 head's or MTP layer's pass and loop
(`speculation.eagle3.make_head_programs`), each the runner's own builder compiled over abstract
weights and caches, and the bytes a draft adds per KV page and in weights (the planner's rows
for it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from models import ModelConfig, attach_rope_tables
from models.eagle import EagleHead
from models.eagle3 import Eagle3Config, Eagle3Head
from models.layers import Embedding
from models.mtp import BLOCKS, MtpHead
from models.serving_passes import fuse_projections, repeat_kv_heads_for_mesh
from models.sharding import MODEL_AXIS, kv_heads_on_mesh, state_shardings
from pallas_kernels import kv_cache_partition_spec, latent_cache_partition_spec
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array, kv_cache_dtype
from tpu_platform.mesh import replicated
from tpu_platform.planner.compiled import ProgramFacts, compile_with_text, measured
from tpu_platform.planner.plan import StepSetup, _abstract_caches, kv_page_bytes, step_shape
from tpu_platform.planner.targets import compile_only_devices
from tpu_platform.sampling import SamplerFlags, SamplingBatch, dummy_tensors
from tpu_platform.speculation.draft_model import (
    DraftCacheShape,
    drafter_kv_heads,
    drafter_page_bytes,
    kv_share,
    make_draft_loop,
    target_cache_group,
)
from tpu_platform.speculation.eagle3 import make_head_programs
from tpu_platform.speculation.verdict import make_verify, make_verify_rows


@dataclasses.dataclass(frozen=True, slots=True)
class DraftMemory:
    """What a draft adds on one chip: its weights, and its caches' bytes per KV page (one draft
    page beside each target page)."""

    weight_bytes: int
    page_bytes: int


def draft_memory(draft: StepSetup) -> DraftMemory:
    """The draft's rows of the plan (`draft` holds the draft's config with the target's limits
    and tensor-parallel size: on a mesh, one chip's share)."""
    return DraftMemory(draft.abstract_model().chip_weight_bytes(_mesh(draft)), kv_page_bytes(draft))


def _mesh(setup: StepSetup) -> jax.sharding.Mesh | None:
    """`setup`'s mesh of compile-only chips; None at TP=1 (no compiler needed for the arithmetic)."""
    return setup.mesh() if setup.tp_size > 1 else None


def pages_with_draft(kv_bytes: int, target_page_bytes: int, draft: DraftMemory) -> int:
    """KV pages left on a chip whose target alone would hold `kv_bytes` of cache (`KVFit.kv_bytes`)
    once `draft` is served beside it: its weights come out of those bytes, then every page takes
    a draft page beside it (the worker's split, `speculation.draft_model.kv_share`)."""
    left = kv_bytes - draft.weight_bytes
    if left <= 0:
        return 0
    return kv_share(target_page_bytes, draft.page_bytes, left) // target_page_bytes


def compile_draft_loop(draft: StepSetup, num_pages: int, rows: int, k: int) -> ProgramFacts:
    """Compiles the draft loop of `draft` (one chip) for `rows` requests and k drafts over caches
    of `num_pages` pages, with the target's compiler."""
    if draft.tp_size != 1:
        raise ValueError("the draft loop is served on one chip: use tp_size=1")
    device = compile_only_devices(draft.target)[0]
    model = draft.abstract_model()
    caches = _abstract_caches(draft, num_pages, None)
    on_chip = SingleDeviceSharding(device)
    caches = [jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=on_chip) for c in caches]
    layout = draft.kv_layout
    shape = DraftCacheShape(
        draft.backend,
        kv_cache_dtype(draft.cache_dtype).name,
        num_pages,
        caches_per_array(layout.num_caches, num_pages, draft.tokens_per_page),
    )
    loop = make_draft_loop(model.graphdef, model.state_def, shape)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=on_chip)  # noqa: E731
    args = (
        model.placed(None, device), caches, ints(rows), ints(rows),
        ints(rows, draft.buckets.max_pages), ints(1),
    )  # fmt: skip
    static = {"k": k, "page_size": draft.tokens_per_page, "max_position": draft.max_model_len - 1}
    return measured(lambda: compile_with_text(loop, device, *args, **static))


def compile_verify(target: StepSetup, rows: int, k: int, flags: SamplerFlags) -> ProgramFacts:
    """Compiles the verification of `rows` requests' k drafts each (`speculation.verifier.make_verify`:
    the LM head at 1 + k positions a request and the rejection rule) on one chip of the target."""
    if target.tp_size != 1:
        raise ValueError("compile_verify compiles the one-chip program: use tp_size=1")
    device = compile_only_devices(target.target)[0]
    model = target.abstract_model()
    on_chip = SingleDeviceSharding(device)
    state = jax.tree.unflatten(model.state_def, model.placed(None, device))
    hidden = jax.ShapeDtypeStruct((rows * (k + 1), target.config.hidden_size), target.dtype, sharding=on_chip)
    tensors = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip),
        dummy_tensors(flags, rows, target.config.vocab_size),
    )
    args = (
        state, hidden, jax.ShapeDtypeStruct((rows, k), np.int32, sharding=on_chip),
        jax.ShapeDtypeStruct((rows,), np.int32, sharding=on_chip), tensors,
    )  # fmt: skip
    verify = make_verify(model.graphdef)
    static = {"flags": flags, "feed_width": target.max_num_seqs}
    return measured(lambda: compile_with_text(verify, device, *args, **static))


def compile_verify_rows(target: StepSetup, rows: int, k: int, flags: SamplerFlags) -> ProgramFacts:
    """Compiles the verification of a verify shape's step of `rows` requests' k drafts each from
    its forward's logits of every row (`speculation.verdict.make_verify_rows`: the rows gathered
    and the rejection rule) on one chip of the target. `flags` with penalties, sparse entries
    and allowed ids: the program of sampling tensors per position at the runner's fixed widths
    (`SpeculativeDecoding.position_tensors`)."""
    if target.tp_size != 1:
        raise ValueError("compile_verify_rows compiles the one-chip program: use tp_size=1")
    device = compile_only_devices(target.target)[0]
    on_chip = SingleDeviceSharding(device)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=on_chip)  # noqa: E731
    vocab = target.config.vocab_size
    if flags.penalties or flags.sparse or flags.allowed:
        sampling = SamplingBatch(1, vocab, target.max_model_len)
        widths = dict(penalty_width=sampling.penalty_widths[-1], sparse_width=sampling.sparse_widths[-1])
        dummy = sampling.dummy_tensors(flags, rows * (k + 1), **widths)
    else:
        dummy = dummy_tensors(flags, rows, vocab)
    tensors = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), dummy)
    row_logits = jax.ShapeDtypeStruct((rows * (k + 1), vocab), np.float32, sharding=on_chip)
    args = (row_logits, ints(rows, k + 1), ints(rows, k), ints(rows), tensors)
    verify = make_verify_rows(target.max_num_seqs)
    return measured(lambda: compile_with_text(verify, device, *args, flags=flags))


@dataclasses.dataclass(frozen=True, slots=True)
class Eagle3Programs:
    """An EAGLE-3 head's programs compiled for a target chip, and its cache's bytes."""

    head_pass: ProgramFacts
    loop: ProgramFacts
    cache_bytes: int
    weight_bytes: int


def compile_eagle3(
    target: StepSetup, head: Eagle3Config, num_pages: int, num_tokens: int, rows: int, k: int
) -> Eagle3Programs:
    """Compiles an EAGLE-3 head's pass over a step of `num_tokens` tokens of `target` (its limits
    and chip) and its loop of k - 1 steps for `rows` requests, over a one-layer cache of
    `num_pages` pages, with the target's compiler (weights abstract; on `target.tp_size` chips
    split as the runner splits it: `speculation.eagle3`)."""
    dtype, mc = jnp.dtype(target.dtype), head.model

    def built() -> Eagle3Head:
        model = Eagle3Head(head, dtype=dtype, own_embedding=True, has_d2t=True)
        repeat_kv_heads_for_mesh(model, kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, target.tp_size))
        fuse_projections(model, target.tp_size)
        return model

    width = head.num_aux_hidden_states * head.target_hidden_size
    return _compile_head(target, built, head.model, width, num_pages, num_tokens, rows, k)


def compile_eagle(target: StepSetup, num_pages: int, num_tokens: int, rows: int, k: int) -> Eagle3Programs:
    """Compiles an EAGLE-1 head for `target`'s model (one Llama layer as wide as the target's,
    reading its final hidden states; the embedding and LM head copies of the target's, as the
    runner shares them): its pass and its loop, as `compile_eagle3` does an EAGLE-3 head's."""
    dtype = jnp.dtype(target.dtype)
    plain = {f.name: getattr(target.config, f.name) for f in dataclasses.fields(ModelConfig) if f.init}
    plain.update(architecture="EagleLlamaForCausalLM", num_layers=1, layer_sliding_windows=(None,))
    mc = ModelConfig(**plain)

    def built() -> EagleHead:
        model = EagleHead(mc, dtype=dtype, own_embedding=True, own_lm_head=True, fc_bias=False)
        repeat_kv_heads_for_mesh(model, kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, target.tp_size))
        fuse_projections(model, target.tp_size)
        return model

    return _compile_head(target, built, mc, mc.hidden_size, num_pages, num_tokens, rows, k)


def compile_mtp(target: StepSetup, num_pages: int, num_tokens: int, rows: int, k: int) -> Eagle3Programs:
    """Compiles the MTP layer of `target`'s model (numbered after its last layer; its block of
    the model's kind, the embedding a copy of the target's as the runner holds it): its pass and
    its loop, as `compile_eagle3` does an EAGLE-3 head's."""
    config, dtype = target.config, jnp.dtype(target.dtype)
    build_block, recycle_normed = BLOCKS[config.architecture]

    def built() -> MtpHead:
        block = build_block(config, config.num_layers, dtype=dtype)
        model = MtpHead(config, block, dtype=dtype, recycle_normed=recycle_normed)
        model.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        repeat_kv_heads_for_mesh(
            model, kv_heads_on_mesh(config.num_heads, config.num_kv_heads, target.tp_size)
        )
        fuse_projections(model, target.tp_size)
        return model

    return _compile_head(target, built, config, config.hidden_size, num_pages, num_tokens, rows, k)


def _compile_head(
    target: StepSetup,
    built: Callable[[], nnx.Module],
    mc: ModelConfig,
    width: int,
    num_pages: int,
    num_tokens: int,
    rows: int,
    k: int,
) -> Eagle3Programs:
    """The pass and loop (`speculation.eagle3.make_head_programs`) of the head `built()` makes,
    whose one-layer cache is of `mc`'s kind and which reads `width` of the target's hidden
    states a token. On a mesh (`target.tp_size > 1`) the weights are placed by the rules table,
    the cache split on its KV heads (a latent one whole), the inputs whole on every chip."""
    device, mesh = compile_only_devices(target.target)[0], target.mesh()
    on_chip = SingleDeviceSharding(device) if mesh is None else replicated(mesh)
    dtype = jnp.dtype(target.dtype)
    model = nnx.eval_shape(built)
    attach_rope_tables(model, target.max_model_len)
    graphdef, state = nnx.split(model)
    leaves, state_def = jax.tree.flatten(state)
    shardings = [on_chip] * len(leaves) if mesh is None else jax.tree.leaves(state_shardings(state, mesh))
    leaves = [
        jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s) for x, s in zip(leaves, shardings, strict=True)
    ]
    kv_dtype, page_size = kv_cache_dtype(target.cache_dtype), target.tokens_per_page
    heads = drafter_kv_heads(mc, target.tp_size)
    caches = jax.eval_shape(
        lambda: allocate_stacked_caches(
            1, num_pages, page_size, heads, mc.head_dim, kv_dtype, target.backend,
            latent_width=mc.latent_cache_width,
        )
    )  # fmt: skip
    cache_sharding = on_chip
    if mesh is not None:
        spec = (
            latent_cache_partition_spec()
            if mc.latent_cache_width
            else kv_cache_partition_spec(target.backend, MODEL_AXIS)
        )
        cache_sharding = NamedSharding(mesh, spec)
    caches = [jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=cache_sharding) for c in caches]
    per_array = caches_per_array(1, num_pages, page_size)
    # A hybrid target's step carries its groups' tables; the head reads its full-attention group's.
    group, num_groups = target_cache_group(target.config)
    shape = DraftCacheShape(target.backend, kv_dtype.name, num_pages, per_array, mesh, group)
    head_pass, loop = make_head_programs(graphdef, state_def, shape)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=on_chip)  # noqa: E731
    packed, dims = pack_inputs(padding_inputs(*step_shape(target, num_tokens), num_groups))
    aux = jax.ShapeDtypeStruct((dims[0], width), dtype, sharding=on_chip)
    feed = target.buckets.max_seqs
    pass_args = (leaves, caches, ints(*packed.shape), aux, ints(feed))
    loop_args = (
        leaves, caches, ints(feed), jax.ShapeDtypeStruct((feed, mc.hidden_size), dtype, sharding=on_chip),
        ints(rows), ints(rows, target.buckets.max_pages), ints(1),
    )  # fmt: skip
    static = {"steps": k - 1, "page_size": page_size, "max_position": target.max_model_len - 1}
    return Eagle3Programs(
        head_pass=measured(lambda: compile_with_text(head_pass, device, *pass_args, dims=dims)),
        loop=measured(lambda: compile_with_text(loop, device, *loop_args, **static)),
        cache_bytes=sum(_chip_bytes(c) for c in caches),
        weight_bytes=sum(_chip_bytes(x) for x in leaves),
    )


def _chip_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes one chip holds of `x`: its shard."""
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def eagle3_head_like(target: StepSetup, draft_vocab_size: int = 32000) -> Eagle3Config:
    """An EAGLE-3 head shaped for `target`'s model as the released heads are: one decoder layer as
    wide as the target's, reading three of its layers (vLLM's default choice), drafting from a
    `draft_vocab_size`-token vocabulary."""
    config = target.config
    # The plain fields of the target's configuration (a hybrid's layer kinds are not the head's).
    plain = {f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig) if f.init}
    plain.update(architecture="LlamaForCausalLMEagle3", num_layers=1, layer_sliding_windows=(None,))
    model = ModelConfig(**plain)
    return Eagle3Config(
        model=model, draft_vocab_size=draft_vocab_size, target_hidden_size=config.hidden_size,
        num_aux_hidden_states=3, aux_layer_ids=None,
    )  # fmt: skip


def eagle3_memory(target: StepSetup, head: Eagle3Config) -> DraftMemory:
    """What an EAGLE-3 head adds on one chip of `target`: its weights (in the target's dtype, with
    its own embedding and draft-to-target table, as served; on a mesh the chip's share, split as
    the runner splits it) and its one-layer cache's bytes per KV page on a chip."""
    dtype, mesh, mc = jnp.dtype(target.dtype), _mesh(target), head.model

    def built() -> Eagle3Head:
        model = Eagle3Head(head, dtype=dtype, own_embedding=True, has_d2t=True)
        repeat_kv_heads_for_mesh(model, kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, target.tp_size))
        return model

    state = nnx.state(nnx.eval_shape(built))
    leaves = jax.tree.leaves(state)
    shardings = [None] * len(leaves) if mesh is None else jax.tree.leaves(state_shardings(state, mesh))
    weights = sum(
        math.prod(x.shape if s is None else s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, s in zip(leaves, shardings, strict=True)
    )
    kv_dtype = kv_cache_dtype(target.cache_dtype)
    page = drafter_page_bytes(mc, 1, target.tokens_per_page, kv_dtype, target.backend, target.tp_size)
    return DraftMemory(weights, page)
