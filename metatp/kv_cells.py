"""The unified KV cache's bookkeeping: which sequence owns each cell (llama.cpp's llama_kv_cells).

The cache has `n_cells` rows; every row (cell) is free or owned by one sequence, and an owned
cell holds one position of its owner once written. A sequence reserves its cells when it is
admitted (prompt + the tokens it may generate), so a running sequence never runs out of room
and nothing has to be preempted; it returns them when it ends, fails or is cancelled.

A reservation is one contiguous range of cells (first fit): position p of a sequence lives in
`cells[p]` = start + p. Attention then meets a sequence's rows as one unbroken window in the
same order wherever it lies, so a kernel that reduces over each row's visible window from its
first cell computes the same bits alone or next to other sequences. A sequence that grows past
its reservation (the engine's `forward` without a reservation) extends its range when the next
cells are free, else takes any free cells (still correct, no longer one window).

Ranges start on a page boundary where one is free (`page` cells, as vLLM's KV blocks): a
kernel that tiles the KV length in chunks at absolute cell positions (the numpy backend's
attention does, in chunks of 128) then meets every sequence's window at the same phase as when
it runs alone from cell 0.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from metatp.ir.errors import ConfigError, ContextOverflowError

__all__ = ["KVCells", "SeqCells"]


class SeqCells:
    """One sequence's claim on the cache: its cells in position order and how many are written."""

    __slots__ = ("id", "cells", "n_past", "freed")

    def __init__(self, seq_id: int, cells: np.ndarray) -> None:
        self.id = seq_id
        self.cells = cells                  # int32, ascending; position p -> cells[p]
        self.n_past = 0                     # positions 0..n_past-1 hold committed K/V
        self.freed = False

    @property
    def capacity(self) -> int:
        return int(self.cells.size)

    def __repr__(self) -> str:
        return f"SeqCells(id={self.id}, n_past={self.n_past}, capacity={self.capacity})"


class KVCells:
    """Ownership of the `n_cells` KV rows; thread-safe (reservations come from any thread)."""

    TABLE_BYTES = 8      # per cell: the int64 owner table
    SCAN_BYTES = 24      # per cell, at most, while a search runs (free-cell indices, joined and sorted)

    @classmethod
    def planned_bytes(cls, n_cells: int) -> int:
        """Host bytes this bookkeeping may hold for `n_cells` cells (the memory plan counts them)."""
        return n_cells * (cls.TABLE_BYTES + cls.SCAN_BYTES)

    def __init__(self, n_cells: int, page: int = 1) -> None:
        if n_cells <= 0:
            raise ConfigError(f"a KV cache needs at least one cell, got {n_cells}")
        self.n_cells = n_cells
        self.page = max(1, page)
        self._owner: np.ndarray | None = None                   # made on first use (see `owner`)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._made = threading.Lock()
        self.live: dict[int, SeqCells] = {}                     # id -> sequence, while it owns cells

    @property
    def owner(self) -> np.ndarray:
        """Sequence id per cell, -1 = free. Allocated on first use, not in the constructor: an
        engine is built (and its memory planned, `metatp.passes.memory`) before the budget
        check, which must be able to refuse an impossible n_ctx before this table exists."""
        if self._owner is None:
            with self._made:
                if self._owner is None:
                    self._owner = np.full(self.n_cells, -1, dtype=np.int64)
        return self._owner

    @property
    def n_used(self) -> int:
        """Cells owned by some sequence (reserved or written)."""
        return 0 if self._owner is None else int(np.count_nonzero(self._owner >= 0))

    @property
    def n_free(self) -> int:
        return self.n_cells - self.n_used

    def reserve(self, n: int) -> SeqCells:
        """A new sequence owning the `n` lowest free cells; ContextOverflowError if fewer are free."""
        with self._lock:
            seq_id = next(self._ids)
            return self._new(seq_id, n)

    def try_reserve(self, n: int) -> SeqCells | None:
        """Like `reserve`, but None when the cells are not free now (the caller waits)."""
        with self._lock:
            if self._first_fit(n) is None:
                return None
            seq_id = next(self._ids)
            return self._new(seq_id, n)

    def adopt(self, seq_id: int, cells: np.ndarray) -> SeqCells:
        """A sequence with a given id owning exactly `cells`: a follower rank of a served model
        mirrors rank 0's reservation (`metatp.lockstep.follow`) instead of choosing its own, so
        that every rank's cache has the same owner in every cell."""
        cells = np.asarray(cells, dtype=np.int32)
        with self._lock:
            if seq_id in self.live:
                raise ConfigError(f"sequence {seq_id} already owns cells")
            if cells.size and (int(cells.min()) < 0 or int(cells.max()) >= self.n_cells
                               or (self.owner[cells] >= 0).any() or np.unique(cells).size != cells.size):
                raise ConfigError(f"sequence {seq_id} cannot take its {cells.size} cells: some are out of range, "
                                  "repeated or owned by another sequence")
            self.owner[cells] = seq_id
            seq = SeqCells(seq_id, cells.copy())
            self.live[seq_id] = seq
            return seq

    def grow(self, seq: SeqCells, n: int) -> None:
        """Give `seq` room for `n` positions in all (a sequence that did not reserve up front).
        New cells come after its last one where possible, so its rows stay in ascending order."""
        with self._lock:
            extra = n - seq.capacity
            if extra <= 0:
                return
            if seq.freed:
                raise ConfigError(f"sequence {seq.id} has ended; its cells are gone")
            free = np.flatnonzero(self.owner < 0)
            if not seq.capacity:
                start = self._first_fit(extra)
                pick = np.arange(start, start + extra) if start is not None else free[:extra]
            else:
                last = int(seq.cells[-1])
                nxt = np.arange(last + 1, last + 1 + extra)
                if nxt[-1] < self.n_cells and (self.owner[nxt] < 0).all():
                    pick = nxt                     # the range simply extends
                else:
                    after = free[free > last]
                    pick = after[:extra] if after.size >= extra else free[:extra]
            if pick.size < extra:
                raise ContextOverflowError(
                    f"{n} tokens do not fit in the KV cache: {self.n_free} of {self.n_cells} cells are free "
                    f"(the context size n_ctx is shared by the running sequences)")
            self.owner[pick] = seq.id
            # if the cells after its last one are taken, positions still map in order, but its rows
            # are no longer ascending (correct, only not bit-identical to a run alone)
            seq.cells = np.concatenate([seq.cells, pick.astype(np.int32)])

    def free(self, seq: SeqCells) -> None:
        """Return every cell of `seq` (idempotent)."""
        with self._lock:
            if seq.freed:
                return
            self.owner[seq.cells] = -1
            self.live.pop(seq.id, None)
            seq.freed = True
            seq.cells = seq.cells[:0]
            seq.n_past = 0

    def scratch_cells(self, limit: int, keep: dict[int, int]) -> np.ndarray:
        """Up to `limit` cells a padding row may overwrite, lowest first: free cells, then cells a
        live sequence reserved but has not reached (`keep[id]`: its first position still to be
        kept, default its n_past). Nobody reads such a cell before its owner writes it."""
        with self._lock:
            picks = [np.flatnonzero(self.owner < 0)]
            for seq in self.live.values():
                picks.append(seq.cells[keep.get(seq.id, seq.n_past):])
            cells = np.sort(np.concatenate(picks))
            return cells[:limit].astype(np.int32)

    def _new(self, seq_id: int, n: int) -> SeqCells:
        seq = SeqCells(seq_id, self._take(seq_id, n))
        self.live[seq_id] = seq
        return seq

    def _take(self, seq_id: int, n: int) -> np.ndarray:
        if n < 0:
            raise ConfigError(f"cannot reserve {n} KV cells")
        free = np.flatnonzero(self.owner < 0)
        if free.size < n:
            raise ContextOverflowError(
                f"{n} tokens do not fit in the KV cache: {free.size} of {self.n_cells} cells are free "
                f"(the context size n_ctx is shared by the running sequences)")
        start = self._first_fit(n)
        pick = np.arange(start, start + n) if start is not None else free[:n]    # fragmented: any cells
        self.owner[pick] = seq_id
        return pick.astype(np.int32)

    def _first_fit(self, n: int) -> int | None:
        """The first cell of the lowest run of `n` free cells starting on a page boundary, else of
        any run of `n` free cells, or None."""
        if n == 0:
            return 0
        free = np.concatenate([[False], self.owner < 0, [False]])
        edges = np.flatnonzero(np.diff(free.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        aligned = -(-starts // self.page) * self.page
        ok = np.flatnonzero(ends - aligned >= n)
        if ok.size:
            return int(aligned[ok[0]])
        ok = np.flatnonzero(ends - starts >= n)
        return int(starts[ok[0]]) if ok.size else None
