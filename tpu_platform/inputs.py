# SPDX-License-Identifier: Apache-2.0
"""Step input preparation: vectorised NumPy from the request table to padded device inputs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from tpu_platform.buckets import StepBuckets
from tpu_platform.request_table import (
    LORA_SLOT,
    NUM_COMPUTED,
    NUM_TOKENS,
    OCCUPANT,
    Appends,
    RequestTable,
    feed_from,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Padded inputs of one forward step (int32; T, R, P are bucket sizes)."""

    # [T] token ids and their positions; padding rows hold 0
    token_ids: np.ndarray
    positions: np.ndarray
    # [G, T] cache slot of each token in each KV-cache group's pages, -1 for padding
    slot_mapping: np.ndarray
    # [R] tokens cached per sequence after this step
    kv_lens: np.ndarray
    # [G, R, P] block table rows of each KV-cache group
    page_indices: np.ndarray
    # [R + 1] cumulative query lengths (padding sequences are empty)
    cu_q_lens: np.ndarray
    # [1] real sequence count
    num_seqs: np.ndarray
    # [R] index of each sequence's last token in the step
    logits_indices: np.ndarray
    # [T] where a token id is still on the device: its index in the previous step's sampled
    # tokens (which the forward takes instead of `token_ids`), else -1
    feed: np.ndarray
    # [T] each token's LoRA adapter slot (`models.lora`); 0 (no adapter) for padding
    lora_slots: np.ndarray


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class StepPlan:
    """Host-side facts about a prepared step."""

    rows: np.ndarray  # [num_seqs] request-table rows, batch order
    emits_token: np.ndarray  # [num_seqs] bool: the step reaches the end of the known tokens
    shape: tuple[int, int, int]  # padded (T, R, P)
    packed: np.ndarray | None = None  # every input in one int32 buffer (`pack_inputs`)
    dims: tuple[int, int, int, int] | None = None  # padded (T, R, P, G) of `packed`
    all_emit: bool = True  # every sequence emits a token (`emits_token.all()`)
    appends: Appends | None = None  # where the sampled tokens go in the request table
    fed: bool = False  # some token id is still on the device (`StepInputs.feed`)

    def inputs(self) -> StepInputs:
        """The step's inputs, as views of `packed`."""
        return _views(self.packed, self.dims)


class StepBuffers:
    """The packed input buffers of the steps a runner prepares.

    XLA:CPU reads a 64-byte-aligned buffer in place, so a step's buffer is written again only
    once the step that read it has finished: the runner hands it back then (`give_back`). A
    decode step (one token per sequence) starts from a template of its dims and sequence count,
    holding what depends on those alone (query offsets, logits indices, padding).
    """

    def __init__(self) -> None:
        self._templates: dict[tuple, np.ndarray] = {}
        self._free: dict[int, list[np.ndarray]] = {}

    def take(self, size: int) -> np.ndarray:
        free = self._free.get(size)
        return free.pop() if free else _aligned_empty(size)

    def give_back(self, packed: np.ndarray) -> None:
        """Makes `packed` available again: the step that read it has finished."""
        self._free.setdefault(packed.size, []).append(packed)

    def decode_template(self, dims: tuple[int, int, int, int], num_seqs: int) -> np.ndarray | None:
        return self._templates.get((dims, num_seqs))

    def keep_decode_template(
        self, dims: tuple[int, int, int, int], num_seqs: int, packed: np.ndarray
    ) -> None:
        self._templates[dims, num_seqs] = packed.copy()


def prepare_step(
    table: RequestTable,
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    buckets: StepBuckets,
    page_size: int,
    buffers: StepBuffers | None = None,
    num_drafts: np.ndarray | None = None,
    min_tokens: int = 0,
) -> StepPlan:
    """Builds the padded inputs for sequences `rows` scheduled for `num_scheduled` tokens each,
    in one packed buffer (`plan.packed`, laid out as `pack_inputs` does; `plan.inputs()` views it).

    `num_drafts[i]` of sequence i's scheduled tokens are drafts (speculative decoding): its
    logits row is then its last token before them, what it samples without speculation.
    `min_tokens`: pad to the bucket of at least that many tokens (data-parallel replicas in one
    program all take the bucket of the largest step, `tpu_platform.replica_step`).
    """
    num_seqs = rows.size
    total = sum(num_scheduled.tolist())  # (NumPy's reduction is far slower on a cold cache)
    t_pad, r_pad, p_pad = buckets.shape_for(max(total, min_tokens), num_seqs)
    dims = (t_pad, r_pad, p_pad, table.block_table.shape[0])
    size = _layout(dims)[0]
    packed = buffers.take(size) if buffers is not None else _aligned_empty(size)
    if buffers is not None and total == num_seqs:
        template = buffers.decode_template(dims, num_seqs)
        if template is not None:
            packed[:] = template
            return _decode_from(packed, table, rows, dims, page_size)
        plan = _prepare(packed, table, rows, num_scheduled, total, dims, page_size)
        buffers.keep_decode_template(dims, num_seqs, plan.packed)
        return plan
    return _prepare(packed, table, rows, num_scheduled, total, dims, page_size, num_drafts)


def _decode_from(
    packed: np.ndarray, table: RequestTable, rows: np.ndarray, dims: tuple[int, int, int, int], page_size: int
) -> StepPlan:
    """A decode step's inputs in `packed`, a template of its dims and sequence count: only the
    per-sequence fields are written, from one gather of the rows' counters."""
    t, r, p, g = dims
    offsets = _offsets(dims)
    n = rows.size
    fed = table.mark_in_flight()  # else every row's feed is -1: no comparison to make
    progress = table.progress[rows]
    start = progress[:, NUM_COMPUTED]
    packed[offsets["token_ids"] : offsets["token_ids"] + n] = table.token_ids[rows, start]
    if fed:
        feed = feed_from(progress, start)
        packed[offsets["feed"] : offsets["feed"] + n] = feed
        fed = bool(feed.max() >= 0)
    else:
        packed[offsets["feed"] : offsets["feed"] + n] = -1
    packed[offsets["positions"] : offsets["positions"] + n] = start
    packed[offsets["lora_slots"] : offsets["lora_slots"] + n] = progress[:, LORA_SLOT]
    slots = _slots(table.block_table, rows, start, page_size)
    packed[offsets["slot_mapping"] : offsets["slot_mapping"] + g * t].reshape(g, t)[:, :n] = slots
    kv_lens = packed[offsets["kv_lens"] : offsets["kv_lens"] + n]
    np.add(start, 1, out=kv_lens)
    page_indices = packed[offsets["page_indices"] : offsets["page_indices"] + g * r * p].reshape(g, r, p)
    if p == table.block_table.shape[2]:  # whole block table rows: one gather, in place
        np.take(table.block_table, rows, axis=1, out=page_indices[:, :n], mode="clip")
    else:
        width = min(p, table.block_table.shape[2])
        page_indices[:, :n, :width] = table.block_table[:, rows, :width]
    columns = progress[:, NUM_TOKENS]
    emits = kv_lens >= columns
    appends = table.appends_of(rows, emits, columns, progress[:, OCCUPANT])
    all_emit = appends.index is None or bool(emits.all())  # no row left out: every row emits
    return StepPlan(rows, emits, dims[:3], packed, dims, all_emit, appends, fed)


def _prepare(
    packed: np.ndarray,
    table: RequestTable,
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    total: int,
    dims: tuple[int, int, int, int],
    page_size: int,
    num_drafts: np.ndarray | None = None,
) -> StepPlan:
    num_seqs = rows.size
    start = table.num_computed[rows]
    inputs = _views(packed, dims)
    cu_q = inputs.cu_q_lens
    cu_q[0] = 0
    if total == num_seqs:  # one token each (decode): no ragged expansion
        cu_q[1 : num_seqs + 1] = np.arange(1, num_seqs + 1)
        positions, token_rows = start, rows
    else:
        np.cumsum(num_scheduled, out=cu_q[1 : num_seqs + 1])
        positions = np.arange(total, dtype=np.int32) - np.repeat(cu_q[:num_seqs] - start, num_scheduled)
        token_rows = np.repeat(rows, num_scheduled)
    cu_q[num_seqs + 1 :] = total
    kv_lens = start + num_scheduled
    _fill(inputs.token_ids, table.token_ids[token_rows, positions], 0)
    _fill(inputs.feed, table.feed_index(token_rows, positions), -1)
    _fill(inputs.positions, positions, 0)
    _fill(inputs.lora_slots, table.lora_slot[token_rows], 0)
    _fill(inputs.slot_mapping, _slots(table.block_table, token_rows, positions, page_size), -1)
    _fill(inputs.kv_lens, kv_lens, 0)
    _page_rows(inputs.page_indices, table.block_table, rows)
    inputs.num_seqs[0] = num_seqs
    last = cu_q[1 : num_seqs + 1] - 1
    _fill(inputs.logits_indices, last if num_drafts is None else last - num_drafts, 0)
    emits = kv_lens >= table.num_tokens[rows]
    appends = table.plan_appends(rows, emits)
    fed = bool(inputs.feed.max() >= 0)
    return StepPlan(rows, emits, dims[:3], packed, dims, bool(emits.all()), appends, fed)


_FIELDS = (
    "token_ids", "positions", "slot_mapping", "kv_lens",
    "page_indices", "cu_q_lens", "num_seqs", "logits_indices", "feed", "lora_slots",
)  # fmt: skip


def input_shapes(dims: tuple[int, int, int, int]) -> dict[str, tuple[int, ...]]:
    """The shape of every field for padded dims `(T, R, P, G)`."""
    t, r, p, g = dims
    return {
        "token_ids": (t,), "positions": (t,), "slot_mapping": (g, t), "kv_lens": (r,),
        "page_indices": (g, r, p), "cu_q_lens": (r + 1,), "num_seqs": (1,), "logits_indices": (r,),
        "feed": (t,), "lora_slots": (t,),
    }  # fmt: skip


def pack_inputs(inputs: StepInputs) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """One int32 buffer holding every field (one host-to-device transfer), and its dims."""
    g, r, p = inputs.page_indices.shape
    dims = (inputs.token_ids.shape[0], r, p, g)
    return np.concatenate([getattr(inputs, f).reshape(-1) for f in _FIELDS]), dims


@functools.cache
def _offsets(dims: tuple[int, int, int, int]) -> dict[str, int]:
    """Each field's offset in the packed buffer."""
    return {name: offset for name, (offset, _, _) in zip(_FIELDS, _layout(dims)[1], strict=True)}


@functools.cache
def _layout(dims: tuple[int, int, int, int]) -> tuple[int, tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """The packed buffer's size and each field's (offset, size, shape), in `_FIELDS` order."""
    fields, offset = [], 0
    for shape in input_shapes(dims).values():
        size = int(np.prod(shape))
        fields.append((offset, size, shape))
        offset += size
    return offset, tuple(fields)


def _views(packed: np.ndarray, dims: tuple[int, int, int, int]) -> StepInputs:
    """`StepInputs` whose fields are views of `packed` (the layout of `pack_inputs`)."""
    return StepInputs(*(packed[o : o + n].reshape(shape) for o, n, shape in _layout(dims)[1]))


def unpack_inputs(packed: jax.Array, dims: tuple[int, int, int, int]) -> StepInputs:
    """The inverse of `pack_inputs` (traceable: static slices of the device buffer)."""
    fields, offset = {}, 0
    for name, shape in input_shapes(dims).items():
        size = int(np.prod(shape))
        fields[name] = packed[offset : offset + size].reshape(shape)
        offset += size
    return StepInputs(**fields)


def padding_inputs(t_pad: int, r_pad: int, p_pad: int, num_groups: int = 1) -> StepInputs:
    """Inputs of shape (T, R, P) that hold no sequence: they compute nothing and write nothing."""
    zeros = np.zeros(t_pad, np.int32)
    return StepInputs(
        token_ids=zeros,
        positions=zeros,
        slot_mapping=np.full((num_groups, t_pad), -1, np.int32),
        kv_lens=np.zeros(r_pad, np.int32),
        page_indices=np.zeros((num_groups, r_pad, p_pad), np.int32),
        cu_q_lens=np.zeros(r_pad + 1, np.int32),
        num_seqs=np.zeros(1, np.int32),
        logits_indices=np.zeros(r_pad, np.int32),
        feed=np.full(t_pad, -1, np.int32),
        lora_slots=zeros,
    )


def exercise_inputs(
    t_pad: int, r_pad: int, p_pad: int, num_groups: int, num_pages: int, *, page_size: int, num_seqs: int
) -> StepInputs:
    """Inputs of shape (T, R, P) that drive every loop of the program: `num_seqs` sequences share
    the first T - 1 tokens (the last one is padding), write them to the first pages and attend to
    them. For warm-up only, before any request: the pages written hold nothing yet, and every
    page is written by its sequence before it is read."""
    tokens = t_pad - 1 if t_pad > 1 else 1
    num_seqs = max(1, min(num_seqs, r_pad, tokens))
    q_lens = np.full(num_seqs, tokens // num_seqs, np.int32)
    q_lens[-1] += tokens - q_lens.sum()
    cu_q_lens = np.full(r_pad + 1, tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1 : num_seqs + 1] = np.cumsum(q_lens)
    starts = np.repeat(cu_q_lens[:num_seqs], q_lens)
    positions = np.zeros(t_pad, np.int32)
    positions[:tokens] = np.arange(tokens) - starts
    slots = np.full(t_pad, -1, np.int32)
    slots[:tokens] = np.arange(tokens) % (num_pages * page_size)
    kv_lens = np.zeros(r_pad, np.int32)
    kv_lens[:num_seqs] = q_lens
    return StepInputs(
        token_ids=np.arange(t_pad, dtype=np.int32) % 1000,
        positions=positions,
        slot_mapping=np.broadcast_to(slots, (num_groups, t_pad)).copy(),
        kv_lens=kv_lens,
        page_indices=np.broadcast_to(
            np.arange(p_pad, dtype=np.int32) % num_pages, (num_groups, r_pad, p_pad)
        ).copy(),
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=np.pad(cu_q_lens[1 : num_seqs + 1] - 1, (0, r_pad - num_seqs)).astype(np.int32),
        feed=np.full(t_pad, -1, np.int32),
        lora_slots=np.zeros(t_pad, np.int32),
    )


def _aligned_empty(size: int) -> np.ndarray:
    """An int32 buffer at a 64-byte boundary: XLA:CPU then takes it as a device buffer without a
    copy (the step never writes it once dispatched)."""
    raw = np.empty(size + 16, np.int32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start : start + size]


def _slots(block_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """`[G, n]` cache slot of each token at `positions` of table rows `rows`, per KV-cache group."""
    page, offset = np.divmod(positions, page_size)
    return block_table[:, rows, page] * page_size + offset


def _fill(out: np.ndarray, values: np.ndarray, fill: int) -> None:
    """Writes `values` at the start of `out`'s last axis and `fill` after them."""
    n = values.shape[-1]
    out[..., :n] = values
    out[..., n:] = fill


def _page_rows(out: np.ndarray, block_table: np.ndarray, rows: np.ndarray) -> None:
    """`out[g, i]` = block table row `rows[i]` of group g, cut or zero-padded to `out`'s width."""
    width = min(out.shape[2], block_table.shape[2])
    out[:, : rows.size, :width] = block_table[:, rows, :width]
    out[:, rows.size :] = 0
    out[:, : rows.size, width:] = 0
