"""What a client sees of a request, from its token ids: text pieces, stop strings, logprobs
(vLLM v1's OutputProcessor).

The scheduler delivers each request's `TokenEvent`s -- a token id with its logprob numbers and,
on the last one, the token-level reason it ended (an end-of-generation or stop token, max_tokens,
a completed constraint) -- to the request's one sink. The consumer's side of the request handle
(`metatp.requests.RequestHandle`) turns them into `StepOutput`s here: the token's text
(detokenized as a stream, so a character split over tokens comes out whole), stop strings, and
the logprobs as the answers carry them. A stop string ends the request on this side: the handle
cancels it, as vLLM's output processor aborts one. None of this runs under the scheduler's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from metatp.penalties import release_unstopped

__all__ = ["OutputProcessor", "StepOutput", "StopMatcher", "TokenEvent"]


class StopMatcher:
    """Finds stop strings in generated text, holding back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""          # text seen but not yet released

    def feed(self, piece: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string hit or None)."""
        self.text += piece
        if self.stops:
            hits = [(self.text.find(s), s) for s in self.stops if s in self.text]
            if hits:
                pos, s = min(hits)
                out, self.text = self.text[:pos], ""
                return out, s
        if self.hold <= 0:
            out, self.text = self.text, ""
            return out, None
        cut = len(self.text)
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                cut = len(self.text) - k
                break
        out, self.text = self.text[:cut], self.text[cut:]
        return out, None

    def flush(self) -> str:
        out, self.text = self.text, ""
        return out


@dataclass
class StepOutput:
    """What one request got from one step: a token and its text, or the end (finish_reason),
    or an error; `logprob`/`top_logprobs` when asked for; `logits` for a scored prompt."""

    token: int | None
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    logits: np.ndarray | None = None
    error: BaseException | None = None


@dataclass
class TokenEvent:
    """What the scheduler delivers to a request's sink: a token (with its logprob numbers where
    asked), and on the last event why the request ended (`finish_reason`; `stop_reason`: the stop
    token id; `end_token`: the token is an end-of-generation or stop token); or a scored prompt's
    `logits`, or the `error` that failed it (no token)."""

    token: int | None
    finish_reason: str | None = None
    stop_reason: int | None = None
    end_token: bool = False
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    logits: np.ndarray | None = None
    error: BaseException | None = None


class OutputProcessor:
    """One request's outputs: its stream decoder, stop matcher and token count."""

    def __init__(self, params: Any, tokenizer: Any) -> None:
        from metatp.ir.tokenizer import StreamDecoder

        self.stops = StopMatcher(params.stop or [])
        self.decoder = StreamDecoder(tokenizer, skip_special=params.skip_special_tokens)
        self.token_text = tokenizer.token_text      # one token's text, for logprobs
        self.min_tokens = params.min_tokens
        self.n = 0                      # tokens processed so far

    def process(self, ev: TokenEvent) -> StepOutput:
        """The output of one event. A stop string found in the text ends the output here
        (finish_reason "stop", stop_reason the string) though the event did not end the request:
        the caller then cancels it."""
        if ev.token is None:
            return StepOutput(None, "", ev.finish_reason, ev.stop_reason, logits=ev.logits, error=ev.error)
        tok, lp, top = ev.token, ev.logprob, ev.top_logprobs
        self.n += 1
        dec, stops = self.decoder, self.stops
        if ev.end_token:
            return StepOutput(tok, stops.feed(dec.flush())[0] + stops.flush(), "stop", ev.stop_reason, lp, top)
        text, hit = self._feed(dec.push(tok), self.n)
        if hit is not None:
            return StepOutput(tok, text, "stop", hit, lp, top)
        if ev.finish_reason is not None:          # max_tokens, or the constraint is complete
            tail, hit = self._feed(dec.flush(), self.n)
            return StepOutput(tok, text + tail + (stops.flush() if hit is None else ""),
                              "stop" if hit is not None else ev.finish_reason, hit, lp, top)
        return StepOutput(tok, text, None, None, lp, top)

    def _feed(self, piece: str, n: int) -> tuple[str, str | None]:
        """The stop matcher's answer for the text of token n; none stops before min_tokens (vLLM)."""
        return self.stops.feed(piece) if n > self.min_tokens else (release_unstopped(self.stops, piece), None)
