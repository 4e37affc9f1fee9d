"""What a client sees of a request, from its token ids: text pieces, stop strings, logprobs
(vLLM v1's OutputProcessor).

The scheduler admits, batches and samples on token ids; each request's `OutputProcessor` turns a
sampled token into its `StepOutput` -- the token's text (detokenized as a stream, so a character
split over tokens comes out whole), the end of the request (an end-of-generation or stop token,
a stop string, max_tokens, a completed constraint) and its logprobs. The stepping thread runs it
outside the scheduler's state lock, so a long detokenization or a 150k-vocabulary log-softmax
holds no other thread back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from metatp.logprobs import token_logprob
from metatp.penalties import release_unstopped

__all__ = ["OutputProcessor", "StepOutput", "StopMatcher"]


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


class OutputProcessor:
    """One request's outputs: its stream decoder, stop matcher, end tokens and logprobs count."""

    def __init__(self, params: Any, tokenizer: Any, max_new: int) -> None:
        from metatp.ir.tokenizer import StreamDecoder

        self.stops = StopMatcher(params.stop or [])
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.eog = set() if params.ignore_eos else set(tokenizer.eog_ids)
        self.stop_ids = set(params.stop_token_ids)
        self.min_tokens = params.min_tokens
        self.n_logprobs = params.logprobs
        self.max_new = max_new

    @property
    def end_ids(self) -> set[int]:
        """The tokens that end the generation (min_tokens holds them back)."""
        return self.eog | self.stop_ids

    def process(self, tok: int, logits: np.ndarray | None, n: int, complete: bool = False) -> StepOutput:
        """The output of generated token number `n` (from 1), sampled from `logits`; `complete`:
        the constraint accepts nothing more."""
        lp, top = token_logprob(logits, tok, self.n_logprobs) if self.n_logprobs is not None else (None, None)
        dec, stops = self.decoder, self.stops
        if tok in self.eog or tok in self.stop_ids:
            return StepOutput(tok, stops.feed(dec.flush())[0] + stops.flush(), "stop",
                              tok if tok in self.stop_ids else None, lp, top)
        text, hit = self._feed(dec.push(tok), n)
        if hit is not None:
            return StepOutput(tok, text, "stop", hit, lp, top)
        if n >= self.max_new or complete:
            tail, hit = self._feed(dec.flush(), n)
            return StepOutput(tok, text + tail + (stops.flush() if hit is None else ""),
                              "stop" if hit is not None or complete else "length", hit, lp, top)
        return StepOutput(tok, text, None, None, lp, top)

    def _feed(self, piece: str, n: int) -> tuple[str, str | None]:
        """The stop matcher's answer for the text of token n; none stops before min_tokens (vLLM)."""
        return self.stops.feed(piece) if n > self.min_tokens else (release_unstopped(self.stops, piece), None)
