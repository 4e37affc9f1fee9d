"""The model runner: from a step the scheduler planned in token ids to one token per request
(vLLM v1's GPU model runner: `execute_model` -> sampled token ids).

The scheduler decides who runs and which tokens each feeds (`ScheduledItem`); the runner does
everything that touches logits: each request's sampling state (`SamplingState`: its Sampler with
penalties and logit bias, its structured-output guide), the logits mode each item is read in
("argmax", a `CandidateSpec`, "last", "all", "none"; "hidden" for an embedding), the structured-output masks computed while
the forward pass runs (`MaskPrefetch`), the pass itself (`Engine.run`, or under MPI the
`Leader`'s, which posts it to the other ranks first), the NaN/inf check, the draw, and the
token's logprobs where asked. What comes back per item is a `TokenResult` (or None where the item
gives no token), so the scheduler deals in token ids and the output processor in text.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from metatp.backends.candidates import RowCandidates
from metatp.engine import Engine, StepItem
from metatp.ir.errors import NumericalError
from metatp.kv_cells import SeqCells
from metatp.logprobs import token_logprob
from metatp.sampling import CandidateSpec, Sampler, SamplingParams
from metatp.speculative import accept_greedy, accept_sampled
from metatp.structured import Guide, MaskPrefetch, make_guide

if TYPE_CHECKING:
    from metatp.lockstep import Leader

__all__ = ["ModelRunner", "SamplingState", "ScheduledItem", "Purpose", "TokenResult", "TokenSource",
           "check_logits"]


def check_logits(logits: np.ndarray, what: str) -> None:
    """NaN or infinite logits mean a broken model (NaN weights, overflowing hyper-parameters);
    sampling them would silently give token 0. One max is cheap next to a forward step."""
    top = float(np.max(logits))
    if not math.isfinite(top):
        bad = "NaN" if math.isnan(top) or np.isnan(logits).any() else "infinite"
        raise NumericalError(f"the model computed {bad} logits {what}; the model file is broken "
                             "(NaN/inf weights or hyper-parameters that overflow)")


class TokenSource(Protocol):
    """What the runner reads of a scheduled request (the scheduler's `Request` is one): plain
    data, never written here."""

    id: int
    params: SamplingParams
    rng: np.random.Generator
    end_ids: frozenset[int]
    history: list[int]          # prompt and generated tokens
    output_ids: list[int]       # the generated ones


class Purpose(enum.Enum):
    """What an item's pass gives its request."""

    FEED = "feed"           # prompt (or a preempted request's recomputed) tokens: nothing read
    SAMPLE = "sample"       # a decode token or a prompt's last chunk: the next token
    SCORE = "score"         # a scoring request's prompt chunk: the logits of every position
    EMBED = "embed"         # an embedding request's prompt chunk: the final hidden state of every position
    VERIFY = "verify"       # a decode token and the tokens drafted after it: the accepted run
                            # and one token of the target's own (metatp.speculative)


@dataclass
class ScheduledItem:
    """One request's part of a step, as the scheduler plans it. `first`/`last` (SCORE, EMBED):
    the chunk begins / ends the prompt, so its rows start / complete the request's logits (hidden states)."""

    request: TokenSource
    seq: SeqCells
    tokens: list[int]
    purpose: Purpose
    first: bool = False
    last: bool = False


@dataclass
class TokenResult:
    """What one item gave its request: a token (with its logprobs where asked, and whether the
    request's constraint is now complete), a scored prompt's logits, an embedded prompt's final
    hidden states (`hidden`, [n_prompt, n_embd]), or the error that failed it."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    complete: bool = False
    logits: np.ndarray | None = None
    error: BaseException | None = None
    hidden: np.ndarray | None = None


class SamplingState:
    """One request's sampling: its Sampler (penalties, logit bias, min_tokens' bans), its
    structured-output guide, and the logits mode its rows are read in. Built when the request
    is submitted, so a bad logit_bias or grammar is an error of the submit."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator, end_ids: Sequence[int],
                 tokenizer: Any) -> None:
        n_vocab = tokenizer.n_vocab
        self.params = params
        self.sampler = Sampler(params, rng, end_ids=end_ids, n_vocab=n_vocab)
        self.guide: Guide | None = make_guide(params, tokenizer) if params.constraint is not None else None
        # "argmax" when the pick is the greedy token of the raw logits and nothing else is
        # reported (no penalty, bias, constraint or logprobs), so a vocabulary split is never
        # gathered for it; a CandidateSpec where each device's top candidates can cover the pick
        # (metatp.sampling); else "last"
        plain = (params.greedy and params.logprobs is None and not params.penalized
                 and params.repetition_penalty == 1.0 and self.guide is None)
        spec = self.sampler.candidate_spec(n_vocab) if self.guide is None else None
        self.mode: str | CandidateSpec = "argmax" if plain else spec or "last"
        self.score_rows: list[np.ndarray] = []

    def logits_mode(self, generated: Sequence[int]) -> str | CandidateSpec:
        """This step's logits mode (a CandidateSpec carries this step's penalties)."""
        return self.mode if isinstance(self.mode, str) else self.sampler.step_spec(self.mode, generated)

    def sample(self, logits: np.ndarray | RowCandidates | int, history: Sequence[int],
               generated: Sequence[int]) -> int:
        """The next token: the engine's own argmax (an int), a draw from the candidates it read
        (they cover the pick, all finite), or a draw from the row (NumericalError for NaN/inf)."""
        if isinstance(logits, (int, np.integer)):
            return int(logits)
        if isinstance(logits, RowCandidates):
            return self.sampler.from_candidates(logits)
        check_logits(logits, f"after {len(history)} tokens")
        allowed = self.guide.allowed() if self.guide is not None else None
        return self.sampler(logits, history, generated, allowed)


class ModelRunner:
    """Runs the scheduler's steps on one engine and samples their tokens (see the module doc)."""

    def __init__(self, engine: Engine, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.leader: "Leader | None" = None     # under MPI (rank 0): posts every step first
        self.masks = MaskPrefetch()
        self._states: dict[int, SamplingState] = {}

    def add(self, request: TokenSource) -> SamplingState:
        """A submitted request's sampling state (ConfigError for a logit_bias id outside the
        vocabulary; a structured-output constraint's errors)."""
        state = SamplingState(request.params, request.rng, sorted(request.end_ids), self.tokenizer)
        self._states[request.id] = state
        return state

    def forget(self, request_id: int) -> None:
        """The request has ended: its sampling state goes."""
        self._states.pop(request_id, None)

    def state(self, request_id: int) -> SamplingState:
        return self._states[request_id]

    def execute(self, items: list[ScheduledItem]) -> list[TokenResult | list[TokenResult] | None]:
        """Run one step: per item its TokenResult, or None where it gives nothing (a fed chunk,
        a scored prompt's chunk before its last), or for a VERIFY item the TokenResults of its
        accepted tokens and the target's own (a TokenResult with an error where it failed). A
        failed pass raises (its requests fail)."""
        states = [self._states[it.request.id] for it in items]
        steps = [StepItem(it.seq, it.tokens, self._mode(it, st)) for it, st in zip(items, states)]
        self.masks.start([st.guide for it, st in zip(items, states)
                          if st.guide is not None and it.purpose is Purpose.SAMPLE])
        try:
            outs = self.engine.run(steps) if self.leader is None else self.leader.run(self.engine, steps)
        finally:
            self.masks.wait()                   # structured output's masks, computed during the pass
        return [self._result(it, st, out) for it, st, out in zip(items, states, outs)]

    @staticmethod
    def _mode(it: ScheduledItem, st: SamplingState) -> str | CandidateSpec:
        if it.purpose in (Purpose.SCORE, Purpose.VERIFY):
            return "all"
        if it.purpose is Purpose.EMBED:
            return "hidden"
        return st.logits_mode(it.request.output_ids) if it.purpose is Purpose.SAMPLE else "none"

    @staticmethod
    def _result(it: ScheduledItem, st: SamplingState, out: Any) -> TokenResult | list[TokenResult] | None:
        """One item's result; an error sampling or reading it fails that request alone."""
        if it.purpose is Purpose.FEED:
            return None
        r = it.request
        try:
            if it.purpose is Purpose.VERIFY:
                return ModelRunner._verify(it, st, out)
            if it.purpose in (Purpose.SCORE, Purpose.EMBED):
                if it.first:
                    st.score_rows.clear()
                st.score_rows.append(out)
                if not it.last:
                    return None
                rows = np.concatenate(st.score_rows, axis=0)
                st.score_rows.clear()
                if it.purpose is Purpose.EMBED:
                    check_logits(rows, f"(final hidden states) for a sequence of {rows.shape[0]} tokens")
                    return TokenResult(hidden=rows)
                check_logits(rows, f"for a sequence of {rows.shape[0]} tokens")
                return TokenResult(logits=rows)
            tok = st.sample(out, r.history, r.output_ids)
            n_lp = st.params.logprobs
            lp, top = token_logprob(out, tok, n_lp) if n_lp is not None else (None, None)
            complete = st.guide is not None and st.guide.consume(tok)      # the constrained output is whole
            return TokenResult(tok, lp, top, complete)
        except Exception as e:  # noqa: BLE001 -- e.g. a broken model's logits: this request fails
            return TokenResult(error=e)

    @staticmethod
    def _verify(it: ScheduledItem, st: SamplingState, rows: np.ndarray) -> list[TokenResult]:
        """The tokens a VERIFY item gives (`metatp.speculative`): row i's logits follow the
        pending token and draft[:i], processed as a plain step would process them with those
        tokens generated; the acceptance rule keeps the target's distribution (greedy: its
        tokens). Structured output never speculates (the scheduler drafts nothing for it)."""
        r = it.request
        draft = [int(t) for t in it.tokens[1:]]
        check_logits(rows, f"after {len(r.history)} tokens and {len(draft)} drafted")
        history, generated = list(r.history), list(r.output_ids)

        def context(i: int) -> tuple[list[int], list[int]]:
            return history + draft[:i], generated + draft[:i]

        if st.params.greedy:
            tokens = accept_greedy(draft, lambda i: st.sampler(rows[i], *context(i)))
        else:
            tokens = accept_sampled(draft, lambda i: st.sampler.distribution(rows[i], *context(i)), st.sampler.rng)
        n_lp = st.params.logprobs
        out = []
        for i, tok in enumerate(tokens):
            lp, top = token_logprob(rows[i], tok, n_lp) if n_lp is not None else (None, None)
            out.append(TokenResult(tok, lp, top))
        return out
