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

from metatp.kv_cells import KVCells, SeqCells

if TYPE_CHECKING:
    from metatp.scheduler import Metrics, Request

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

    def __init__(self, cells: KVCells, post: Callable[[tuple], None], release: Callable[["Request"], None],
                 metrics: "Metrics") -> None:
        self.cells = cells
        self.post = post              # records a cell operation (for MPI followers)
        self.release = release        # frees a request's cells (and posts the free)
        self.metrics = metrics
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
        n = len(prefill_ids(r))
        need = min(n + 1, max(r.n_cells, n))
        seq = self.cells.try_reserve(need, self.want(r, need), paged=self.paged and not alone)
        if seq is not None:
            self.post(("take", seq.id, seq.cells.copy()))
        return seq

    def make_room(self, running: list["Request"], waiting: collections.deque["Request"]) -> bool:
        """Give every decoding request in `running` (oldest first) a cell for the token it feeds
        this step; while the cache has none, preempt the last of `running` (the most recently
        admitted, possibly the one growing) to the front of `waiting`. Returns whether anything
        was preempted."""
        preempted = False
        for r in list(running):
            while r.state == "decode" and r.seq.capacity <= r.seq.n_past:
                need = r.seq.n_past + 1
                added = self.cells.try_grow(r.seq, need, self.want(r, need), paged=self.paged and len(running) > 1)
                if added is not None:
                    if added.size:
                        self.post(("grow", r.seq.id, added.copy()))
                    break
                self.preempt(running.pop(), waiting)
                preempted = True
        return preempted

    def preempt(self, r: "Request", waiting: collections.deque["Request"]) -> None:
        """Recompute preemption of `r`, already out of the running list (see the module doc)."""
        self.release(r)
        if r.state == "prefill" and r.refill is None:     # a prompt cut short: counted once, when fed again
            self.metrics.prompt_tokens -= r.n_fed
            self.metrics.recomputed_tokens += r.n_fed
        r.seq, r.n_fed = None, 0
        if r.state == "decode":
            r.refill = r.history[:-1]
        r.score_rows.clear()
        r.state = "waiting"
        waiting.appendleft(r)
        self.metrics.preemptions += 1
