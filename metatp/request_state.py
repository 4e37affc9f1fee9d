"""One request as the scheduler keeps it (`metatp.scheduler`), and the context-length rule.

A `Request` is one sample being generated (or one prompt being scored or embedded, `PROMPT_KINDS`):
its token ids, counts, the state it is in (`RequestState`) and the cells it holds; what it may
hold is `context_budget`'s. Which requests get cells is `metatp.admission`'s, the steps that feed
them `metatp.scheduler`'s (which names these too, for its importers).
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from typing import Callable, Iterable

import numpy as np

from metatp.ir.errors import ContextOverflowError
from metatp.kv_cells import SeqCells
from metatp.output_processor import TokenEvent
from metatp.prefix_cache import Namespace
from metatp.runner import TokenResult
from metatp.sampling import SamplingParams

__all__ = ["Request", "RequestState", "context_budget", "PROMPT_KINDS"]

# request kinds that run their prompt only and end with what it gives: "score" (the logits of every
# position) and "embed" (the final hidden state of every position, `metatp.embeddings` pools them)
PROMPT_KINDS = ("score", "embed")


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
