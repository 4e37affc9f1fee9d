"""What a client sees of a request, from its token ids: text pieces, stop strings, logprobs
(vLLM v1's OutputProcessor).

The scheduler delivers each request's `TokenEvent`s -- a token id with its logprob numbers and,
on the last one, the token-level reason it ended (an end-of-generation or stop token, max_tokens,
a completed constraint) -- to the request's one sink. The consumer's side of the request handle
(`metatp.requests.RequestHandle`) turns them into `StepOutput`s here: the token's text
(detokenized as a stream, so a character split over tokens comes out whole), stop strings, and
the logprobs as the answers carry them. A stop string ends the request on this side: the handle
cancels it, as vLLM's output processor aborts one. None of this runs under the scheduler's lock.

Logprobs list exactly the tokens of the returned text: each output's `tokens` are the tokens its
text is made of, their texts joined being that text. Text is given out a whole token at a time
(a token whose character is unfinished, or whose text could start a stop string, waits with its
text). An end-of-generation or stop token adds no text: it is listed with the empty text (its
logprob is the answer's last, as vLLM and OpenAI list it: lm-evaluation-harness reads a scored
prompt's logprobs as the prompt's plus exactly one generated token's). The tokens of a matched
stop string are not listed; one that begins inside a token cuts the text there (as vLLM does) and
that token is listed with its text before the stop: the logprob is the whole token's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from metatp.penalties import release_unstopped

__all__ = ["OutputProcessor", "StepOutput", "StopMatcher", "TokenEvent", "TokenText"]


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
class TokenText:
    """A generated token as the returned text holds it: the text it adds there, and its logprob
    and top alternatives (when asked for). What logprobs list, one entry each."""

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class StepOutput:
    """What one request got from one step: a token and its text, or the end (finish_reason),
    or an error; `logprob`/`top_logprobs` when asked for; `logits` for a scored prompt.
    `tokens`: the tokens this output's text is made of (their texts join to `text`; the step's
    own token may wait for a later output; an end token is listed with "", a stop string's not)."""

    token: int | None
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    logits: np.ndarray | None = None
    error: BaseException | None = None
    hidden: np.ndarray | None = None        # an embedded prompt's final hidden states
    tokens: list[TokenText] = field(default_factory=list)


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
    hidden: np.ndarray | None = None        # an embedded prompt's final hidden states [n_prompt, n_embd]


class OutputProcessor:
    """One request's outputs: its stream decoder, stop matcher, token count, and the tokens whose
    text is not given out yet."""

    def __init__(self, params: Any, tokenizer: Any) -> None:
        from metatp.ir.tokenizer import StreamDecoder

        self.stops = StopMatcher(params.stop or [])
        self.decoder = StreamDecoder(tokenizer, skip_special=params.skip_special_tokens)
        self.token_text = tokenizer.token_text      # one token's text, for logprobs
        self.min_tokens = params.min_tokens
        self.n = 0                      # tokens processed so far
        self.held: list[TokenText] = []     # tokens whose text is not all given out yet, in order
        self.ready = ""                 # text the stop matcher released, not given out yet (held tokens' start)

    def process(self, ev: TokenEvent) -> StepOutput:
        """The output of one event. A stop string found in the text ends the output here
        (finish_reason "stop", stop_reason the string) though the event did not end the request:
        the caller then cancels it."""
        if ev.token is None:
            return StepOutput(None, "", ev.finish_reason, ev.stop_reason, logits=ev.logits, error=ev.error,
                              hidden=ev.hidden)
        tok, lp, top = ev.token, ev.logprob, ev.top_logprobs
        self.n += 1
        dec, stops = self.decoder, self.stops
        if ev.end_token:                        # adds no text of its own: listed with ""
            text, hit = stops.feed(self._tail())
            out = self._give(tok, text + (stops.flush() if hit is None else ""), "stop", ev.stop_reason, lp, top)
            if hit is None:                     # after a stop string it is one of the tokens dropped
                out.tokens.append(TokenText(tok, "", lp, top))
            return out
        piece = dec.push(tok)
        self.held.append(TokenText(tok, piece, lp, top))
        text, hit = self._feed(piece, self.n)
        if hit is not None:
            return self._give(tok, text, "stop", hit, lp, top)
        if ev.finish_reason is not None:          # max_tokens, or the constraint is complete
            tail, hit = self._feed(self._tail(), self.n)
            return self._give(tok, text + tail + (stops.flush() if hit is None else ""),
                              "stop" if hit is not None else ev.finish_reason, hit, lp, top)
        return self._give(tok, text, None, None, lp, top)

    def _tail(self) -> str:
        """The decoder's last text (an unfinished character as U+FFFD), the last held token's."""
        tail = self.decoder.flush()
        if tail and self.held:          # held: the token whose character was unfinished waits (_give)
            self.held[-1].text += tail
        return tail

    def _give(self, tok: int, released: str, finish: str | None, reason: str | int | None, lp: float | None,
              top: dict[int, float] | None) -> StepOutput:
        """The output of `released` text (the stop matcher's), given out a whole token at a time:
        the held tokens whose text it covers go out with theirs, the rest waits (a token whose
        character is unfinished waits too). At the end (`finish`), what was released goes out:
        a token it ends inside of (a stop string begins there) with its part before the stop;
        the tokens after (the stop string's) are dropped."""
        ready, held = self.ready + released, self.held
        at = k = 0
        while k < len(held) and at + len(held[k].text) <= len(ready):
            if finish is None and k == len(held) - 1 and self.decoder.holds_partial:
                break
            at += len(held[k].text)
            k += 1
        given = held[:k]
        if finish is None:
            self.held, self.ready = held[k:], ready[at:]
            return StepOutput(tok, ready[:at], None, None, lp, top, tokens=given)
        if at < len(ready) and k < len(held):       # the text ends inside this token: a stop string begins there
            given.append(replace(held[k], text=ready[at:]))
        self.held, self.ready = [], ""
        return StepOutput(tok, ready, finish, reason, lp, top, tokens=given)

    def _feed(self, piece: str, n: int) -> tuple[str, str | None]:
        """The stop matcher's answer for the text of token n; none stops before min_tokens (vLLM)."""
        return self.stops.feed(piece) if n > self.min_tokens else (release_unstopped(self.stops, piece), None)
