# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-3 proposer: a one-layer head (`models.eagle3`) drafts k tokens a step from the
target's own hidden states, as vLLM's EAGLE proposer does.

The target's step program then has one more output: the residual streams entering the head's
three chosen target layers, `[T, 3 * D]` (`models.layers.DecoderModel`, `aux_layers`; on a
hybrid target, Qwen3-Next or Qwen3.5, a Gated DeltaNet layer's output is read as any layer's).
The head's KV cache is one layer's, as many pages as the target's and indexed by its block
tables (a hybrid's full-attention group's: `draft_model.target_cache_group`), inside the same
memory budget (`draft_model.kv_share`); vLLM reserves k lookahead slots per request.

The head's cache entry at position p is computed from the token at p + 1 and the target's hidden
state at p, so it waits for the step's tokens. Once they are recorded, two programs:
- the pass over the step's own packed inputs (every token, so the head's cache covers every
  position the target's does; prefill chunks included), with each token replaced by the next
  one, the target's hidden states combined by `fc`; its output at each drafted request's last
  accepted position gives the first draft, from the newly sampled token;
- k - 1 single-token steps of the head (`jax.lax.scan`), each from the previous step's draft and
  its own hidden state before its norm (one program per request bucket).
Rows past a request's accepted tokens (rejected drafts) write stale entries the next step's pass
overwrites before any read. Drafts are the argmax over the head's draft vocabulary, mapped to
target ids (`d2t`). The pass is built for every token bucket, the loop for every request bucket.

Under tensor parallelism the head is split on the target's mesh as a decoder layer of the
target is (`models.sharding`'s rules: its attention's whole heads and its MLP's columns a
device, its LM head on the draft vocabulary, a shared embedding as the target's); `fc`, a
`[3 * D_target, D]` kernel (about 100 MB for Llama-3.1-8B's head, against the target's 16 GB),
stays whole on every device, which saves its all-reduce. Its cache is split on the KV heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from models import AttentionMetadata, ModelConfig, attach_rope_tables
from models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3_head
from models.layers import CausalLM, DecoderModel
from tpu_platform.buckets import round_up, token_buckets
from tpu_platform.inputs import StepPlan, pack_inputs, padding_inputs, unpack_inputs
from tpu_platform.kv_cache import caches_per_array
from tpu_platform.programs import Programs, ProgramSpec, structure_text
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling.ops import first_argmax
from tpu_platform.speculation.draft_model import (
    DraftCacheShape,
    check_target_groups,
    draft_caches,
    drafter_page_bytes,
    place_drafter,
    target_cache_group,
)


def _drafts(head: Eagle3Head, hidden: jax.Array) -> jax.Array:
    """Each row's draft: the target id of the argmax over the head's draft vocabulary."""
    return head.target_ids(first_argmax(head.draft_logits(hidden).astype(jnp.float32)))


def _metadata(shape: DraftCacheShape, **fields) -> tuple[int, AttentionMetadata]:
    md = AttentionMetadata(
        backend=shape.backend, kv_dtype=shape.kv_dtype, cache_pages=shape.num_pages,
        caches_per_array=shape.caches_per_array, mesh=shape.mesh,
        layer_groups=(shape.group,) if shape.group else (), **fields,
    )  # fmt: skip
    return md.for_layer(0)


def head_pass(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],
    kv_caches: list[jax.Array],
    packed: jax.Array,
    aux: jax.Array,
    sample_rows: jax.Array,
    *,
    dims: tuple[int, int, int, int],
    shape: DraftCacheShape,
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """The head over a step's tokens (`packed`, its token ids shifted by one) and the target's
    hidden states `aux [T, A * D]`: writes their cache entries and returns the drafts and the
    hidden states (before the norm) at `sample_rows [F]`."""
    head = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
    inputs = unpack_inputs(packed, dims)
    array, md = _metadata(
        shape, slot_mapping=inputs.slot_mapping, kv_lens=inputs.kv_lens, page_indices=inputs.page_indices,
        cu_q_lens=inputs.cu_q_lens, num_seqs=inputs.num_seqs,
    )  # fmt: skip
    caches = list(kv_caches)
    hidden, caches[array] = head(inputs.token_ids, head.combine(aux), inputs.positions, caches[array], md)
    rows = hidden[sample_rows]
    return _drafts(head, rows), rows, caches


def head_loop(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],
    kv_caches: list[jax.Array],
    first: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    page_indices: jax.Array,
    num_seqs: jax.Array,
    *,
    steps: int,
    page_size: int,
    max_position: int,
    shape: DraftCacheShape,
) -> tuple[jax.Array, list[jax.Array]]:
    """`steps` single-token steps of the head over R requests (the first R of `first [F]`, the
    pass's drafts, and `hidden [F, D]`, its hidden states), the first at `positions [R]` (each
    request's newest token's), over block tables `page_indices [R, P]`; `num_seqs [1]` real rows.
    Returns the drafts `[R, 1 + steps]` (the pass's first) and the caches."""
    head = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
    rows = positions.shape[0]
    real = jnp.arange(rows) < num_seqs[0]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1, dtype=jnp.int32), num_seqs[0])

    def step(carry, _):
        caches, token, hidden, position = carry
        position = jnp.minimum(position, max_position)  # past max_model_len: dropped on the host
        page = jnp.take_along_axis(page_indices, (position // page_size)[:, None], axis=1)[:, 0]
        slot = jnp.where(real, page * page_size + position % page_size, -1)
        array, md = _metadata(
            shape, slot_mapping=slot, kv_lens=jnp.where(real, position + 1, 0), page_indices=page_indices,
            cu_q_lens=cu_q_lens, num_seqs=num_seqs,
        )  # fmt: skip
        caches = list(caches)
        hidden, caches[array] = head(token, hidden, position, caches[array], md)
        proposed = _drafts(head, hidden)
        return (caches, proposed, hidden, position + 1), proposed

    carry = (list(kv_caches), first[:rows], hidden[:rows], positions)
    (kv_caches, *_), drafts = jax.lax.scan(step, carry, length=steps)
    return jnp.concatenate([first[:rows, None], drafts.T], axis=1).astype(jnp.int32), kv_caches


def make_head_programs(graphdef: nnx.GraphDef, state_def: jax.tree_util.PyTreeDef, shape: DraftCacheShape):
    """`(head_pass, head_loop)` of the head (`graphdef`, `state_def`) over caches of `shape`,
    jitted with the caches donated (the pass's `dims` and the loop's `steps`, `page_size` and
    `max_position` static)."""
    bound = dict(shape=shape)
    return (
        jax.jit(
            functools.partial(head_pass, graphdef, state_def, **bound),
            donate_argnums=(1,),
            static_argnames=("dims",),
        ),
        jax.jit(
            functools.partial(head_loop, graphdef, state_def, **bound),
            donate_argnums=(1,),
            static_argnames=("steps", "page_size", "max_position"),
        ),
    )


def check_target(model: nnx.Module, target: ModelConfig) -> None:
    """Refuses by name a target whose step cannot hand the head its hidden states: the trunk
    that collects them is `models.layers.DecoderModel`'s (Llama, Qwen, Mistral families,
    Qwen3-Next and Qwen3.5)."""
    trunk = getattr(model, "model", None)
    if type(model).__call__ is not CausalLM.__call__ or type(trunk).__call__ is not DecoderModel.__call__:
        raise ValueError(
            f"speculative method 'eagle3' is not supported by vllm-xla for {target.architecture} "
            "yet (its layers' hidden states are not exposed to the head); use a Llama-family "
            "target, or method 'ngram' or 'draft_model'"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    """What the pass needs of a step: its packed inputs (a copy), their dims, the requests' table
    rows in batch order and the target's hidden states for the head."""

    packed: np.ndarray
    dims: tuple[int, int, int, int]
    rows: np.ndarray
    aux: jax.Array


class Eagle3Proposer:
    """The head's weights, KV cache and programs (see the module docstring)."""

    method = "eagle3"

    def __init__(
        self,
        config: Eagle3Config,
        head: Eagle3Head,
        aux_layers: tuple[int, ...],
        k: int,
        device: jax.Device,
        mesh: Mesh | None = None,
        target_groups: tuple[int, int] = (0, 1),
    ):
        self.config = config
        # The target's group whose tables the head's cache follows, and its count (`target_cache_group`).
        self._target_groups = target_groups
        self.cache_group = target_groups[0]
        self.model_config = config.model
        self.aux_layers = aux_layers
        self.k = k
        self.mesh = mesh
        self._graphdef, state = nnx.split(head)
        self._state_leaves, self._state_def = jax.tree.flatten(place_drafter(state, mesh, device))
        self.kv_caches: list[jax.Array] = []
        self._step: _Step | None = None

    @classmethod
    def load(
        cls, path: str, *, k: int, target: ModelConfig, target_model: nnx.Module, dtype: jnp.dtype,
        max_model_len: int, device: jax.Device, mesh: Mesh | None = None,
    ) -> Eagle3Proposer:  # fmt: skip
        """The head of checkpoint `path` for `target` (its model, whose embedding a head without
        one shares), on `device` or split on the target's `mesh`; a head of another vocabulary
        or width, whose heads the mesh does not split, or a target whose hidden states cannot
        be read, is refused by name."""
        check_target(target_model, target)
        config, head = load_eagle3_head(path, dtype, 1 if mesh is None else mesh.size)
        aux_layers = config.aux_layers(target)
        if head.embed_tokens is None:
            head.share_embedding(target_model.model.embed_tokens.embedding[...])
        attach_rope_tables(head, max_model_len)
        return cls(config, head, aux_layers, k, device, mesh, target_cache_group(target))

    def page_bytes(self, page_size: int, kv_dtype: jnp.dtype, backend: str) -> int:
        """Bytes one page takes in the head's cache (one layer)."""
        tp_size = 1 if self.mesh is None else self.mesh.size
        return drafter_page_bytes(self.model_config, 1, page_size, kv_dtype, backend, tp_size)

    def initialize(
        self,
        num_pages: int,
        *,
        page_size: int,
        kv_dtype: jnp.dtype,
        backend: str,
        feed_width: int,
        device: jax.Device,
        num_groups: int,
    ) -> None:
        """Allocates the head's cache (`num_pages` pages, the target's) and its programs; on a
        hybrid target its one layer is in the target's full-attention group (`cache_group`)."""
        check_target_groups(self.method, self._target_groups, num_groups)
        self.kv_caches = draft_caches(
            self.model_config, 1, num_pages, page_size, kv_dtype, backend, device, self.mesh
        )
        self._shape = DraftCacheShape(
            backend,
            kv_dtype.name,
            num_pages,
            caches_per_array(1, num_pages, page_size),
            self.mesh,
            self.cache_group,
        )
        self._pass, self._loop = make_head_programs(self._graphdef, self._state_def, self._shape)
        self._page_size, self._feed_width = page_size, feed_width
        self.row_buckets = token_buckets(feed_width, feed_width)
        tp_size = 1 if self.mesh is None else self.mesh.size
        self._context = repr((self.config, structure_text(self._graphdef), self._shape, page_size, tp_size))

    def input_width(self) -> int:
        """The width of the target's hidden states the head reads (`head_input`'s)."""
        return len(self.aux_layers) * self.config.target_hidden_size

    def head_input(self, hidden: jax.Array, aux: tuple[jax.Array, ...]) -> jax.Array:
        """What the head reads of the target's step outputs: the chosen layers' hidden states."""
        return aux[0]

    # -- after the target's forward: keep what the pass needs ----------------------------------

    def forward(self, plan: StepPlan, aux: jax.Array) -> None:
        """Keeps the step's inputs (a copy: the runner reuses the buffer once the step is
        recorded) and the target's hidden states for the head."""
        self._step = _Step(plan.packed.copy(), plan.dims, plan.rows.copy(), aux)

    # -- once the step's tokens are recorded ---------------------------------------------------

    def propose(
        self, programs: Programs, table: RequestTable, wanted: np.ndarray, max_model_len: int
    ) -> np.ndarray:
        """int32[len(wanted), k]: the drafts of the step's requests at batch indices `wanted`
        (each past its newest token; -1 past `max_model_len`). Runs the pass even for none,
        so that the head's cache keeps up with the target's."""
        step, self._step = self._step, None
        if step is None:
            return np.zeros((0, self.k), np.int32)
        inputs = StepPlan(step.rows, None, step.dims[:3], step.packed, step.dims).inputs()
        n = step.rows.size
        cu = inputs.cu_q_lens[: n + 1].copy()
        q_lens, total = np.diff(cu), int(cu[n])
        token_rows = np.repeat(step.rows, q_lens)
        after = inputs.positions[:total] + 1  # each token's successor, where it is known by now
        known = after < table.num_tokens[token_rows]
        successors = table.token_ids[token_rows, np.minimum(after, table.token_ids.shape[1] - 1)]
        inputs.token_ids[:total] = np.where(known, np.maximum(successors, 0), 0)
        m = wanted.size
        length = table.num_tokens[step.rows[wanted]].astype(np.int32)
        first_rows = cu[wanted] + np.clip(length - 2 - inputs.positions[cu[wanted]], 0, q_lens[wanted] - 1)
        sample_rows = np.zeros(self._feed_width, np.int32)
        sample_rows[:m] = first_rows
        first, hidden, self.kv_caches = programs.call(
            ("eagle3_pass", *step.dims),
            lambda: self._pass_spec(step.packed, step.dims, step.aux),
            self._state_leaves,
            self.kv_caches,
            step.packed,
            step.aux,
            sample_rows,
        )
        if m == 0:
            return np.zeros((0, self.k), np.int32)
        if self.k == 1:
            drafts = np.asarray(first)[:m, None]
        else:
            drafts = self._loop_drafts(
                programs, table, step.rows[wanted], length, first, hidden, max_model_len
            )
        beyond = (length[:, None] + np.arange(self.k)[None, :]) >= max_model_len
        return np.where(beyond, -1, drafts)

    def _loop_drafts(self, programs, table, rows, length, first, hidden, max_model_len) -> np.ndarray:
        m = rows.size
        r_pad = round_up(m, self.row_buckets)
        positions = np.zeros(r_pad, np.int32)
        positions[:m] = length - 1
        pages = np.zeros((r_pad, table.block_table.shape[2]), np.int32)
        pages[:m] = table.block_table[self.cache_group, rows]
        num_seqs = np.array([m], np.int32)
        drafts, self.kv_caches = programs.call(
            ("eagle3_loop", r_pad, self.k),
            lambda: self._loop_spec(r_pad, pages.shape[1], max_model_len, hidden.dtype),
            self._state_leaves,
            self.kv_caches,
            first,
            hidden,
            positions,
            pages,
            num_seqs,
        )
        return np.asarray(drafts)[:m]

    # -- programs ------------------------------------------------------------------------------

    def _pass_spec(self, packed, dims: tuple, aux) -> ProgramSpec:
        return ProgramSpec(
            key=("eagle3_pass", *dims),
            jitted=self._pass,
            args=(
                self._state_leaves,
                self.kv_caches,
                packed,
                jax.ShapeDtypeStruct(aux.shape, aux.dtype, sharding=self._shape.whole),
                jax.ShapeDtypeStruct((self._feed_width,), np.int32, sharding=self._shape.whole),
            ),
            static={"dims": dims},
            context=self._context,
        )

    def _loop_spec(self, r_pad: int, max_pages: int, max_model_len: int, dtype) -> ProgramSpec:
        whole, width = self._shape.whole, self._feed_width
        rows = jax.ShapeDtypeStruct((r_pad,), np.int32, sharding=whole)
        return ProgramSpec(
            key=("eagle3_loop", r_pad, self.k),
            jitted=self._loop,
            args=(
                self._state_leaves,
                self.kv_caches,
                jax.ShapeDtypeStruct((width,), np.int32, sharding=whole),
                jax.ShapeDtypeStruct((width, self.model_config.hidden_size), dtype, sharding=whole),
                rows,
                jax.ShapeDtypeStruct((r_pad, max_pages), np.int32, sharding=whole),
                jax.ShapeDtypeStruct((1,), np.int32, sharding=whole),
            ),
            static={"steps": self.k - 1, "page_size": self._page_size, "max_position": max_model_len - 1},
            context=self._context,
        )

    def warm_up_specs(
        self, shapes: list[tuple[int, int, int]], num_groups: int, max_pages: int, max_model_len: int, dtype
    ) -> list[ProgramSpec]:
        """The pass for every step shape and, with k > 1, the loop for every request bucket;
        `dtype`: the target's activations'."""
        width = self.input_width()
        specs = []
        for shape in shapes:
            packed, dims = pack_inputs(padding_inputs(*shape, num_groups))
            specs.append(self._pass_spec(packed, dims, jax.ShapeDtypeStruct((shape[0], width), dtype)))
        if self.k > 1:
            specs += [self._loop_spec(r_pad, max_pages, max_model_len, dtype) for r_pad in self.row_buckets]
        return specs
