"""Continuous batching: many requests share every engine step (vLLM's scheduler, llama-server's slots).

A `Request` is one sample being generated (or one prompt being scored or embedded). Requests wait in a
FIFO queue; at each step boundary the scheduler admits the oldest ones while a slot
(`max_num_seqs`) and cells for the prompt and its next token are free. Cells come on demand
(`metatp.kv_demand`): each decoding request gets a page more as it needs it; when the cache has
none, the most recently admitted running request is preempted (`Scheduler.preempt`: its cells
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
import enum
import itertools
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from metatp.ir.errors import ConfigError, ContextOverflowError, MetatpError, RequestStateError
from metatp.kv_cells import SeqCells
from metatp.kv_demand import CellDemand
from metatp.lockstep import Leader
from metatp.metrics import Metrics
from metatp.output_processor import TokenEvent
from metatp.prefix_cache import Namespace
from metatp.runner import ModelRunner, Purpose, ScheduledItem, TokenResult
from metatp.sampling import SamplingParams
from metatp.speculative import Speculator

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["Request", "RequestState", "TokenEvent", "Scheduler", "QueueFullError", "Metrics", "context_budget",
           "PROMPT_KINDS"]

# request kinds that run their prompt only and end with what it gives: "score" (the logits of every
# position) and "embed" (the final hidden state of every position, `metatp.embeddings` pools them)
PROMPT_KINDS = ("score", "embed")


class QueueFullError(MetatpError):
    """The waiting queue is full (a server answers 503 / 429): try again later."""


def context_budget(n_prompt: int, n_ctx: int, max_model_len: int | None = None) -> int:
    """The one context-length rule: how many tokens a sequence with an `n_prompt`-token prompt
    may generate. The cache holds n_ctx cells and the last token needs none of its own
    (n_ctx - n_prompt + 1). A per-request cap `max_model_len` bounds prompt + completion
    (vLLM's meaning; llama-server's n_ctx/np slot). A prompt past either is a ContextOverflowError."""
    if max_model_len is not None and n_prompt > max_model_len:
        raise ContextOverflowError(
            f"the prompt has {n_prompt} tokens but a request may hold at most {max_model_len} "
            "(max_model_len); shorten the prompt or raise --max-model-len")
    if n_prompt > n_ctx:
        raise ContextOverflowError(
            f"the prompt has {n_prompt} tokens but the context holds {n_ctx} (n_ctx); "
            "shorten the prompt or raise n_ctx")
    budget = n_ctx - n_prompt + 1
    return budget if max_model_len is None else min(budget, max_model_len - n_prompt)


class RequestState(str, enum.Enum):
    """Where a request is (a str, so that it reads and compares as its name)."""

    WAITING = "waiting"     # queued (or preempted, queued first)
    PREFILL = "prefill"     # admitted: its prompt (or a preemption's refill) is being fed
    DECODE = "decode"       # one token a step
    DONE = "done"           # finished, failed or cancelled

    def __str__(self) -> str:
        return self.value


_request_ids = itertools.count()


class Request:
    """One sample of one prompt (or one prompt to score or embed, `PROMPT_KINDS`): its token ids, counts and state.

    `eog_ids`: the model's end-of-generation tokens (ignored with ignore_eos). `sink`: where its
    `TokenEvent`s go (from the stepping thread, outside the state lock); without one they queue
    on `events` for `Scheduler.next_event`. One or the other, never both. `tenant`: who sent it
    (the server's API-key tenant; None: anonymous): with params.cache_salt, the prefix-cache
    namespace it may reuse blocks from and keeps its own in."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, rng: np.random.Generator, n_ctx: int,
                 kind: str = "generate", index: int = 0, max_model_len: int | None = None,
                 eog_ids: Iterable[int] = (), sink: Callable[[TokenEvent], None] | None = None,
                 tenant: str | None = None) -> None:
        budget = context_budget(len(prompt_ids), n_ctx, max_model_len)
        self.id = next(_request_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.rng = rng
        self.kind = kind
        self.index = index
        self.sink = sink
        self.cache_namespace = Namespace(tenant, params.cache_salt)   # whose cached prefixes it may reuse
        self.max_new = budget if params.max_tokens is None else min(params.max_tokens, budget)
        if kind in PROMPT_KINDS:
            self.max_new = 0
        self.n_cells = len(prompt_ids) + max(self.max_new - 1, 0)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.end_ids = self.stop_ids | frozenset(() if params.ignore_eos else eog_ids)   # min_tokens holds them back
        self.state = RequestState.WAITING
        self.seq: SeqCells | None = None
        self.n_fed = 0                         # prompt tokens already in the cache
        self.n_reused = 0                      # ... of them found in the prefix cache (CellDemand.admit)
        self.pending: int | None = None        # the sampled token the next step feeds
        self.refill: list[int] | None = None   # after a preemption: the tokens to prefill again (`requeue`)
        self.history = list(prompt_ids)
        self.output_ids: list[int] = []
        self.events: collections.deque[TokenEvent] = collections.deque()
        self.cancelled: str | None = None      # the finish reason a cancel gives ("cancelled", "stop")
        self.closed = False                    # ended, and its last event delivered
        self.finish_reason: str | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None

    @property
    def done(self) -> bool:
        return self.state is RequestState.DONE

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill feeds: its prompt, or after a preemption its prompt and generated
        tokens but the pending one (`refill`), whose cell the next decode step writes."""
        return self.prompt_ids if self.refill is None else self.refill

    def prefill_chunk(self, budget: int, small_rows: int) -> list[int]:
        """The next at most `budget` tokens of its prefill. A refill is computed as it was first:
        its prompt part apart, its generated part in passes of at most `small_rows` rows (the
        backend's few-token path, where a row's sums do not depend on the pass, as in a decode
        step), so its cells get the bits they had and its next logits are those of a run never
        preempted."""
        ids, end = self.prefill_ids, self.n_fed + budget
        if self.refill is not None:
            n = len(self.prompt_ids)
            end = min(end, n) if self.n_fed < n else min(end, self.n_fed + small_rows)
        return ids[self.n_fed:end]

    def requeue(self) -> None:
        """Back to waiting after a recompute preemption (`Scheduler.preempt`), its cells freed:
        a decoding request prefills its prompt and generated tokens but the pending one again."""
        if self.state is RequestState.DECODE:
            self.refill = self.history[:-1]
        self.seq, self.n_fed, self.state = None, 0, RequestState.WAITING

    def deliver(self, ev: TokenEvent) -> None:
        """Send one event down the request's one channel."""
        if self.sink is not None:
            self.sink(ev)
        else:
            self.events.append(ev)

    def event_for(self, res: TokenResult) -> TokenEvent:
        """The event of the token `res` just gave this request (already in `output_ids`), ending
        it on the token-level rules: an end token (EOS unless ignore_eos, stop_token_ids), a
        complete constraint, max_tokens."""
        tok = res.token
        if tok in self.end_ids:
            return TokenEvent(tok, "stop", tok if tok in self.stop_ids else None, True, res.logprob, res.top_logprobs)
        finish = "stop" if res.complete else "length" if len(self.output_ids) >= self.max_new else None
        return TokenEvent(tok, finish, None, False, res.logprob, res.top_logprobs)


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
        # KV cells on demand (metatp.kv_demand); which request waits or is preempted is decided here
        self.demand = CellDemand(engine.cells, self.metrics, prefix_caching)
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
                        self._release(req, keep=True)
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
                self._release(r, keep=True)
                self._end_cancelled(r)
            preempted = self._make_room()
            while self.waiting and len(self.running) < self.max_num_seqs and not preempted:
                r = self.waiting[0]     # no admission in a step that preempted (vLLM): it would take their cells
                seq = self.demand.admit(r.prefill_ids, r.n_cells, alone=not self.running, cached=r.kind not in PROMPT_KINDS,
                                        namespace=r.cache_namespace)
                if seq is None:
                    break
                self.waiting.popleft()
                r.seq, r.state = seq, RequestState.PREFILL
                r.n_fed = r.n_reused = seq.n_past         # positions found in the prefix cache
                self.running.append(r)
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

    def _make_room(self) -> bool:
        """Give every decoding request (oldest first) a cell for the token it feeds this step;
        while the cache has none, preempt the most recently admitted running request (possibly
        the one growing). Returns whether anything was preempted."""
        preempted = False
        for r in list(self.running):
            while r.state is RequestState.DECODE and not self.demand.grow(r.seq, r.n_cells, len(self.running) > 1):
                self.preempt(self.running.pop())
                preempted = True
        return preempted

    def preempt(self, r: Request) -> None:
        """Recompute preemption (vLLM's) of `r`, already out of the running list: its cells are
        freed (their whole blocks kept in the prefix cache), its tokens and sampling state kept,
        and it waits first in line; re-admitted, it prefills its prompt and generated tokens but
        the pending one as they were first computed, and decodes on from the pending token, so
        its client sees one stream."""
        self._release(r, keep=True)
        if r.state is RequestState.PREFILL and r.refill is None:   # a prompt cut short: counted once, when fed again
            self.metrics.prompt_tokens -= r.n_fed - r.n_reused
            self.metrics.recomputed_tokens += r.n_fed - r.n_reused
        r.requeue()
        self.waiting.appendleft(r)
        self.metrics.preemptions += 1

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
        self._release(r, keep=True)
        r.state, r.finish_reason = RequestState.DONE, ev.finish_reason
        self.metrics.requests_finished += 1
        self._forget(r)
        self._emit(r, ev)

    def _fail(self, r: Request, e: BaseException) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.state, r.finish_reason = RequestState.DONE, "error"
        self.metrics.requests_failed += 1
        self._forget(r)
        self._emit(r, TokenEvent(None, "error", error=e))

    def _release(self, r: Request, keep: bool = False) -> None:
        """Free `r`'s cells; `keep`: its whole blocks stay in the prefix cache (it did not fail).
        An embedded input's never do: embedding inputs are rarely prompts again, and would push
        out prefixes that are."""
        keep = keep and r.kind != "embed"
        if r.seq is not None:
            self.demand.free(r.seq, r.history if keep else None, r.cache_namespace)

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
