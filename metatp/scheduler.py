"""Continuous batching: many requests share every engine step (vLLM's scheduler, llama-server's slots).

A `Request` (`metatp.request_state`) is one sample being generated (or one prompt being scored or
embedded). Requests wait in a FIFO queue; at each step boundary the oldest ones are admitted while a
slot (`max_num_seqs`) and cells for the prompt and its next token are free (`metatp.admission`,
which decides who holds cells; the scheduler keeps the step loop). Cells come on demand
(`metatp.kv_demand`): each decoding request gets a page more as it needs it; when the cache has
none, the most recently admitted running request is preempted (`admission.Admission.preempt`: its cells
freed, its tokens and sampling state kept, queued first) and re-prefilled as first computed, so its client sees
one stream and the tokens of a run alone. A step that preempts admits nothing. With the prefix
cache (`metatp.prefix_cache`, on by default) a request begins with the cached blocks its prompt
starts with and prefills only the rest; an ending one leaves its blocks there.
What one request may hold is bounded by one rule (`context_budget`): the cache's n_ctx, and a
per-request cap `max_model_len` (a server's n_ctx / parallel by default, llama-server's slot).
One step carries the next token of every decoding request plus
chunks of admitted prompts, up to `n_batch` tokens (chunked prefill); each request samples
from its own logits with its own random generator, stop strings and limits, so its tokens do
not depend on who shares its steps. The scheduler works on token ids and request states: the
model runner (`metatp.runner`) runs each step and samples its tokens, the scheduler ends requests
on token-level rules (max_tokens, end-of-generation and stop tokens, a complete constraint) and
delivers each request's `TokenEvent`s to its one sink, outside the state lock that other threads
wait on. With a speculator (`metatp.speculative`) a decode item also carries the tokens drafted
after its pending one, verified in the same pass; the accepted run is taken token by token (the
same rules end it) and the rejected positions are rewound (`CellDemand.rewind`). Text, stop
strings and logprobs formatting run on the consumer's side of the request handle
(`metatp.requests`, `metatp.output_processor`); a stop string there cancels the request.

Steps are driven cooperatively: a caller waiting for its request's next output runs a step
itself (one thread at a time; the others wait for the step lock, then find their outputs
delivered), so the library needs no thread of its own. A server starts one driver thread
(`start`) that steps while there is work, and requests get their outputs through their sinks.
Cancelled requests (a closed stream, a client gone, a stop string) are dropped, and their cells
freed, at once when no step runs, else at the next step boundary.

Under MPI one mechanism keeps the ranks in lock step, for a server and for a program every rank
runs alike (`LLM.generate` under `mpiexec`): only rank 0 has a working scheduler, and it *leads*
(`Scheduler.lead`): before each step its model runner posts the step to the other ranks as a
`StepBatch` -- the KV cell operations since the last step, which the `Leader` hears from the
cache (`KVCells.listener`), and the step's items -- and those ranks, which never step a
scheduler, run exactly the same `Engine.run` (`metatp.lockstep`). Tokens are sampled on rank 0
only and nothing is agreed per step;
what a call returns reaches the other ranks through `metatp.mpi_calls`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from metatp.admission import Admission
from metatp.ir.errors import ConfigError, ContextOverflowError, MetatpError, RequestStateError
from metatp.kv_demand import CellDemand
from metatp.lockstep import Leader
from metatp.metrics import Metrics
from metatp.output_processor import TokenEvent
from metatp.request_state import PROMPT_KINDS, Request, RequestState, context_budget
from metatp.runner import ModelRunner, Purpose, ScheduledItem, TokenResult
from metatp.speculative import Speculator

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["Request", "RequestState", "TokenEvent", "Scheduler", "QueueFullError", "Metrics", "context_budget",
           "PROMPT_KINDS"]


class QueueFullError(MetatpError):
    """The waiting queue is full (a server answers 503 / 429): try again later."""


class Scheduler:
    """Admits, batches and steps requests over one model runner (see the module doc)."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int = 16, max_waiting: int | None = None,
                 n_batch: int | None = None, prefix_caching: bool = True,
                 speculator: Speculator | None = None) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.runner = runner
        self.engine = engine = runner.engine
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.n_batch = n_batch or engine.n_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._state = threading.Lock()
        self._changed = threading.Condition(self._state)    # work arrived / outputs delivered
        self._step_lock = threading.Lock()
        self._delivering = threading.RLock()     # one thread at a time sends events, in order (a sink may submit)
        self._outbox: list[tuple[Request, TokenEvent]] = []   # events decided under the state lock, not yet sent
        self._driver: threading.Thread | None = None
        self._stop = threading.Event()
        self.metrics = Metrics()
        self._leader: Leader | None = None     # under MPI, serving: rank 0 posts every step (`lead`)
        # KV cells on demand (metatp.kv_demand); which request waits or is preempted: metatp.admission
        self.demand = CellDemand(engine.cells, self.metrics, prefix_caching)
        self.admission = Admission(self.demand, self.metrics)
        # speculative decoding (metatp.speculative): decode steps carry drafted tokens to verify
        self.speculator = speculator

    def lead(self, world: "World") -> Leader:
        """Drive every rank of `world` from here (rank 0; `LLM` calls it): each step is posted to
        the other ranks (`metatp.lockstep.Follower`) before it runs, and tokens are sampled here
        only. Call before the first step; again with the same world: the same Leader."""
        if world.rank != 0:
            raise ConfigError(f"only rank 0 leads the steps; rank {world.rank} follows (metatp.lockstep.follow)")
        if self._leader is None or self._leader.world is not world:
            self._leader = Leader(world, self.engine.cells)     # it hears every cell operation
        self.runner.leader = self._leader
        return self._leader

    def stop_leading(self) -> None:
        """Tell the followers that no step will come (after the driver thread has stopped)."""
        if self._leader is not None:
            self._leader.stop()

    # ---------------------------------------------------------------- requests
    def submit(self, req: Request) -> None:
        """Queue a request (QueueFullError when the bounded waiting queue is full). Its sampling
        state is made now (`ModelRunner.add`), so a bad logit_bias or grammar fails the submit."""
        self.runner.add(req)
        try:
            if req.n_cells > self.engine.n_ctx:
                raise ContextOverflowError(f"{req.n_cells} tokens do not fit in the context of {self.engine.n_ctx}")
            with self._state:
                ended = req.kind not in PROMPT_KINDS and req.max_new == 0
                if ended:
                    self.metrics.accept(req.cache_namespace.tenant, len(req.prompt_ids))
                    self._finish(req, TokenEvent(None, "length"))
                elif self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                    raise QueueFullError(f"the server is busy: {len(self.waiting)} requests are waiting "
                                         f"(--max-waiting {self.max_waiting}); retry later")
                else:
                    req.t_submit = time.perf_counter()
                    self.metrics.accept(req.cache_namespace.tenant, len(req.prompt_ids))
                    self.waiting.append(req)
                    self._changed.notify_all()
        except BaseException:
            self._forget(req)
            raise
        if ended:
            self._deliver()

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Stop a request; its cells are freed now, or at the next step boundary when a step is
        running. `reason`: its finish reason ("stop": its consumer found a stop string, so it
        counts as finished, as vLLM's output processor aborts a request)."""
        with self._state:
            if req.done or req.cancelled:
                return
            req.cancelled = reason
            if req in self.waiting:
                self.waiting.remove(req)
                self._end_cancelled(req)
            self._changed.notify_all()
            running = req in self.running
        if running and self._step_lock.acquire(blocking=False):    # no step runs: free its cells now
            try:
                with self._state:
                    if req in self.running:
                        self.running.remove(req)
                        self.admission.release(req, keep=True)
                        self._end_cancelled(req)
            finally:
                self._step_lock.release()

    def _end_cancelled(self, r: Request) -> None:
        r.state, r.finish_reason, r.closed = RequestState.DONE, r.cancelled, True
        if r.cancelled == "stop":
            self.metrics.requests_finished += 1
        else:
            self.metrics.requests_cancelled += 1
        self._forget(r)

    def abandon(self, err: BaseException, timeout: float = 1.0) -> int:
        """Fail every request now, from another thread, leaving the engine alone (a step may be
        stuck inside it): the MPI job is ending on a lost rank (`backends.watchdog`), and each
        request's caller gets `err` instead of waiting. Returns how many requests failed."""
        if not self._state.acquire(timeout=timeout):
            return 0
        try:
            reqs = [r for r in (*self.running, *self.waiting) if not r.done]
            self.running.clear()
            self.waiting.clear()
            for r in reqs:
                r.state, r.finish_reason = RequestState.DONE, "error"
                self.metrics.requests_failed += 1
                self._forget(r)
                self._emit(r, TokenEvent(None, "error", error=err))
            self._changed.notify_all()
        finally:
            self._state.release()
        self._deliver()
        return len(reqs)

    def next_event(self, req: Request, timeout: float | None = None) -> TokenEvent:
        """The next event of a request without a sink, stepping the engine while it has none
        (see the module doc)."""
        if req.sink is not None:
            raise RequestStateError("this request's events go to its sink; they cannot also be waited for")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._state:
                if req.events:
                    return req.events.popleft()
                if req.closed:
                    raise RequestStateError("the request has ended and has no more outputs")
                if self._driver is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("no output within the timeout")
                    self._changed.wait(timeout=left if left is not None else 1.0)
                    continue
            if not self.step():
                with self._state:
                    if not req.events and not req.closed and not self._step_lock.locked():
                        raise RequestStateError("the scheduler has nothing to run but a request is unfinished")

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        with self._state:
            return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- stepping
    def step(self) -> bool:
        """One step: drop cancelled requests, admit waiting ones, run every running one a token
        (or a prompt chunk) further. Returns whether it ran anything."""
        with self._step_lock:
            work = self._compose()
            if not work:
                return False
            try:
                self._speculate(work)
                results = self.runner.execute(work)
            except Exception as e:                  # the pass is lost: its requests fail, others go on
                with self._state:
                    for w in work:
                        self._fail(w.request, e)
                self._deliver()
                return True
            now = time.perf_counter()
            with self._state:
                m = self.metrics
                m.steps += 1
                m.max_step_seqs = max(m.max_step_seqs, len(work))
                m.step_seqs_hist[len(work)] += 1
                for w, res in zip(work, results):
                    self._advance(w, res, now)
                self._changed.notify_all()
            self._deliver()
            return True

    def _compose(self) -> list[ScheduledItem]:
        """Admit what fits, then the step's items: decode tokens first, then prompt chunks (FIFO)."""
        with self._state:
            for r in [r for r in self.running if r.cancelled]:
                self.running.remove(r)
                self.admission.release(r, keep=True)
                self._end_cancelled(r)
            self.admission.schedule(self.waiting, self.running, self.max_num_seqs)
            work: list[ScheduledItem] = []
            budget = self.n_batch
            for r in self.running:
                if r.state is RequestState.DECODE:
                    work.append(ScheduledItem(r, r.seq, [r.pending], Purpose.SAMPLE))
                    budget -= 1
            for r in self.running:
                if r.state is not RequestState.PREFILL or budget <= 0:
                    continue
                chunk = r.prefill_chunk(budget, self.engine.small_rows)
                ends = r.n_fed + len(chunk) == len(r.prompt_ids)
                if r.kind in PROMPT_KINDS:
                    purpose = Purpose.SCORE if r.kind == "score" else Purpose.EMBED
                    work.append(ScheduledItem(r, r.seq, chunk, purpose, first=r.n_fed == 0, last=ends))
                else:                                   # a refill samples nothing
                    last = r.refill is None and ends
                    work.append(ScheduledItem(r, r.seq, chunk, Purpose.SAMPLE if last else Purpose.FEED))
                budget -= len(chunk)
            return work

    def _speculate(self, work: list[ScheduledItem]) -> None:
        """With a speculator, each decode item it may draft for carries the tokens drafted after
        its pending one (`Purpose.VERIFY`): the speculator drafts them (`Speculator.drafts`) in
        the rows the step's batch has left after the prompt chunks, outside the state lock (a
        draft model's passes do not hold up submits; the step lock keeps the requests' tokens
        still); here each drafted request's cells grow for them, and one whose cells cannot grow
        now does not speculate this step."""
        if self.speculator is None:
            return
        spare = self.n_batch - sum(len(w.tokens) for w in work)
        drafted = self.speculator.drafts([w for w in work if self._may_speculate(w)], spare, self.engine.small_rows)
        if not drafted:
            return
        with self._state:
            shared = len(self.running) > 1
            for w, draft in drafted:
                r = w.request
                if self.demand.grow(r.seq, r.n_cells, shared, ahead=1 + len(draft)):
                    w.tokens, w.purpose = [*w.tokens, *draft], Purpose.VERIFY

    def _may_speculate(self, w: ScheduledItem) -> bool:
        """Is `w` a generating request's decode item without structured output (which never
        speculates)?"""
        r = w.request
        return (w.purpose is Purpose.SAMPLE and r.state is RequestState.DECODE and r.kind == "generate"
                and self.runner.state(r.id).guide is None)

    def _forget(self, r: Request) -> None:
        """`r` has ended: its sampling state (and a draft model's sequence) go."""
        self.runner.forget(r.id)
        if self.speculator is not None:
            self.speculator.forget(r.id)

    def _advance(self, w: ScheduledItem, res: TokenResult | None, now: float) -> None:
        """Take one step's result for its request (under the state lock): the token it got (its
        event ends the request on the token-level rules), a scored prompt's logits, the error
        sampling raised, or None."""
        r = w.request
        if r.state is RequestState.PREFILL:
            r.n_fed += len(w.tokens)
            if r.refill is not None:
                self.metrics.recomputed_tokens += len(w.tokens)
                if r.n_fed == len(r.refill):          # recomputed: decoding resumes at the pending token
                    r.refill, r.state = None, RequestState.DECODE
                return
            self.metrics.prompt_tokens += len(w.tokens)
            if r.kind in PROMPT_KINDS:
                if r.n_fed == len(r.prompt_ids):
                    if res is None or res.error is not None:
                        self._fail(r, res.error if res is not None else
                                   RequestStateError(f"a prompt to {r.kind} got no result"))
                    else:
                        self._finish(r, TokenEvent(None, "stop", logits=res.logits, hidden=res.hidden))
                return
            if r.n_fed < len(r.prompt_ids):
                return
            r.state = RequestState.DECODE
        if isinstance(res, list):                   # a verified draft: its accepted run and one more
            rejected = self.speculator.verified(r.id, len(w.tokens) - 1, len(res))
            if rejected:                            # their positions are written again next
                self.demand.rewind(r.seq, r.seq.n_past - rejected)
            for one in res:
                if self._take(r, one, now):
                    return
            return
        self._take(r, res, now)

    def _take(self, r: Request, res: TokenResult | None, now: float) -> bool:
        """Take one token for a decoding request (or the error in its place); whether it ended."""
        if res is None or res.error is not None:
            self._fail(r, res.error if res is not None else RequestStateError("a request due a token got none this step"))
            return True
        r.history.append(res.token)
        r.output_ids.append(res.token)
        self.metrics.generated(r.cache_namespace.tenant)
        if r.t_first is None:
            r.t_first = now
            self.metrics.observe_ttft(now - r.t_submit)
        ev = r.event_for(res)
        if ev.finish_reason is not None:
            self._finish(r, ev)
            return True
        r.pending = res.token
        self._emit(r, ev)
        return False

    def _emit(self, r: Request, ev: TokenEvent) -> None:
        """Queue an event (under the state lock); `_deliver` sends it once the lock is released."""
        self._outbox.append((r, ev))

    def _deliver(self) -> None:
        """Send the queued events to their requests' sinks, in order, outside the state lock (a
        sink may detokenize, or cancel its request)."""
        with self._delivering:
            with self._state:
                batch, self._outbox = self._outbox, []
            if not batch:
                return
            for r, ev in batch:
                r.deliver(ev)
                if ev.finish_reason is not None:
                    r.closed = True
            with self._state:
                self._changed.notify_all()

    def _finish(self, r: Request, ev: TokenEvent) -> None:
        if r in self.running:
            self.running.remove(r)
        self.admission.release(r, keep=True)
        r.state, r.finish_reason = RequestState.DONE, ev.finish_reason
        self.metrics.requests_finished += 1
        self._forget(r)
        self._emit(r, ev)

    def _fail(self, r: Request, e: BaseException) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.admission.release(r)
        r.state, r.finish_reason = RequestState.DONE, "error"
        self.metrics.requests_failed += 1
        self._forget(r)
        self._emit(r, TokenEvent(None, "error", error=e))

    # ---------------------------------------------------------------- driver thread (server)
    def start(self) -> None:
        """Step in a thread of our own while there is work (a server; callers then only wait)."""
        with self._state:
            if self._driver is not None:
                return
            self._stop.clear()
            self._driver = threading.Thread(target=self._drive, name="metatp-scheduler", daemon=True)
            self._driver.start()

    def stop(self) -> None:
        with self._state:
            t, self._driver = self._driver, None
            self._stop.set()
            self._changed.notify_all()
        if t is not None:
            t.join(timeout=30)

    def _drive(self) -> None:
        while not self._stop.is_set():
            with self._state:
                while not (self.waiting or self.running or self._stop.is_set()):
                    self._changed.wait(timeout=1.0)
                if self._stop.is_set():
                    return
            try:
                if not self.step():
                    with self._state:          # e.g. only cancelled requests: wait for news
                        self._changed.wait(timeout=0.05)
            except BaseException as e:  # noqa: BLE001 -- the driver must outlive a bad step
                with self._state:
                    for r in list(self.running):
                        self._fail(r, e)
                    self._changed.notify_all()
                self._deliver()
