"""Continuous batching: many requests share every engine step (vLLM's scheduler, llama-server's slots).

A `Request` is one sample being generated (or one prompt being scored). Requests wait in a
FIFO queue; at each step boundary the scheduler admits the oldest ones while a slot
(`max_num_seqs`) and cells for the prompt and its next token are free. Cells come on demand
(`metatp.kv_demand`): each decoding request gets a page more as it needs it; when the cache has
none, the most recently admitted running request is preempted (its cells freed, its tokens and
sampler state kept, queued first) and later re-prefilled as first computed, so its client sees
one stream and the tokens of a run alone. A step that preempts admits nothing. With the prefix
cache (`metatp.prefix_cache`, on by default) a request begins with the cached blocks its prompt
starts with and prefills only the rest; an ending one leaves its blocks there.
What one request may hold is bounded by one rule (`context_budget`): the cache's n_ctx, and a
per-request cap `max_model_len` (a server's n_ctx / parallel by default, llama-server's slot).
One step carries the next token of every decoding request plus
chunks of admitted prompts, up to `n_batch` tokens (chunked prefill); each request samples
from its own logits with its own random generator, stop strings and limits, so its tokens do
not depend on who shares its steps. The scheduler works on token ids: each sampled token's text,
stop strings and logprobs come from the request's `OutputProcessor` (`metatp.output_processor`),
run by the stepping thread outside the state lock that other threads wait on.

Steps are driven cooperatively: a caller waiting for its request's next output runs a step
itself (one thread at a time; the others wait for the step lock, then find their outputs
delivered), so the library needs no thread of its own. A server starts one driver thread
(`start`) that steps while there is work, and requests get their outputs through callbacks.
Cancelled requests (a closed stream, a client gone) are dropped, and their cells freed, at the
next step boundary.

Under MPI one mechanism keeps the ranks in lock step, for a server and for a program every rank
runs alike (`LLM.generate` under `mpiexec`): only rank 0 has a working scheduler, and it *leads*
(`Scheduler.lead`): before each step it posts the step to the other ranks as a `StepBatch` --
the KV cell operations since the last step and the step's items -- and those ranks, which never
step a scheduler, run exactly the same `Engine.run` (`metatp.lockstep`; cells taken, grown and
freed travel in the batch). Tokens are sampled on rank 0 only and nothing is agreed per step;
what a call returns reaches the other ranks through `metatp.mpi_calls`.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from metatp.backends.candidates import RowCandidates
from metatp.engine import Engine, StepItem
from metatp.ir.errors import ConfigError, ContextOverflowError, MetatpError, NumericalError, UnsupportedOpError
from metatp.kv_cells import SeqCells
from metatp.kv_demand import CellDemand, prefill_chunk
from metatp.lockstep import Leader
from metatp.metrics import Metrics
from metatp.output_processor import OutputProcessor, StepOutput, StopMatcher
from metatp.sampling import CandidateSpec, Sampler, SamplingParams
from metatp.structured import MaskPrefetch, make_guide

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["Request", "StepOutput", "Scheduler", "QueueFullError", "StopMatcher", "check_logits", "Metrics",
           "context_budget"]


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


def check_logits(logits: np.ndarray, what: str) -> None:
    """NaN or infinite logits mean a broken model (NaN weights, overflowing hyper-parameters);
    sampling them would silently give token 0. One max is cheap next to a forward step."""
    top = float(np.max(logits))
    if not math.isfinite(top):
        bad = "NaN" if math.isnan(top) or np.isnan(logits).any() else "infinite"
        raise NumericalError(f"the model computed {bad} logits {what}; the model file is broken "
                             "(NaN/inf weights or hyper-parameters that overflow)")


class Request:
    """One sample of one prompt (or one prompt to score) and everything it carries between steps."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, rng: np.random.Generator, tokenizer,
                 n_ctx: int, kind: str = "generate", index: int = 0, max_model_len: int | None = None,
                 on_event: Callable[["Request", StepOutput], None] | None = None) -> None:
        budget = context_budget(len(prompt_ids), n_ctx, max_model_len)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.kind = kind
        self.index = index
        self.on_event = on_event
        self.max_new = budget if params.max_tokens is None else min(params.max_tokens, budget)
        if kind == "score":
            self.max_new = 0
        self.n_cells = len(prompt_ids) + max(self.max_new - 1, 0)
        self.output = OutputProcessor(params, tokenizer, self.max_new)     # token ids -> text, stops, logprobs
        self.sampler = Sampler(params, rng, end_ids=self.output.end_ids, n_vocab=tokenizer.n_vocab)
        self.constraint = make_guide(params, tokenizer) if params.constraint is not None else None   # structured output
        # what the row it samples from is read as: "argmax" when the pick is the greedy token of
        # the raw logits and nothing else is reported (no penalty, bias, constraint or logprobs),
        # so a vocabulary split is never gathered for it; a CandidateSpec where each device's
        # top candidates can cover the pick (metatp.sampling); else "last"
        plain = (params.greedy and params.logprobs is None and not params.penalized
                 and params.repetition_penalty == 1.0 and self.constraint is None)
        spec = self.sampler.candidate_spec(tokenizer.n_vocab) if self.constraint is None else None
        self._wants = "argmax" if plain else spec or "last"
        self.state = "waiting"                # waiting | prefill | decode | done
        self.seq: SeqCells | None = None
        self.n_fed = 0                         # prompt tokens already in the cache
        self.n_reused = 0                      # ... of them found in the prefix cache (kv_demand)
        self.pending: int | None = None        # the sampled token the next step feeds
        self.refill: list[int] | None = None   # after a preemption: the tokens to prefill again (kv_demand)
        self.history = list(prompt_ids)
        self.output_ids: list[int] = []
        self.score_rows: list[np.ndarray] = []
        self.events: collections.deque[StepOutput] = collections.deque()
        self.cancelled = False
        self.finish_reason: str | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def wants(self) -> str | CandidateSpec:
        """This step's logits mode (a CandidateSpec carries this step's penalties)."""
        w = self._wants
        return w if isinstance(w, str) else self.sampler.step_spec(w, self.output_ids)

    def sample(self, logits: np.ndarray) -> int:
        """The next token from this request's logits (NumericalError for NaN/inf logits), or from
        the candidates the engine read for it (`RowCandidates`: they cover the pick, all finite)."""
        if isinstance(logits, RowCandidates):
            return self.sampler.from_candidates(logits)
        check_logits(logits, f"after {len(self.history)} tokens")
        allowed = self.constraint.allowed() if self.constraint is not None else None
        return self.sampler(logits, self.history, self.output_ids, allowed)

    def accept(self, logits: np.ndarray, tok: int | None = None) -> StepOutput:
        """Take the next token (sampled here unless given): its output, and whether the request
        ends here. Runs on the stepping thread outside the scheduler's state lock."""
        if tok is None:
            tok = self.sample(logits)
        self.history.append(tok)
        self.output_ids.append(tok)
        complete = self.constraint is not None and self.constraint.consume(tok)     # the constrained output is whole
        out = self.output.process(tok, logits, len(self.output_ids), complete)
        if out.finish_reason is None:
            self.pending = tok
        return out


def _output(r: Request, logits: np.ndarray | int | None,
            pick: int | BaseException | None) -> StepOutput | BaseException | None:
    """The output of the token `pick` gives `r` this step (`Request.accept`: text, stop strings,
    logprobs), run outside the scheduler's state lock; the error instead; None: no token."""
    if pick is None or isinstance(pick, BaseException):
        return pick
    try:
        return r.accept(logits, pick)
    except Exception as e:  # noqa: BLE001 -- e.g. a broken model's logits: this request fails
        return e


class Scheduler:
    """Admits, batches and steps requests over one engine (see the module doc)."""

    def __init__(self, engine: Engine, max_num_seqs: int = 16, max_waiting: int | None = None,
                 n_batch: int | None = None, prefix_caching: bool = True) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.n_batch = n_batch or engine.n_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._state = threading.Lock()
        self._changed = threading.Condition(self._state)    # work arrived / outputs delivered
        self._step_lock = threading.Lock()
        self._driver: threading.Thread | None = None
        self._stop = threading.Event()
        self.metrics = Metrics()
        self._leader: Leader | None = None     # under MPI, serving: rank 0 posts every step (`lead`)
        # KV cells on demand and recompute preemption (metatp.kv_demand)
        self.demand = CellDemand(engine.cells, self._post, self._release, self.metrics, prefix_caching)
        self.masks = MaskPrefetch()

    def lead(self, world: "World") -> Leader:
        """Drive every rank of `world` from here (rank 0; `LLM` calls it): each step is posted to
        the other ranks (`metatp.lockstep.Follower`) before it runs, and tokens are sampled here
        only. Call before the first step; again with the same world: the same Leader."""
        if world.rank != 0:
            raise ConfigError(f"only rank 0 leads the steps; rank {world.rank} follows (metatp.lockstep.follow)")
        if self._leader is None or self._leader.world is not world:
            self._leader = Leader(world)
        return self._leader

    def _post(self, op: tuple) -> None:
        if self._leader is not None:
            self._leader.ops.append(op)

    def stop_leading(self) -> None:
        """Tell the followers that no step will come (after the driver thread has stopped)."""
        if self._leader is not None:
            self._leader.stop()

    # ---------------------------------------------------------------- requests
    def submit(self, req: Request) -> None:
        """Queue a request (QueueFullError when the bounded waiting queue is full)."""
        if req.n_cells > self.engine.n_ctx:
            raise ContextOverflowError(f"{req.n_cells} tokens do not fit in the context of {self.engine.n_ctx}")
        with self._state:
            if req.kind != "score" and req.max_new == 0:
                self.metrics.requests_accepted += 1
                self._finish(req, StepOutput(None, "", "length"))
                return
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise QueueFullError(f"the server is busy: {len(self.waiting)} requests are waiting "
                                     f"(--max-waiting {self.max_waiting}); retry later")
            req.t_submit = time.perf_counter()
            self.metrics.requests_accepted += 1
            self.waiting.append(req)
            self._changed.notify_all()

    def cancel(self, req: Request) -> None:
        """Stop a request; its cells are freed at the next step boundary (or now, if it waits)."""
        with self._state:
            if req.done:
                return
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                req.state = "done"
                req.finish_reason = "cancelled"
                self.metrics.requests_cancelled += 1
            self._changed.notify_all()

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
                r.state, r.finish_reason = "done", "error"
                self.metrics.requests_failed += 1
                self._emit(r, StepOutput(None, "", "error", error=err))
            self._changed.notify_all()
            return len(reqs)
        finally:
            self._state.release()

    def next_event(self, req: Request, timeout: float | None = None) -> StepOutput:
        """The request's next output, stepping the engine while it has none (see the module doc)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._state:
                if req.events:
                    return req.events.popleft()
                if req.done:
                    raise UnsupportedOpError("the request has ended and has no more outputs")
                if self._driver is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("no output within the timeout")
                    self._changed.wait(timeout=left if left is not None else 1.0)
                    continue
            if not self.step() :
                with self._state:
                    if not req.events and not req.done and not self._step_lock.locked():
                        raise UnsupportedOpError("the scheduler has nothing to run but a request is unfinished")

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
            items, reqs = self._compose()
            if not items:
                return False
            self.masks.start([r.constraint for r, it in zip(reqs, items)
                              if r.constraint is not None and self._samples_now(r, it)])
            try:
                outs = self.engine.run(items) if self._leader is None else self._leader.run(self.engine, items)
            except Exception as e:                  # the pass is lost: its requests fail, others go on
                with self._state:
                    for r in reqs:
                        self._fail(r, e)
                return True
            finally:
                self.masks.wait()                   # structured output's masks, computed during the pass
            picks = self._sample(reqs, items, outs)
            results = [_output(r, logits, pick) for r, logits, pick in zip(reqs, outs, picks)]   # outside the lock
            now = time.perf_counter()
            with self._state:
                m = self.metrics
                m.steps += 1
                m.max_step_seqs = max(m.max_step_seqs, len(reqs))
                m.step_seqs_hist[len(reqs)] += 1
                for r, it, logits, res in zip(reqs, items, outs, results):
                    self._advance(r, it, logits, res, now)
                self._changed.notify_all()
            return True

    @staticmethod
    def _samples_now(r: Request, it: StepItem) -> bool:
        """Does this step's item give its request a token (a decode step, or the prompt's last chunk)?"""
        if r.kind == "score":
            return False
        return r.state == "decode" or (r.refill is None and r.n_fed + len(it.tokens) == len(r.prompt_ids))

    def _sample(self, reqs: list[Request], items: list[StepItem],
                outs: list[np.ndarray | None]) -> list[int | BaseException | None]:
        """Per request, the token this step gives it, the error sampling raised, or None (no token
        this step). Under MPI this runs on rank 0 only (it leads), so nothing is agreed."""
        picks: list[int | BaseException | None] = []
        for r, it, logits in zip(reqs, items, outs):
            if not self._samples_now(r, it):
                picks.append(None)
                continue
            if isinstance(logits, int):          # "argmax": the engine read the greedy token itself
                picks.append(logits)
                continue
            try:
                picks.append(r.sample(logits))
            except Exception as e:  # noqa: BLE001 -- a broken model's logits: this request fails
                picks.append(e)
        return picks

    def _compose(self) -> tuple[list[StepItem], list[Request]]:
        """Admit what fits, then the step's items: decode tokens first, then prompt chunks (FIFO)."""
        with self._state:
            for r in [r for r in self.running if r.cancelled]:
                self.running.remove(r)
                self._release(r, keep=True)
                r.state, r.finish_reason = "done", "cancelled"
                self.metrics.requests_cancelled += 1
            preempted = self.demand.make_room(self.running, self.waiting)
            while self.waiting and len(self.running) < self.max_num_seqs and not preempted:
                r = self.waiting[0]     # no admission in a step that preempted (vLLM): it would take their cells
                seq = self.demand.admit(r, alone=not self.running)
                if seq is None:
                    break
                self.waiting.popleft()
                r.seq, r.state = seq, "prefill"
                self.running.append(r)
            items: list[StepItem] = []
            reqs: list[Request] = []
            budget = self.n_batch
            for r in self.running:
                if r.state == "decode":
                    items.append(StepItem(r.seq, [r.pending], r.wants))
                    reqs.append(r)
                    budget -= 1
            for r in self.running:
                if r.state != "prefill" or budget <= 0:
                    continue
                chunk = prefill_chunk(r, budget, self.engine.small_rows)
                last = r.refill is None and r.n_fed + len(chunk) == len(r.prompt_ids)   # a refill samples nothing
                items.append(StepItem(r.seq, chunk, "all" if r.kind == "score" else r.wants if last else "none"))
                reqs.append(r)
                budget -= len(chunk)
            return items, reqs

    def _advance(self, r: Request, it: StepItem, logits: np.ndarray | None, out: StepOutput | BaseException | None,
                 now: float) -> None:
        """Deliver one step's result to its request (under the state lock); `out`: the output of
        the token it got (`_output`), the error sampling or processing raised, or None."""
        if r.state == "prefill":
            r.n_fed += len(it.tokens)
            if r.refill is not None:
                self.metrics.recomputed_tokens += len(it.tokens)
                if r.n_fed == len(r.refill):          # recomputed: decoding resumes at the pending token
                    r.refill, r.state = None, "decode"
                return
            self.metrics.prompt_tokens += len(it.tokens)
            if r.kind == "score":
                r.score_rows.append(logits)
                if r.n_fed == len(r.prompt_ids):
                    out = np.concatenate(r.score_rows, axis=0)
                    try:
                        check_logits(out, f"for a sequence of {len(r.prompt_ids)} tokens")
                    except Exception as e:  # noqa: BLE001 -- delivered to the caller
                        self._fail(r, e)
                        return
                    self._finish(r, StepOutput(None, "", "stop", logits=out))
                return
            if r.n_fed < len(r.prompt_ids):
                return
            r.state = "decode"
        if isinstance(out, BaseException) or out is None:
            self._fail(r, out or UnsupportedOpError("a request due a token got none this step"))
            return
        self.metrics.generated_tokens += 1
        if r.t_first is None:
            r.t_first = now
            self.metrics.observe_ttft(now - r.t_submit)
        if out.finish_reason is not None:
            self._finish(r, out)
        else:
            self._emit(r, out)

    def _emit(self, r: Request, out: StepOutput) -> None:
        r.events.append(out)
        if r.on_event is not None:
            r.on_event(r, out)

    def _finish(self, r: Request, out: StepOutput) -> None:
        if r in self.running:
            self.running.remove(r)
        self._release(r, keep=True)
        r.state, r.finish_reason = "done", out.finish_reason
        self.metrics.requests_finished += 1
        self._emit(r, out)

    def _fail(self, r: Request, e: BaseException) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.state, r.finish_reason = "done", "error"
        self.metrics.requests_failed += 1
        self._emit(r, StepOutput(None, "", "error", error=e))

    def _release(self, r: Request, keep: bool = False) -> None:
        """Free `r`'s cells; `keep`: its whole blocks stay in the prefix cache (it did not fail)."""
        if r.seq is not None:
            self.demand.retire(r, keep)
            if not r.seq.freed:
                self._post(("free", r.seq.id))
            self.engine.free(r.seq)

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
