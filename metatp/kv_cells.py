"""The unified KV cache's bookkeeping: which sequence owns each cell (llama.cpp's llama_kv_cells).

The cache has `n_cells` rows; every row (cell) is free or owned by one sequence, and an owned
cell holds one position of its owner once written: position p of a sequence lives in
`cells[p]`. Sequences take cells on demand (`try_reserve` for the first ones, `try_grow` as
they go; the scheduler takes a page of positions at a time, `metatp.kv_demand`) and return
them when they end, fail, are cancelled or preempted (`free`).

Placement keeps a sequence computing the same bits alone or beside others. The cache is cut
into pages of `page` cells (the backend's `kv_page`: the numpy attention's 128-cell chunks, at
absolute cell positions; a cache of fewer than two pages is not paged). A new sequence starts
on a page boundary, in the lowest free run that holds it, else on whole free pages; a growing
one extends in place when the next cells are free (the common case), else takes the lowest
free page after its last cell. Attention then meets every page of the sequence at the same
phase as alone from cell 0, and merges its chunks in the same order: measured on the numpy
backend (tests/serving/test_preemption.py), pages scattered in ascending order give the same
bits as one contiguous range; pages out of order do not (the chunks' partial sums are merged
in cell order and an FMA is not commutative), nor do positions off their phase (p not at a
cell = p mod page, or one page of positions split over two). `paged` placements refuse those
(the caller waits or preempts); otherwise, where no such room is free, any free cells are
taken, those after the sequence's last first: still correct, no longer bit-identical.

Cells may also be *cached* (`CACHED`): the prefix cache (`metatp.prefix_cache`) keeps the cells of
finished sequences' whole blocks of positions, read-only, and later sequences begin with them
(`try_reserve(prefix=...)`, `adopt`). A cached cell belongs to no sequence: freeing a sequence
returns only the cells it owns, no padding row writes a cached cell, and placement takes one only
after the prefix cache gave it back (`uncache`).

Under MPI rank 0 chooses every cell and the other ranks mirror its choices. The cache tells its
`listener` (installed by `metatp.lockstep.Leader`) each operation the others must replay, as a
tuple: ("take", seq id, cells, positions it begins with) for `try_reserve`, ("grow", seq id,
cells) for cells `try_grow` added, ("free", seq id) for a sequence taken so, ("rewind", seq id,
n_past) for `rewind`, ("cache", cells) and ("uncache", cells). The engine's own `reserve` and `grow` are told to nobody: every rank makes
those alike.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

import numpy as np

from metatp.ir.errors import ConfigError, ContextOverflowError

__all__ = ["KVCells", "SeqCells", "CACHED", "CellListener"]

CellListener = Callable[[tuple], None]

FREE = -1
CACHED = -2      # owner of a cell the prefix cache holds (shared, read-only)


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
        # a cache of fewer than two pages is not paged: its sequences share it cell by cell
        self.page = max(1, page) if n_cells >= 2 * page else 1
        self._owner: np.ndarray | None = None                   # made on first use (see `owner`)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._made = threading.Lock()
        self.live: dict[int, SeqCells] = {}                     # id -> sequence, while it owns cells
        self.reclaim: Callable[[], bool] | None = None          # evicts one cached block (metatp.prefix_cache)
        self.listener: CellListener | None = None               # told every operation to mirror (module doc)
        self._told: set[int] = set()                            # sequences whose take was told

    def _tell(self, op: tuple) -> None:
        if self.listener is not None:
            self.listener(op)

    @property
    def owner(self) -> np.ndarray:
        """Sequence id per cell, FREE (-1) or CACHED (-2). Allocated on first use, not in the constructor: an
        engine is built (and its memory planned, `metatp.passes.memory`) before the budget
        check, which must be able to refuse an impossible n_ctx before this table exists."""
        if self._owner is None:
            with self._made:
                if self._owner is None:
                    self._owner = np.full(self.n_cells, FREE, dtype=np.int64)
        return self._owner

    @property
    def n_used(self) -> int:
        """Cells owned by some sequence (reserved or written)."""
        return 0 if self._owner is None else int(np.count_nonzero(self._owner >= 0))

    @property
    def n_cached(self) -> int:
        """Cells the prefix cache holds (given back to the pool when it evicts them)."""
        return 0 if self._owner is None else int(np.count_nonzero(self._owner == CACHED))

    @property
    def n_free(self) -> int:
        return self.n_cells - self.n_used - self.n_cached

    def reserve(self, n: int) -> SeqCells:
        """A new sequence owning `n` cells (placed as `try_reserve` places them), the prefix
        cache's unused blocks given back as needed (`reclaim`); ContextOverflowError if fewer are free."""
        with self._lock:
            seq = self._reserve(n, n)
        while seq is None and self.reclaim is not None and self.reclaim():
            with self._lock:
                seq = self._reserve(n, n)
        if seq is None:
            raise self._overflow(n)
        return seq

    def try_reserve(self, need: int, want: int | None = None, paged: bool = False,
                    prefix: np.ndarray | None = None, at: int | None = None) -> SeqCells | None:
        """A new sequence owning `want` cells where that many are free, else `need`; None when
        fewer than `need` are free now (the caller waits), or, `paged`, when no placement keeps
        the sequence's pages in order from a page boundary (see the module doc). `prefix`:
        cached cells (`CACHED`) the sequence begins with, its positions 0..len-1, shared.
        `at`: the cell its own cells start at, where they are free there (see `room`)."""
        with self._lock:
            seq = self._reserve(need, need if want is None else want, paged, prefix, at)
            if seq is not None and self.listener is not None:
                self._told.add(seq.id)
        if seq is not None:
            self._tell(("take", seq.id, seq.cells.copy(), 0 if prefix is None else len(prefix)))
        return seq

    def room(self, after: int, n_pages: int) -> int | None:
        """The lowest page boundary past cell `after` from which `n_pages` whole pages are free
        (else hold no sequence's cell, only cached ones): where a new sequence can grow in order,
        once the prefix cache gives those pages back. None where there is no such run."""
        with self._lock:
            n = self.n_cells // self.page
            first = -(-(after + 1) // self.page)
            for taken in (self.owner != FREE, self.owner >= 0):
                pages = taken[: n * self.page].reshape(n, self.page).any(axis=1)
                for p in range(first, n - n_pages + 1):
                    if not pages[p:p + n_pages].any():
                        return p * self.page
            return None

    def try_grow(self, seq: SeqCells, need: int, want: int | None = None, paged: bool = False) -> np.ndarray | None:
        """Room for `need` positions in all (`want` where that many cells are free): the cells
        added (none if it had room), or None when the cache cannot supply `need` now (`paged`:
        not in place or on a later free page)."""
        pick = self._grow(seq, need, need if want is None else want, paged)
        if pick is not None and pick.size:
            self._tell(("grow", seq.id, pick.copy()))
        return pick

    def _grow(self, seq: SeqCells, need: int, want: int, paged: bool = False) -> np.ndarray | None:
        with self._lock:
            if seq.freed:
                raise ConfigError(f"sequence {seq.id} has ended; its cells are gone")
            pick = self._place(seq, need, want, paged)
            if pick is not None and pick.size:
                self.owner[pick] = seq.id
                seq.cells = np.concatenate([seq.cells, pick])
            return pick

    def grow(self, seq: SeqCells, n: int) -> None:
        """Give `seq` room for `n` positions in all, the prefix cache's unused blocks given back
        as needed (ContextOverflowError when the cache is full)."""
        got = self._grow(seq, n, n)
        while got is None and self.reclaim is not None and self.reclaim():
            got = self._grow(seq, n, n)
        if got is None:
            raise self._overflow(n)

    def adopt(self, seq_id: int, cells: np.ndarray) -> SeqCells:
        """A sequence with a given id owning exactly `cells`: a follower rank of a served model
        mirrors rank 0's reservation (`metatp.lockstep.follow`) instead of choosing its own, so
        that every rank's cache has the same owner in every cell."""
        cells = np.asarray(cells, dtype=np.int32)
        with self._lock:
            if seq_id in self.live:
                raise ConfigError(f"sequence {seq_id} already owns cells")
            self._check_free(seq_id, cells, cached_ok=True)
            self.owner[cells[self.owner[cells] == FREE]] = seq_id
            seq = SeqCells(seq_id, cells.copy())
            self.live[seq_id] = seq
            return seq

    def extend(self, seq: SeqCells, cells: np.ndarray) -> None:
        """Append exactly `cells` to `seq`: a follower mirrors rank 0's growth (`try_grow`)."""
        cells = np.asarray(cells, dtype=np.int32)
        with self._lock:
            if seq.freed or self.live.get(seq.id) is not seq:
                raise ConfigError(f"sequence {seq.id} has ended; it cannot grow")
            self._check_free(seq.id, cells)
            self.owner[cells] = seq.id
            seq.cells = np.concatenate([seq.cells, cells])

    def free(self, seq: SeqCells) -> None:
        """Return every cell of `seq` (idempotent)."""
        with self._lock:
            if seq.freed:
                return
            self.owner[seq.cells[self.owner[seq.cells] == seq.id]] = FREE     # cached cells stay
            self.live.pop(seq.id, None)
            seq.freed = True
            seq.cells = seq.cells[:0]
            seq.n_past = 0
            told = seq.id in self._told
            self._told.discard(seq.id)
        if told:
            self._tell(("free", seq.id))

    def rewind(self, seq: SeqCells, n_past: int) -> None:
        """Set `seq` back to its first `n_past` positions (speculative decoding's rejected
        tokens, `metatp.speculative`): it keeps its cells, and the positions past `n_past` are
        written again before anything reads them (a row attends only to positions up to its own)."""
        with self._lock:
            if not 0 <= n_past <= seq.n_past:
                raise ConfigError(f"sequence {seq.id} cannot rewind from {seq.n_past} to {n_past} positions")
            seq.n_past = n_past
            told = seq.id in self._told
        if told:
            self._tell(("rewind", seq.id, n_past))

    def scratch_cells(self, limit: int, keep: dict[int, int]) -> np.ndarray:
        """Up to `limit` cells a padding row may overwrite, lowest first: free cells, then cells a
        live sequence reserved but has not reached (`keep[id]`: its first position still to be
        kept, default its n_past). Nobody reads such a cell before its owner writes it."""
        with self._lock:
            picks = [np.flatnonzero(self.owner == FREE)]
            for seq in self.live.values():
                ahead = seq.cells[keep.get(seq.id, seq.n_past):]
                picks.append(ahead[self.owner[ahead] == seq.id])       # never a cached (shared) cell
            cells = np.sort(np.concatenate(picks))
            return cells[:limit].astype(np.int32)

    def cache(self, cells: np.ndarray) -> None:
        """Hand `cells` (written positions of a live sequence, or cached already) to the prefix
        cache: they outlive their sequence, read-only, until `uncache`."""
        cells = np.asarray(cells, dtype=np.int32)
        with self._lock:
            if cells.size and (self.owner[cells] == FREE).any():
                raise ConfigError("only cells a sequence holds can be cached")
            self.owner[cells] = CACHED
        self._tell(("cache", cells.copy()))

    def uncache(self, cells: np.ndarray) -> None:
        """The prefix cache gives `cells` back to the pool (an eviction)."""
        cells = np.asarray(cells, dtype=np.int32)
        with self._lock:
            if cells.size and (self.owner[cells] != CACHED).any():
                raise ConfigError("cells given back by the prefix cache were not cached")
            self.owner[cells] = FREE
        self._tell(("uncache", cells.copy()))

    # ------------------------------------------------------------ placement (under the lock)
    def _reserve(self, need: int, want: int, paged: bool = False, prefix: np.ndarray | None = None,
                 at: int | None = None) -> SeqCells | None:
        if need < 0:
            raise ConfigError(f"cannot reserve {need} KV cells")
        start = None
        if prefix is not None and len(prefix):
            start = SeqCells(-1, np.asarray(prefix, dtype=np.int32).copy())
            if (self.owner[start.cells] != CACHED).any():
                raise ConfigError("a sequence can begin only with cached cells")
        pick = self._place(start, need, want, paged) if at is None else self._place_at(start, need, want, at)
        if pick is None:
            return None
        seq = SeqCells(next(self._ids), pick if start is None else np.concatenate([start.cells, pick]))
        self.owner[pick] = seq.id
        self.live[seq.id] = seq
        return seq

    def _overflow(self, n: int) -> ContextOverflowError:
        return ContextOverflowError(
            f"{n} tokens do not fit in the KV cache: {self.n_free} of {self.n_cells} cells are free "
            f"(the context size n_ctx is shared by the running sequences)")

    def _check_free(self, seq_id: int, cells: np.ndarray, cached_ok: bool = False) -> None:
        if cells.size and (int(cells.min()) < 0 or int(cells.max()) >= self.n_cells
                           or (self.owner[cells] >= 0).any() or np.unique(cells).size != cells.size
                           or (not cached_ok and (self.owner[cells] == CACHED).any())):
            raise ConfigError(f"sequence {seq_id} cannot take its {cells.size} cells: some are out of range, "
                              "repeated or owned by another sequence")

    def _place_at(self, seq: SeqCells | None, need: int, want: int, at: int) -> np.ndarray | None:
        """Cells `at`.. for positions capacity.. of `seq`: `want` of them where free, else `need`."""
        cap = 0 if seq is None else seq.capacity
        for k in dict.fromkeys((max(want, need) - cap, need - cap)):
            if at + k <= self.n_cells and (self.owner[at:at + k] == FREE).all():
                return np.arange(at, at + k, dtype=np.int32)
        return None

    def _place(self, seq: SeqCells | None, need: int, want: int, paged: bool = False) -> np.ndarray | None:
        """The cells for positions capacity.. of `seq` (a new sequence if None): `want` of them
        where possible, else `need`, None if fewer are free. In order of preference (module doc):
        in place after its last cell; a free run starting on a page boundary after it (only
        where the new cells start a page of positions); whole free pages after it; then (unless
        `paged`) any free cells, those after its last first."""
        cap = 0 if seq is None else seq.capacity
        k_need, k_want = need - cap, max(want, need) - cap
        if k_need <= 0:
            return np.zeros(0, np.int32)
        free = self.owner == FREE
        last = int(seq.cells[-1]) if cap else -1
        at_page = cap % self.page == 0 and (not cap or int(seq.cells[0]) % self.page == 0)
        runs = np.zeros(self.n_cells + 1, np.int32)                      # runs[j]: free cells below j
        np.cumsum(free, dtype=np.int32, out=runs[1:])
        for k in dict.fromkeys((k_want, k_need)):
            end = last + 1 + k
            if cap and end <= self.n_cells and runs[end] - runs[last + 1] == k:
                return np.arange(last + 1, end, dtype=np.int32)            # the range extends
            if at_page:
                starts = np.arange(-(-(last + 1) // self.page) * self.page, self.n_cells - k + 1, self.page)
                ok = starts[runs[starts + k] - runs[starts] == k]
                if ok.size:
                    return np.arange(ok[0], ok[0] + k, dtype=np.int32)
        if at_page:                         # scattered pages, ascending: still the same bits
            first = -(-(last + 1) // self.page)
            bounds = np.arange(first, self.n_cells // self.page + 1) * self.page
            whole = bounds[:-1][np.diff(runs[bounds]) == self.page]
            for k in (k_want, k_need):
                if whole.size * self.page >= k:
                    n_pages = -(-k // self.page)
                    return (whole[:n_pages, None] + np.arange(self.page)).reshape(-1)[:k].astype(np.int32)
        idx = np.flatnonzero(free)
        if idx.size < k_need or paged:
            return None
        after = idx[idx > last]
        return (after if after.size >= k_need else idx)[:k_need].astype(np.int32)
