"""KV cells on demand: what a request takes from the cache, and when (vLLM's KV cache manager).

Admission takes the cells for a request's prompt and its next token; before each step every
decoding request must own a cell for the token it feeds, and grows a page of positions at a
time (`metatp.kv_cells.KVCells.try_grow`: in place where the next cells are free). When the
cache cannot supply one, the most recently admitted running request is preempted until it can
(vLLM's recompute preemption, `preempt`): its cells are freed, its tokens, random generator
and stop-string state kept, and it waits first in line; re-admitted, it prefills its prompt
and generated tokens but the pending one (`Request.refill`) as they were first computed, and
decodes on from the pending token, so its client sees one stream. A request never takes more
cells than it can use (prompt + max_tokens - 1). Under MPI every cell operation is posted to
the followers (`post`: "take", "grow"; a preemption's free is the scheduler's "free").
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable

import numpy as np

from metatp.kv_cells import KVCells, SeqCells
from metatp.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from metatp.metrics import Metrics
    from metatp.scheduler import Request

__all__ = ["CellDemand", "prefill_ids", "prefill_chunk"]


def prefill_ids(r: "Request") -> list[int]:
    """What a request's prefill feeds: its prompt, or after a preemption its prompt and generated
    tokens but the pending one (`Request.refill`), whose cell the next decode step writes."""
    return r.prompt_ids if r.refill is None else r.refill


def prefill_chunk(r: "Request", budget: int, small_rows: int) -> list[int]:
    """The next at most `budget` tokens of a request's prefill. A refill is computed as it was
    first: its prompt part apart, its generated part in passes of at most `small_rows` rows (the
    backend's few-token path, where a row's sums do not depend on the pass, as in a decode step),
    so its cells get the bits they had and its next logits are those of a run never preempted."""
    ids, end = prefill_ids(r), r.n_fed + budget
    if r.refill is not None:
        n = len(r.prompt_ids)
        end = min(end, n) if r.n_fed < n else min(end, r.n_fed + small_rows)
    return ids[r.n_fed:end]


class CellDemand:
    """Admission and growth of requests' cells over one cache; `post` records each operation."""

    BLOCK = 16          # cells taken at a time where the cache is not paged (vLLM's block size)

    def __init__(self, cells: KVCells, post: Callable[[tuple], None], release: Callable[["Request", bool], None],
                 metrics: "Metrics", prefix_caching: bool = False) -> None:
        self.cells = cells
        self.post = post              # records a cell operation (for MPI followers)
        self.release = release        # frees a request's cells (and posts the free); True: keep its blocks
        self.metrics = metrics
        self.prefix = PrefixCache(cells, post) if prefix_caching else None
        # a paged cache (the backend's kv_page > 1) places every sequence on pages of its own,
        # in order, unless it runs alone: a request waits or preempts rather than break that
        self.paged = cells.page > 1

    def want(self, r: "Request", need: int) -> int:
        """Cells to take when `r` needs `need` in all: to the end of that page of positions (a
        sequence then meets attention's chunks as it does alone), at most what `r` can use."""
        page = max(self.cells.page, self.BLOCK)
        return max(need, min(-(-need // page) * page, r.n_cells))

    def admit(self, r: "Request", alone: bool) -> SeqCells | None:
        """A sequence for a waiting request: room for its prefill and the next token, on pages
        of its own unless it would run `alone`; None when the cache cannot hold them now (the
        request keeps waiting)."""
        ids = prefill_ids(r)
        n = len(ids)
        need = min(n + 1, max(r.n_cells, n))
        paged = self.paged and not alone
        chain = self.prefix.lookup(ids) if self.prefix is not None and r.kind != "score" else []
        seq = None
        for ch in self._chains(chain):
            self.prefix.pin(ch)
            seq = self._reserve(r, need, paged, np.concatenate([b.cells for b in ch]))
            if seq is not None:
                chain = ch
                break
            self.prefix.unpin(ch)
        else:
            chain = []
            seq = self._reserve(r, need, paged, None)
        if seq is None:
            return None
        if self.prefix is not None and r.kind != "score":
            reused = len(chain) * self.prefix.block
            self.prefix.attach(seq, chain)
            seq.n_past = r.n_fed = r.n_reused = reused
            self.metrics.prefix_queried_tokens += n
            self.metrics.prefix_hit_tokens += reused
        self.post(("take", seq.id, seq.cells.copy(), seq.n_past))
        return seq

    def _reserve(self, r: "Request", need: int, paged: bool, start: np.ndarray | None) -> SeqCells | None:
        """A sequence for `r` beginning with cached cells `start` (or none): where `_room` says,
        else the usual placement with evictions (`_placed`)."""
        at = self._room(r, need, start)
        if at is False:
            return None
        if at is not None:
            seq = self.cells.try_reserve(need, self.want(r, need), paged, start, at)
            if seq is not None or len(start if start is not None else ()) % self.cells.page:
                return seq
        return self._placed(lambda pg: self.cells.try_reserve(need, self.want(r, need), pg, start), paged)

    def _chains(self, chain: list) -> list[list]:
        """The prefixes to try, longest first: the whole chain, then (on a paged cache, where it
        ends inside a page and cannot continue in place) its whole pages."""
        if not chain:
            return []
        whole = len(chain) * self.prefix.block // self.cells.page * self.cells.page // self.prefix.block
        return [chain] + ([chain[:whole]] if self.paged and 0 < whole < len(chain) else [])

    def _room(self, r: "Request", need: int, start: np.ndarray | None) -> int | None | bool:
        """With a prefix cache on a paged cache: where `r`'s own cells start, the cached blocks in
        the way of its first ones evicted. After a chain that ends inside a page: in place, right
        after it (False where blocks in use are in the way); else on the first page boundary from
        which it can grow in order to all it may hold (`KVCells.room`). None: the usual placement."""
        if self.prefix is None or not self.paged:
            return None
        page, base = self.cells.page, 0 if start is None else len(start)
        first = self.want(r, need) - base
        if base % page:
            at = int(start[-1]) + 1
            return at if self.prefix.evict_range(at, at + first) else False
        n_pages = min(-(-(max(r.n_cells, need) - base) // page), self.cells.n_cells // page)
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

    def retire(self, r: "Request", keep: bool) -> None:
        """`r`'s sequence is about to be freed: leave its whole blocks in the prefix cache
        (`keep`: it finished, was cancelled or preempted, so its written cells are good)."""
        if self.prefix is None or r.seq is None or r.seq.freed:
            return
        if keep:
            self.prefix.keep(r.seq, r.history)
        else:
            self.prefix.unpin(self.prefix.held.pop(r.seq.id, []))

    def make_room(self, running: list["Request"], waiting: collections.deque["Request"]) -> bool:
        """Give every decoding request in `running` (oldest first) a cell for the token it feeds
        this step; while the cache has none, preempt the last of `running` (the most recently
        admitted, possibly the one growing) to the front of `waiting`. Returns whether anything
        was preempted."""
        preempted = False
        for r in list(running):
            while r.state == "decode" and r.seq.capacity <= r.seq.n_past:
                need = r.seq.n_past + 1
                nxt = int(r.seq.cells[-1]) + 1 if r.seq.capacity else 0
                added = self._placed(lambda pg: self.cells.try_grow(r.seq, need, self.want(r, need), paged=pg),
                                     self.paged and len(running) > 1, (nxt, nxt + self.cells.page))
                if added is not None:
                    if added.size:
                        self.post(("grow", r.seq.id, added.copy()))
                    break
                self.preempt(running.pop(), waiting)
                preempted = True
        return preempted

    def preempt(self, r: "Request", waiting: collections.deque["Request"]) -> None:
        """Recompute preemption of `r`, already out of the running list (see the module doc)."""
        self.release(r, True)
        if r.state == "prefill" and r.refill is None:     # a prompt cut short: counted once, when fed again
            self.metrics.prompt_tokens -= r.n_fed - r.n_reused
            self.metrics.recomputed_tokens += r.n_fed - r.n_reused
        r.requeue()
        waiting.appendleft(r)
        self.metrics.preemptions += 1
