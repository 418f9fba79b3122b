# SPDX-License-Identifier: Apache-2.0
"""Host-side request state in preallocated NumPy arrays, one row per live request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest

# The per-row counters, columns of one int32 array (`RequestTable.progress`) so that a step
# gathers all of its rows' counters at once; each is also an attribute (a column view).
PROGRESS_COLUMNS = (
    "num_tokens", "num_prompt_tokens", "num_computed", "pending_column", "pending_index", "occupant",
    "lora_id", "lora_slot",
)  # fmt: skip
(NUM_TOKENS, NUM_PROMPT_TOKENS, NUM_COMPUTED, PENDING_COLUMN, PENDING_INDEX, OCCUPANT, LORA_ID, LORA_SLOT) = (
    range(len(PROGRESS_COLUMNS))
)
# Up to this many rows, per-row scalar indexing is cheaper than NumPy's fancy indexing.
_FEW_ROWS = 2


# Made every step, so not frozen (a frozen dataclass's __init__ sets each field through
# `object.__setattr__`, several times the cost); read-only all the same.
@dataclasses.dataclass(slots=True)
class Appends:
    """Where a step's sampled tokens go: token `index[k]` (k when None) to `rows[k]`, `columns[k]`."""

    rows: np.ndarray
    columns: np.ndarray
    counts: np.ndarray  # columns + 1: the rows' token counts afterwards
    index: np.ndarray | None
    # Each row's occupant when planned (`RequestTable.occupant`): a token whose request has left
    # its row by the time it arrives is not written.
    occupants: np.ndarray
    departures: int  # `RequestTable.departures` when planned: unchanged, every request stayed


class RequestTable:
    """Token history, block table and progress of every request the runner holds.

    Rows are reused; the arrays grow (doubling) only if more requests are alive at once than
    the initial capacity (preempted requests keep their row until the engine finishes them).
    There is one block table per KV-cache group (`[G, rows, max_pages]`).
    """

    def __init__(self, capacity: int, max_model_len: int, max_pages: int, num_groups: int = 1):
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((capacity, max_model_len), np.int32)
        # [rows, PROGRESS_COLUMNS]: tokens known (prompt + outputs, reserved ones included), prompt
        # tokens, tokens computed; for the newest step whose tokens are still on the device ("in
        # flight"), the column each of its rows reserved (`reserve`; -1 for other rows) and the
        # row's index in that step's tokens; the count of requests the row has held; the
        # request's LoRA adapter (a `LoraSlots.handle`, 0: none) and its device slot this step.
        self.progress = np.zeros((capacity, len(PROGRESS_COLUMNS)), np.int32)
        self.progress[:, PENDING_COLUMN] = -1
        self.block_table = np.zeros((num_groups, capacity, max_pages), np.int32)
        self.num_pages = np.zeros((num_groups, capacity), np.int32)
        self.departures = 0  # requests removed so far
        self._pending_rows: np.ndarray | None = None  # the rows `mark_in_flight` marked
        self._newest_reserved: Appends | None = None
        self.row_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._column_views()

    def _column_views(self) -> None:
        for column, name in enumerate(PROGRESS_COLUMNS):
            setattr(self, name, self.progress[:, column])

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow(self) -> None:
        old = self.token_ids.shape[0]
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        added = np.zeros_like(self.progress)
        added[:, PENDING_COLUMN] = -1
        self.progress = np.concatenate([self.progress, added])
        self._column_views()
        for name in ("block_table", "num_pages"):  # [G, rows, ...]
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)], axis=1))
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def add(self, request: NewRequest) -> int:
        """Stores a new request; returns its row."""
        if request.req_id in self.row_of:
            self.remove(request.req_id)
        prompt = np.asarray(request.prompt_token_ids, np.int32)
        if prompt.size > self.max_model_len:
            raise ValueError(
                f"request {request.req_id}: prompt of {prompt.size} tokens exceeds max_model_len"
            )
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[request.req_id] = row
        self.pending_column[row] = -1
        self.occupant[row] += 1
        self.token_ids[row, : prompt.size] = prompt
        self.num_tokens[row] = self.num_prompt_tokens[row] = prompt.size
        self.num_computed[row] = request.num_computed_tokens
        self.lora_id[row] = self.lora_slot[row] = 0  # the runner's to set (`lora_slots.LoraSlots`)
        self.num_pages[:, row] = 0
        self._append_pages(row, request.block_ids)
        return row

    def update(self, request: CachedRequest) -> int:
        """Applies a continuing or resumed request's new blocks and progress; returns its row."""
        return int(self.update_many(CachedRequests.of([request]))[0])

    def update_many(self, cached: CachedRequests) -> np.ndarray:
        """Applies every continuing or resumed request's new blocks and progress; returns their rows.

        Per request: a resumed one's block table restarts, new pages are appended, the computed
        count is set and the token history is cut back to the outputs the engine kept.
        """
        n = len(cached.req_ids)
        if n <= _FEW_ROWS:
            return np.array([self._update_one(cached, i) for i in range(n)], np.intp)
        rows = np.fromiter(map(self.row_of.__getitem__, cached.req_ids), np.intp, n)
        if cached.resumed_req_ids:
            resumed = [i for i, r in enumerate(cached.req_ids) if r in cached.resumed_req_ids]
            self.num_pages[:, rows[resumed]] = 0
        for i, block_ids in enumerate(cached.new_block_ids):
            if block_ids is not None:
                self._append_pages(int(rows[i]), block_ids)
        self.num_computed[rows] = np.fromiter(cached.num_computed_tokens, np.int32, n)
        known = self.num_prompt_tokens[rows] + np.fromiter(cached.num_output_tokens, np.int32, n)
        self.num_tokens[rows] = np.minimum(self.num_tokens[rows], known)
        return rows

    def _update_one(self, cached: CachedRequests, i: int) -> int:
        """`update_many` for request `i` alone, with scalar indexing."""
        req_id = cached.req_ids[i]
        row = self.row_of[req_id]
        if req_id in cached.resumed_req_ids:
            self.num_pages[:, row] = 0
        if cached.new_block_ids[i] is not None:
            self._append_pages(row, cached.new_block_ids[i])
        self.num_computed[row] = cached.num_computed_tokens[i]
        known = self.num_prompt_tokens[row] + cached.num_output_tokens[i]
        if known < self.num_tokens[row]:
            self.num_tokens[row] = known
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free.append(row)
            self.departures += 1
        return row

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        if n < self.max_model_len:
            self.token_ids[row, n] = token
            self.num_tokens[row] = n + 1

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """`append_token` for distinct `rows`, one token each (rows already full are left alone)."""
        self.append(self.plan_appends(rows, np.ones(rows.size, bool)), tokens)

    def plan_appends(self, rows: np.ndarray, emits: np.ndarray) -> Appends:
        """Where one token for each of the distinct `rows` that `emits` will go (`append`), decided
        ahead: the table must not change in between. Rows already full are left out."""
        progress = self.progress[rows]
        return self.appends_of(rows, emits, progress[:, NUM_TOKENS], progress[:, OCCUPANT])

    def appends_of(
        self, rows: np.ndarray, emits: np.ndarray, columns: np.ndarray, occupants: np.ndarray
    ) -> Appends:
        """`plan_appends` from the rows' token counts and occupants, already gathered."""
        take = emits & (columns < self.max_model_len)
        if take.all():
            return Appends(rows, columns, columns + 1, None, occupants, self.departures)
        index = np.flatnonzero(take)
        columns = columns[index]
        return Appends(rows[index], columns, columns + 1, index, occupants[index], self.departures)

    def append(self, appends: Appends, tokens: np.ndarray) -> None:
        """Writes `tokens` (one per row planned, in the planned rows' order) where `appends` says:
        `reserve` and `fill` at once, for tokens already known."""
        self.reserve(appends)
        self.fill(appends, tokens)

    def reserve(self, appends: Appends) -> None:
        """Counts a dispatched step's tokens before they are known: their columns hold -1 until
        `fill`. Only the newest reserving step is remembered: the caller fills older ones before
        the next `reserve`. Its rows' `pending_column` and `pending_index` (where the next step
        takes the token on the device) are written only when a step is prepared while it is in
        flight (`mark_in_flight`): under synchronous scheduling it is filled first, and they stay -1."""
        self._unmark()
        self.token_ids[appends.rows, appends.columns] = -1
        self.num_tokens[appends.rows] = appends.counts
        self._newest_reserved = appends

    def mark_in_flight(self) -> bool:
        """Whether some row waits for a reserved token (`reserve`d, not yet `fill`ed); if so, its
        rows still held by the same requests get their `pending_column` and `pending_index`.
        Without, every `pending_column` is -1 and no step input takes a token on the device."""
        appends = self._newest_reserved
        if appends is None:
            return False
        if self._pending_rows is None:
            rows, columns = appends.rows, appends.columns
            index = np.arange(rows.size) if appends.index is None else appends.index
            if appends.departures != self.departures:  # a row reused since holds no reservation
                stayed = self.occupant[rows] == appends.occupants
                rows, columns, index = rows[stayed], columns[stayed], index[stayed]
            self.pending_column[rows] = columns
            self.pending_index[rows] = index
            self._pending_rows = rows
        return True

    def _unmark(self) -> None:
        """Resets the rows `mark_in_flight` marked (-1: no token in flight)."""
        if self._pending_rows is not None:
            self.pending_column[self._pending_rows] = -1
            self._pending_rows = None

    def fill(self, appends: Appends, tokens: np.ndarray) -> None:
        """Writes the tokens of a `reserve`d step (one per row planned, in the planned rows' order)
        into the rows still held by the same requests; when it is the newest reserving step, its
        rows are no longer pending (an older step's rows are the newer step's business)."""
        if appends.index is not None:
            tokens = tokens[appends.index]
        rows, columns = appends.rows, appends.columns
        if appends.departures != self.departures:  # a request left since: its row may be reused
            stayed = self.occupant[rows] == appends.occupants
            rows, columns, tokens = rows[stayed], columns[stayed], tokens[stayed]
        self.token_ids[rows, columns] = tokens
        if appends is self._newest_reserved:
            self._unmark()
            self._newest_reserved = None

    @property
    def tokens_in_flight(self) -> bool:
        """Whether some row waits for a reserved token (`reserve`d, not yet `fill`ed)."""
        return self._newest_reserved is not None

    def feed_index(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """For tokens at `positions` of `rows`: the index of the token in the newest in-flight
        step's output when that position is the one it reserved, else -1."""
        self.mark_in_flight()
        return feed_from(self.progress[rows], positions)

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def _append_pages(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != self.block_table.shape[0]:
            raise ValueError(
                f"got block ids for {len(block_ids)} KV-cache groups, expected {self.block_table.shape[0]}"
            )
        for group, ids in enumerate(block_ids):
            start = self.num_pages[group, row]
            end = start + len(ids)
            if end > self.block_table.shape[2]:
                raise ValueError(
                    f"request in row {row} needs {end} pages; the table holds {self.block_table.shape[2]}"
                )
            self.block_table[group, row, start:end] = ids
            self.num_pages[group, row] = end


def feed_from(progress: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`RequestTable.feed_index` from the rows' gathered counters (`RequestTable.progress[rows]`)."""
    return np.where(progress[:, PENDING_COLUMN] == positions, progress[:, PENDING_INDEX], -1)
