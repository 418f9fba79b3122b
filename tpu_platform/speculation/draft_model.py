# SPDX-License-Identifier: Apache-2.0
"""The draft-model proposer: a smaller model of the target's vocabulary drafts k tokens a step.

Its KV cache: one cache per draft layer, with as many pages as the target's and indexed by the
target's block tables (the engine allocates pages for the target's layers only; the worker hands
the engine the memory budget less the draft's share, so both fit: `kv_share`). vLLM reserves
`num_speculative_tokens` lookahead slots past each request's scheduled tokens for a draft model,
which is where the draft writes its proposals' K/V.

Per step, two programs:
- the draft's forward on the step's own packed inputs (the same tokens, positions and slots as
  the target's), right after the target's forward: its cache then holds every token the target's
  does, the drafts the verification kept included (rejected ones are overwritten later, as in
  the target's cache);
- once the step's tokens are recorded, the draft loop: k single-token decode steps over the
  requests to draft, in one program (`jax.lax.scan`), the first from each request's newest token
  at its position, each next from the previous step's argmax. Its outputs are the drafts.

Both are built at warm-up: the forward for every token bucket, the loop for every request bucket.

Under tensor parallelism the draft is split as the target is, on the target's mesh: its weights
by the same rules table (`models.sharding`: whole heads and MLP columns a device, the vocabulary
split), its caches on their KV heads (`drafter_kv_heads`), its forward and loop one program each
over the mesh, its attention per device (`AttentionMetadata.mesh`).
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
from models.sharding import kv_heads_on_mesh, place_state
from tpu_platform.buckets import round_up, token_buckets
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array, page_bytes_per_device
from tpu_platform.mesh import check_model_fits_mesh, replicated
from tpu_platform.programs import Programs, ProgramSpec
from tpu_platform.request_table import RequestTable
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.sampling.ops import first_argmax
from tpu_platform.step_program import KVLayout, StepProgram, build_step_program
from tpu_platform.weights.prepared import ShardingFor
from tpu_platform.weights.source import load_served_weights


def check_target_groups(method: str, target_groups: tuple[int, int], num_groups: int) -> None:
    """A drafter's cache shares the target's pages: the engine's KV-cache groups must be the ones
    `target_cache_group` counted (`target_groups`), one, or a hybrid's as `KVLayout.for_model`."""
    expected = target_groups[1]
    if expected == 1 and num_groups != 1:
        raise ValueError(
            f"speculative method {method!r} needs a target whose layers share one KV-cache group (this "
            f"one has {num_groups}: sliding-window or chunked layers beside full ones); use method 'ngram'"
        )
    if num_groups != expected:
        raise ValueError(
            f"speculative method {method!r} expects {expected} KV-cache groups for its hybrid "
            f"target, the engine made {num_groups}; use method 'ngram'"
        )


def target_cache_group(target: ModelConfig) -> tuple[int, int]:
    """(the target's group whose tables a drafter's cache follows, its group count): a hybrid's
    full-attention group (`KVLayout.for_model`; its state groups hold states); else 0 of 1."""
    if not target.state_layers:
        return 0, 1
    layout = KVLayout.for_model(target)
    states = set(target.state_layers)
    attention = next(i for i in range(target.num_layers) if i not in states)
    return layout.layer_groups[attention], layout.num_groups


def drafter_kv_heads(mc: ModelConfig, tp_size: int) -> int:
    """KV heads of a drafter's whole cache on a mesh of `tp_size` (the target's rule,
    `kv_heads_on_mesh`: repeated up to `tp_size` when fewer); 1 for a latent cache, whole on
    every device as the target's is."""
    if mc.latent_cache_width:
        return 1
    return kv_heads_on_mesh(mc.num_heads, mc.num_kv_heads, tp_size)


def drafter_page_bytes(
    mc: ModelConfig, num_layers: int, page_size: int, kv_dtype, backend: str, tp_size: int
) -> int:
    """Bytes one page takes on one device in a drafter's `num_layers` caches (its share of the
    KV heads on a mesh of `tp_size`)."""
    heads = drafter_kv_heads(mc, tp_size)
    per_device = heads if mc.latent_cache_width else heads // tp_size
    return page_bytes_per_device(mc, page_size, per_device, kv_dtype, backend) * num_layers


def place_drafter(state: nnx.State, mesh: Mesh | None, device: jax.Device) -> nnx.State:
    """A drafter's weights on `device`, or split on the target's `mesh` by the rules table."""
    return jax.device_put(state, device) if mesh is None else place_state(state, mesh)


def draft_caches(
    mc: ModelConfig,
    num_caches: int,
    num_pages: int,
    page_size: int,
    kv_dtype: jnp.dtype,
    backend: str,
    device: jax.Device,
    mesh: Mesh | None = None,
) -> list[jax.Array]:
    """A drafter's `num_caches` zeroed cache arrays of the target's `num_pages` pages, on `device`
    or split on `mesh`'s KV heads as the target's are (a latent cache's one row a token where `mc`
    has one, whole on every device)."""
    heads = drafter_kv_heads(mc, 1 if mesh is None else mesh.size)
    caches = allocate_stacked_caches(
        num_caches, num_pages, page_size, heads, mc.head_dim, kv_dtype, backend, mesh,
        latent_width=mc.latent_cache_width,
    )  # fmt: skip
    return jax.device_put(caches, device) if mesh is None else caches


@dataclasses.dataclass(frozen=True, slots=True)
class DraftCacheShape:
    """What the draft loop needs of the cache: the static metadata of the draft's step program.
    `group`: the target's KV-cache group whose block tables and slots the drafter's cache uses
    (a hybrid target's full-attention group; else its only one)."""

    backend: str
    kv_dtype: str
    num_pages: int
    caches_per_array: int
    mesh: Mesh | None = None  # the target's tensor-parallel mesh (None: one device)
    group: int = 0

    @property
    def whole(self) -> jax.sharding.Sharding | None:
        """Where a program's host inputs go: whole on every device of the mesh (None: one device)."""
        return None if self.mesh is None else replicated(self.mesh)


def draft_loop(
    graphdef: nnx.GraphDef,
    state_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],
    kv_caches: list[jax.Array],
    tokens: jax.Array,
    positions: jax.Array,
    page_indices: jax.Array,
    num_seqs: jax.Array,
    *,
    k: int,
    page_size: int,
    max_position: int,
    shape: DraftCacheShape,
) -> tuple[jax.Array, list[jax.Array]]:
    """k greedy decode steps of the draft model over R requests, one token each per step.

    Args:
      tokens: int32[R] each request's newest token (its first step's input);
      positions: int32[R] that token's position;
      page_indices: int32[R, P] each request's block table;
      num_seqs: int32[1] real requests (the first rows; the rest are padding).

    Returns:
      drafts int32[R, k] and the draft's caches (each step wrote its input token's K/V).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
    rows = tokens.shape[0]
    real = jnp.arange(rows) < num_seqs[0]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1, dtype=jnp.int32), num_seqs[0])

    def step(carry, _):
        caches, token, position = carry
        position = jnp.minimum(position, max_position)  # past max_model_len: dropped on the host
        page = jnp.take_along_axis(page_indices, (position // page_size)[:, None], axis=1)[:, 0]
        slot = jnp.where(real, page * page_size + position % page_size, -1)
        md = AttentionMetadata(
            slot_mapping=slot[None],
            kv_lens=jnp.where(real, position + 1, 0),
            page_indices=page_indices[None],
            cu_q_lens=cu_q_lens,
            num_seqs=num_seqs,
            backend=shape.backend,
            kv_dtype=shape.kv_dtype,
            cache_pages=shape.num_pages,
            caches_per_array=shape.caches_per_array,
            mesh=shape.mesh,
        )
        hidden, caches = model(token, position, caches, md)
        proposed = first_argmax(model.compute_logits(hidden).astype(jnp.float32))
        return (caches, proposed, position + 1), proposed

    (kv_caches, _, _), drafts = jax.lax.scan(step, (kv_caches, tokens, positions), length=k)
    return drafts.T.astype(jnp.int32), kv_caches


def make_draft_loop(graphdef: nnx.GraphDef, state_def: jax.tree_util.PyTreeDef, shape: DraftCacheShape):
    """`draft_loop` of the draft model (`graphdef`, `state_def`) over caches of `shape`, jitted
    with the caches donated (`k`, `page_size` and `max_position` static)."""
    return jax.jit(
        functools.partial(draft_loop, graphdef, state_def, shape=shape),
        donate_argnums=(1,),
        static_argnames=("k", "page_size", "max_position"),
    )


class DraftModel:
    """The draft's weights, KV cache and programs (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        k: int,
        mesh: Mesh | None = None,
        target_groups: tuple[int, int] = (0, 1),
    ):
        self.model_config, self.k, self.mesh = model_config, k, mesh
        self._target_groups = target_groups  # `target_cache_group`
        self.cache_group = target_groups[0]
        self._graphdef = graphdef
        self._state_leaves, self._state_def = jax.tree.flatten(state)
        self.kv_caches: list[jax.Array] = []
        self.step_program: StepProgram | None = None

    @classmethod
    def load(
        cls,
        path: str,
        config: RunnerConfig,
        target: ModelConfig,
        dtype: jnp.dtype,
        dense_isa: str | None,
        shardings: ShardingFor,
        device: jax.Device,
        mesh: Mesh | None = None,
    ) -> DraftModel:
        """The draft of checkpoint `path`, loaded as the target is (`config`'s dtype, load format
        and cache) on `device` or split on the target's `mesh`; a draft of another vocabulary
        size, or whose heads or MLP the mesh does not split, is refused by name."""
        draft_config = dataclasses.replace(
            config, model_path=path, quantization=None, lora=None, pooling=None, speculation=None
        )
        model_config, model, _ = load_served_weights(draft_config, dtype, dense_isa, shardings)
        if model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {path} has vocab_size={model_config.vocab_size}, the target "
                f"{target.vocab_size}; speculative method 'draft_model' needs a draft of the "
                "target's vocabulary (same tokenizer)"
            )
        if model_config.latent_cache_width or any(
            model_config.kv_source(i) != i for i in range(model_config.num_layers)
        ):
            raise ValueError(
                f"the draft model {path} ({model_config.architecture}) has a latent or shared KV "
                "cache; use a draft whose every layer has a KV cache of its own (e.g. a small Llama)"
            )
        if mesh is not None:
            check_model_fits_mesh(model_config, mesh.size)
        attach_rope_tables(model, config.max_model_len)
        graphdef, state = nnx.split(model)
        k = config.speculation.num_tokens
        groups = target_cache_group(target)
        return cls(model_config, graphdef, place_drafter(state, mesh, device), k, mesh, groups)

    def page_bytes(self, page_size: int, kv_dtype: jnp.dtype, backend: str) -> int:
        """Bytes one page takes in the draft's caches (all its layers)."""
        mc, tp_size = self.model_config, 1 if self.mesh is None else self.mesh.size
        return drafter_page_bytes(mc, mc.num_layers, page_size, kv_dtype, backend, tp_size)

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
        """Allocates the draft's caches (`num_pages` pages, the target's) and builds its forward,
        its layers in the target's group `cache_group` of the `num_groups` the engine made."""
        check_target_groups("draft_model", self._target_groups, num_groups)
        mc = self.model_config
        groups = [range(mc.num_layers) if g == self.cache_group else () for g in range(num_groups)]
        layout = KVLayout.from_groups(groups, mc.num_layers)
        self.kv_caches = draft_caches(
            mc, layout.num_caches, num_pages, page_size, kv_dtype, backend, device, self.mesh
        )
        self.step_program = build_step_program(
            mc, self._graphdef, self._state_def, self._state_leaves, self.kv_caches, backend=backend,
            layout=layout, kv_dtype=kv_dtype.name, num_pages=num_pages, page_size=page_size,
            feed_width=feed_width, device=device, mesh=self.mesh,
        )  # fmt: skip
        per_array = caches_per_array(layout.num_caches, num_pages, page_size)
        # The loop reads one group's tables (`propose` hands it `cache_group`'s): its own group 0.
        shape = DraftCacheShape(backend, kv_dtype.name, num_pages, per_array, self.mesh)
        self._whole = shape.whole
        self._loop = make_draft_loop(self._graphdef, self._state_def, shape)
        self._page_size = page_size
        self.row_buckets = token_buckets(feed_width, feed_width)

    # -- the step's forward ---------------------------------------------------------------------

    def forward(self, programs: Programs, packed: np.ndarray, dims: tuple, fed: jax.Array) -> None:
        """Dispatches the draft's forward on a step's packed inputs (a copy: the runner reuses
        the buffer once the target's step is recorded, which may come before this one ends)."""
        packed = packed.copy()
        *_, self.kv_caches = programs.call(
            ("draft_forward", *dims),
            lambda: self._forward_spec(packed, dims, fed),
            self._state_leaves,
            self.kv_caches,
            packed,
            fed,
        )

    def _forward_spec(self, packed, dims: tuple, fed) -> ProgramSpec:
        return ProgramSpec(
            key=("draft_forward", *dims),
            jitted=self.step_program.forward,
            args=(self._state_leaves, self.kv_caches, packed, fed),
            static={"dims": dims},
            context=self.step_program.context,
        )

    # -- the draft loop -------------------------------------------------------------------------

    def propose(
        self, programs: Programs, table: RequestTable, rows: np.ndarray, max_model_len: int
    ) -> np.ndarray:
        """int32[len(rows), k]: the drafts of the requests in table `rows` (each past its newest
        token); a request's drafts past `max_model_len` are -1."""
        n = rows.size
        r_pad = round_up(n, self.row_buckets)
        length = table.num_tokens[rows].astype(np.int32)
        tokens, positions = np.zeros(r_pad, np.int32), np.zeros(r_pad, np.int32)
        tokens[:n] = table.token_ids[rows, length - 1]
        positions[:n] = length - 1
        pages = np.zeros((r_pad, table.block_table.shape[2]), np.int32)
        pages[:n] = table.block_table[self.cache_group, rows]
        num_seqs = np.array([n], np.int32)
        drafts, self.kv_caches = programs.call(
            ("draft_loop", r_pad, self.k),
            lambda: self._loop_spec(r_pad, pages.shape[1], max_model_len),
            self._state_leaves,
            self.kv_caches,
            tokens,
            positions,
            pages,
            num_seqs,
        )
        drafts = np.asarray(drafts)[:n]
        beyond = (length[:, None] + np.arange(self.k)[None, :]) >= max_model_len
        return np.where(beyond, -1, drafts)

    def _loop_static(self, max_model_len: int) -> dict:
        return {"k": self.k, "page_size": self._page_size, "max_position": max_model_len - 1}

    def _loop_spec(self, r_pad: int, max_pages: int, max_model_len: int) -> ProgramSpec:
        whole = self._whole
        rows = jax.ShapeDtypeStruct((r_pad,), np.int32, sharding=whole)
        return ProgramSpec(
            key=("draft_loop", r_pad, self.k),
            jitted=self._loop,
            args=(
                self._state_leaves,
                self.kv_caches,
                rows,
                rows,
                jax.ShapeDtypeStruct((r_pad, max_pages), np.int32, sharding=whole),
                jax.ShapeDtypeStruct((1,), np.int32, sharding=whole),
            ),
            static=self._loop_static(max_model_len),
            context=self.step_program.context,
        )

    def warm_up_specs(
        self, shapes: list[tuple[int, int, int]], num_groups: int, max_pages: int, max_model_len: int, fed
    ) -> list[ProgramSpec]:
        """The draft's forward for every step shape and its loop for every request bucket."""
        specs = []
        for shape in shapes:
            packed, dims = pack_inputs(padding_inputs(*shape, num_groups))
            specs.append(self._forward_spec(packed, dims, fed))
        specs += [self._loop_spec(r_pad, max_pages, max_model_len) for r_pad in self.row_buckets]
        return specs


def kv_share(target_page_bytes: int, draft_page_bytes: int, available: int) -> int:
    """The part of `available` KV bytes the engine may give the target's pages when each page
    also takes `draft_page_bytes` in the draft's caches (one draft page per target page)."""
    return available * target_page_bytes // (target_page_bytes + draft_page_bytes)
