"""KV cells on demand: what a sequence takes from the cache, and when (vLLM's KV cache manager).

`CellDemand` speaks cells only: `admit` takes the cells of a new sequence for its prefill and
next token (beginning with the prefix cache's blocks its tokens start with), `grow` gives a
running sequence room for one more position, a page of positions at a time
(`metatp.kv_cells.KVCells.try_grow`: in place where the next cells are free), and `free` returns
a sequence's cells, keeping its whole blocks in the prefix cache. A sequence never takes more
cells than its request can use (`n_cells`: prompt + max_tokens - 1). Which request waits and
which is preempted when the cache is full is the scheduler's (`metatp.scheduler`, vLLM's
`Scheduler._preempt_request`); under MPI every cell operation reaches the followers through the
cache's listener (`KVCells.listener`, installed by `metatp.lockstep.Leader`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from metatp.kv_cells import KVCells, SeqCells
from metatp.prefix_cache import ANONYMOUS, Namespace, PrefixCache

if TYPE_CHECKING:
    from metatp.metrics import Metrics

__all__ = ["CellDemand"]


class CellDemand:
    """Admission, growth and freeing of sequences' cells over one cache (see the module doc)."""

    BLOCK = 16          # cells taken at a time where the cache is not paged (vLLM's block size)

    def __init__(self, cells: KVCells, metrics: "Metrics", prefix_caching: bool = False) -> None:
        self.cells = cells
        self.metrics = metrics
        self.prefix = PrefixCache(cells) if prefix_caching else None
        # a paged cache (the backend's kv_page > 1) places every sequence on pages of its own,
        # in order, unless it runs alone: a request waits or preempts rather than break that
        self.paged = cells.page > 1

    def want(self, n_cells: int, need: int) -> int:
        """Cells to take when a sequence needs `need` in all: to the end of that page of
        positions (a sequence then meets attention's chunks as it does alone), at most the
        `n_cells` its request can use."""
        page = max(self.cells.page, self.BLOCK)
        return max(need, min(-(-need // page) * page, n_cells))

    def admit(self, ids: Sequence[int], n_cells: int, alone: bool, cached: bool = True,
              namespace: Namespace = ANONYMOUS) -> SeqCells | None:
        """A sequence to prefill `ids` and take the next token: room for them, on pages of its
        own unless it would run `alone`, beginning with the prefix cache's blocks `ids` start
        with in `namespace` (`cached`; its n_past then counts their positions); None when the
        cache cannot hold them now (the request keeps waiting)."""
        n = len(ids)
        need = min(n + 1, max(n_cells, n))
        paged = self.paged and not alone
        cached = cached and self.prefix is not None
        chain = self.prefix.lookup(ids, namespace) if cached else []
        seq = None
        for ch in self._chains(chain):
            self.prefix.pin(ch)
            seq = self._reserve(n_cells, need, paged, np.concatenate([b.cells for b in ch]))
            if seq is not None:
                chain = ch
                break
            self.prefix.unpin(ch)
        else:
            chain = []
            seq = self._reserve(n_cells, need, paged, None)
        if seq is None:
            return None
        if cached:
            reused = len(chain) * self.prefix.block
            self.prefix.attach(seq, chain)
            seq.n_past = reused
            self.metrics.count_prefix(namespace.tenant, n, reused)
        return seq

    def grow(self, seq: SeqCells, n_cells: int, shared: bool, ahead: int = 1) -> bool:
        """Room for the `ahead` tokens `seq` feeds next (positions n_past..; more than one: a
        speculative step's drafted tokens), a page at a time, evicting the prefix cache's unused
        blocks as needed; `shared`: other sequences run beside it, so its pages must stay in
        order. False when the cache cannot supply them now."""
        need = seq.n_past + ahead
        if seq.capacity >= need:
            return True
        nxt = int(seq.cells[-1]) + 1 if seq.capacity else 0
        added = self._placed(lambda pg: self.cells.try_grow(seq, need, self.want(n_cells, need), paged=pg),
                             self.paged and shared, (nxt, nxt + self.cells.page))
        return added is not None

    def rewind(self, seq: SeqCells, n_past: int) -> None:
        """`seq` back to `n_past` positions, its cells kept (`KVCells.rewind`)."""
        self.cells.rewind(seq, n_past)

    def free(self, seq: SeqCells, ids: Sequence[int] | None = None, namespace: Namespace = ANONYMOUS) -> None:
        """Return `seq`'s cells. `ids`: its tokens, given when its written cells are good (it
        finished, was cancelled or preempted): their whole blocks stay in the prefix cache, in
        `namespace` (its request's)."""
        if self.prefix is not None and not seq.freed:
            if ids is not None:
                self.prefix.keep(seq, ids, namespace)
            else:
                self.prefix.unpin(self.prefix.held.pop(seq.id, []))
        self.cells.free(seq)

    def _reserve(self, n_cells: int, need: int, paged: bool, start: np.ndarray | None) -> SeqCells | None:
        """A sequence beginning with cached cells `start` (or none): where `_room` says, else
        the usual placement with evictions (`_placed`)."""
        at = self._room(n_cells, need, start)
        if at is False:
            return None
        if at is not None:
            seq = self.cells.try_reserve(need, self.want(n_cells, need), paged, start, at)
            if seq is not None or len(start if start is not None else ()) % self.cells.page:
                return seq
        return self._placed(lambda pg: self.cells.try_reserve(need, self.want(n_cells, need), pg, start), paged)

    def _chains(self, chain: list) -> list[list]:
        """The prefixes to try, longest first: the whole chain, then (on a paged cache, where it
        ends inside a page and cannot continue in place) its whole pages."""
        if not chain:
            return []
        whole = len(chain) * self.prefix.block // self.cells.page * self.cells.page // self.prefix.block
        return [chain] + ([chain[:whole]] if self.paged and 0 < whole < len(chain) else [])

    def _room(self, n_cells: int, need: int, start: np.ndarray | None) -> int | None | bool:
        """With a prefix cache on a paged cache: where a sequence's own cells start, the cached
        blocks in the way of its first ones evicted. After a chain that ends inside a page: in
        place, right after it (False where blocks in use are in the way); else on the first page
        boundary from which it can grow in order to all it may hold (`KVCells.room`). None: the
        usual placement."""
        if self.prefix is None or not self.paged:
            return None
        page, base = self.cells.page, 0 if start is None else len(start)
        first = self.want(n_cells, need) - base
        if base % page:
            at = int(start[-1]) + 1
            return at if self.prefix.evict_range(at, at + first) else False
        n_pages = min(-(-(max(n_cells, need) - base) // page), self.cells.n_cells // page)
        at = self.cells.room(int(start[-1]) if base else -1, max(n_pages, 1))
        if at is None or not self.prefix.evict_range(at, at + -(-first // page) * page):
            return None
        return at

    def _placed(self, place: Callable[[bool], object], paged: bool, ahead: tuple[int, int] | None = None) -> object:
        """`place(paged)`, evicting the prefix cache's unused blocks while it fails (first those
        in the cells `ahead`, the page a growing sequence would extend into, then the least
        recently used one at a time): on a paged cache first with the sequence's pages in order,
        and only then, unless `paged` requires them in order, anywhere (cached blocks go before a
        placement loses the bits)."""
        for pg in (True, False) if self.paged else (False,):
            got = place(pg)
            if got is None and ahead is not None and self.prefix is not None and self.prefix.evict_range(*ahead):
                got = place(pg)
            while got is None and self.prefix is not None and self.prefix.evict_one():
                got = place(pg)
            if got is not None or (pg and paged):
                return got
        return None
