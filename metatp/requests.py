"""What `LLM.submit` hands back: a handle on one queued request, and the vLLM-shaped results.

A `RequestHandle` is the one way callers (`LLM.generate`, `score`, streaming, the completions
APIs, the HTTP server, the benches) hold a request: iterate it for its outputs as the engine
produces them, `cancel()` it, or wait for its `result()`. Leaving an iteration early cancels
the request, so a caller that stops listening never keeps cache cells busy.

The handle is the consumer's side of its request: the scheduler delivers token events to the
request's one sink, and the handle's `OutputProcessor` turns them into `StepOutput`s (text, stop
strings, logprobs) where the caller takes them -- in its iteration, or, with `on_output`, in the
sink the handle gives the request. A stop string ends the request here: the handle cancels it
(with finish reason "stop") and what the caller sees ends with that output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from metatp.ir.errors import ConfigError
from metatp.logprobs import Logprob, logprob_dict

if TYPE_CHECKING:
    from metatp.output_processor import OutputProcessor, StepOutput, TokenEvent
    from metatp.scheduler import Request, Scheduler

__all__ = ["CompletionOutput", "RequestOutput", "RequestHandle"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop" (EOS / stop string) or "length"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None      # per token: its Logprob and the top ones' (vLLM's)
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # with SamplingParams(prompt_logprobs=k)


class RequestHandle:
    """One request queued on a scheduler (see the module doc). With `on_output`, the outputs
    go to that callback (from the thread that runs the step, outside the scheduler's lock)
    instead of to an iterator: the handle then is the request's sink. Make the handle before
    the request is submitted."""

    def __init__(self, request: "Request", scheduler: "Scheduler", output: "OutputProcessor",
                 on_output: Callable[["StepOutput"], None] | None = None) -> None:
        self.request = request
        self._scheduler = scheduler
        self._output = output
        self._last: "StepOutput | None" = None     # the output that ended what the caller sees
        self._on_output = on_output
        if on_output is not None:
            request.sink = self._push

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def done(self) -> bool:
        return self._last is not None or self.request.done

    @property
    def finish_reason(self) -> str | None:
        return self._last.finish_reason if self._last is not None else self.request.finish_reason

    def cancel(self) -> None:
        """Stop the request; its cells are freed now, or at the next step boundary."""
        self._scheduler.cancel(self.request)

    def _take(self, ev: "TokenEvent") -> "StepOutput":
        """The caller's output of one event; a stop string in its text ends the request."""
        out = self._output.process(ev)
        if out.finish_reason is not None:
            self._last = out
            if ev.finish_reason is None:       # the request runs on: the consumer ends it
                self._scheduler.cancel(self.request, "stop")
        return out

    def _push(self, ev: "TokenEvent") -> None:
        if self._last is None:                 # nothing after the end the caller saw
            self._on_output(self._take(ev))

    def __iter__(self) -> Iterator["StepOutput"]:
        """The outputs until the last one (it carries finish_reason); a failed request raises its
        error here. Stopping early cancels the request."""
        if self._on_output is not None:
            raise ConfigError("this request's outputs go to its on_output callback; it cannot also be iterated")
        req = self.request
        try:
            while self._last is None:
                out = self._take(self._scheduler.next_event(req))
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            if not self.done:
                self._scheduler.cancel(req)

    def result(self) -> CompletionOutput:
        """Wait for the whole generation: its text, tokens, finish reason and logprobs."""
        ids: list[int] = []
        pieces: list[str] = []
        params = self.request.params
        lps: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        token_text = self._output.token_text if params.detokenize else None
        finish, reason = "length", None
        for step in self:
            if step.token is not None:
                ids.append(step.token)
                if lps is not None:
                    lps.append(logprob_dict(step.token, step.logprob, step.top_logprobs, token_text))
            pieces.append(step.text)
            if step.finish_reason:
                finish, reason = step.finish_reason, step.stop_reason
        cum = None if lps is None else float(sum(d[t].logprob for d, t in zip(lps, ids)))
        return CompletionOutput(self.index, "".join(pieces), ids, finish, reason, lps, cum)

    def logits(self) -> np.ndarray:
        """A scoring request's float32 logits [n_prompt, n_vocab] (waits for them)."""
        if self.request.kind != "score":
            raise ConfigError("logits() is for a scoring request (kind='score'); use result() for a generation")
        for out in self:
            if out.logits is not None:
                return out.logits
        raise ConfigError("the scoring request ended without logits")

    def hidden_states(self) -> np.ndarray:
        """An embedding request's float32 final hidden states [n_prompt, n_embd] (after the
        output norm, before the lm head; waits for them). `metatp.embeddings` pools them."""
        if self.request.kind != "embed":
            raise ConfigError("hidden_states() is for an embedding request (kind='embed')")
        for out in self:
            if out.hidden is not None:
                return out.hidden
        raise ConfigError("the embedding request ended without hidden states")
