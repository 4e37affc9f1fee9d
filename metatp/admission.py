"""Which requests hold KV cells, decided at each step boundary (vLLM's scheduling policy).

`Admission` works on the scheduler's two lists under its state lock: `waiting` (FIFO, a
preempted request first in line) and `running` (in admission order). `make_room` gives every
decoding request (oldest first) a cell for the token it feeds this step; while the cache has
none, the most recently admitted running request is preempted (`preempt`, vLLM's recompute
preemption: its cells freed, their whole blocks kept in the prefix cache, its tokens and sampling
state kept, queued first). A step that preempted admits nothing (it would take their cells);
else `admit` takes the oldest waiting requests while a slot (`max_num_seqs`) and cells for the
prompt and its next token are free, each beginning with the prefix cache's blocks its prompt
starts with (`CellDemand.admit`). `release` gives a request's cells back.

The cells themselves are `metatp.kv_demand`'s; what a step carries and what the requests' tokens
do is `metatp.scheduler`'s.
"""

from __future__ import annotations

from collections import deque

from metatp.kv_demand import CellDemand
from metatp.metrics import Metrics
from metatp.request_state import PROMPT_KINDS, Request, RequestState

__all__ = ["Admission"]


class Admission:
    """Admission and preemption of requests over one `CellDemand` (see the module doc)."""

    def __init__(self, demand: CellDemand, metrics: Metrics) -> None:
        self.demand = demand
        self.metrics = metrics

    def schedule(self, waiting: deque[Request], running: list[Request], max_num_seqs: int) -> None:
        """Room for every decoding request's next token, then, unless that preempted, the waiting
        requests that fit (`make_room`, `admit`)."""
        if not self.make_room(waiting, running):     # no admission in a step that preempted (vLLM)
            self.admit(waiting, running, max_num_seqs)

    def admit(self, waiting: deque[Request], running: list[Request], max_num_seqs: int) -> None:
        """Move the oldest waiting requests to `running` while a slot and their cells are free;
        each starts at the positions the prefix cache holds for it."""
        while waiting and len(running) < max_num_seqs:
            r = waiting[0]
            seq = self.demand.admit(r.prefill_ids, r.n_cells, alone=not running, cached=r.kind not in PROMPT_KINDS,
                                    namespace=r.cache_namespace)
            if seq is None:
                break
            waiting.popleft()
            r.seq, r.state = seq, RequestState.PREFILL
            r.n_fed = r.n_reused = seq.n_past         # positions found in the prefix cache
            running.append(r)

    def make_room(self, waiting: deque[Request], running: list[Request]) -> bool:
        """Give every decoding request (oldest first) a cell for the token it feeds this step;
        while the cache has none, preempt the most recently admitted running request (possibly
        the one growing). Returns whether anything was preempted."""
        preempted = False
        for r in list(running):
            while r.state is RequestState.DECODE and not self.demand.grow(r.seq, r.n_cells, len(running) > 1):
                self.preempt(running.pop(), waiting)
                preempted = True
        return preempted

    def preempt(self, r: Request, waiting: deque[Request]) -> None:
        """Recompute preemption (vLLM's) of `r`, already out of the running list: its cells are
        freed (their whole blocks kept in the prefix cache), its tokens and sampling state kept,
        and it waits first in line; re-admitted, it prefills its prompt and generated tokens but
        the pending one as they were first computed, and decodes on from the pending token, so
        its client sees one stream."""
        self.release(r, keep=True)
        if r.state is RequestState.PREFILL and r.refill is None:   # a prompt cut short: counted once, when fed again
            self.metrics.prompt_tokens -= r.n_fed - r.n_reused
            self.metrics.recomputed_tokens += r.n_fed - r.n_reused
        r.requeue()
        waiting.appendleft(r)
        self.metrics.preemptions += 1

    def release(self, r: Request, keep: bool = False) -> None:
        """Free `r`'s cells; `keep`: its whole blocks stay in the prefix cache (it did not fail).
        An embedded input's never do: embedding inputs are rarely prompts again, and would push
        out prefixes that are."""
        keep = keep and r.kind != "embed"
        if r.seq is not None:
            self.demand.free(r.seq, r.history if keep else None, r.cache_namespace)
