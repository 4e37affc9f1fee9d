"""Speculative decoding: k drafted tokens checked in one pass of the target model (llama.cpp's
lookup decoding and `-md` draft model; vLLM's `speculative_config`).

A *proposer* guesses the next tokens of a sequence (`propose(context_ids, k)`): the n-gram
prompt lookup (`NgramProposer`: the last n..1 tokens matched earlier in prompt + output, what
followed them proposed -- free, and right whenever the output quotes its prompt) or a small
draft model (`metatp.draft`). The scheduler feeds the request's pending token and the draft in
one item whose every row's logits are read (`Purpose.VERIFY`); `accept` then keeps the longest
run the target agrees with and adds one token of its own, so a step gives 1..k+1 tokens.
The rejected positions' KV cells are left behind: the sequence's length is set back
(`KVCells.rewind`) and the next step overwrites them; attention reads only positions below a
row's own, so they never influence a later token.

The acceptance rule preserves the target's distribution exactly, after the same logit
processing a plain step applies (penalties, logit_bias, top-k/top-p/min-p, temperature:
`Sampler.distribution`): greedy keeps a drafted token while it is the target's argmax (so the
tokens are those of plain greedy decoding), sampling uses Leviathan et al.'s rejection rule --
accept x with min(1, p(x)/q(x)), else draw from norm(max(0, p - q)). A proposer that picks one
token (the n-gram lookup, a greedy draft model) is a point mass q: x is kept with probability
p(x), else the token is drawn from p with x taken out.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from metatp.ir.errors import ConfigError, MetatpError

if TYPE_CHECKING:
    from metatp.runner import ScheduledItem

__all__ = ["Proposer", "NgramProposer", "SpecConfig", "spec_config", "accept_greedy", "accept_sampled",
           "SpecStats", "Speculator", "MAX_DRAFT", "METHODS"]

MAX_DRAFT = 32              # drafted tokens per step at most (one verification pass of k+1 rows)
METHODS = ("ngram", "draft")
_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")

Distribution = tuple[np.ndarray, np.ndarray]      # (token ids, probabilities)


class Proposer(Protocol):
    """What guesses a sequence's next tokens."""

    def propose(self, context_ids: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens likely to follow `context_ids` (prompt and output so far)."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's ngram method, llama.cpp's lookup decoding): the last n tokens, n
    from `n_max` down to `n_min`, are looked up earlier in the context; the tokens that followed
    their latest earlier occurrence are proposed. Nothing where no n-gram recurs."""

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        self.n_max = _positive("prompt_lookup_max", n_max)
        self.n_min = _positive("prompt_lookup_min", n_min)
        if self.n_min > self.n_max:
            raise ConfigError(f"prompt_lookup_min ({n_min}) must not exceed prompt_lookup_max ({n_max})")

    def propose(self, context_ids: Sequence[int], k: int) -> list[int]:
        ctx = np.asarray(context_ids, dtype=np.int64)
        L = ctx.size
        if k <= 0:
            return []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = ctx[L - n:]
            # starts i < L - n of earlier occurrences of the tail (not the tail itself)
            hits = np.flatnonzero(ctx[:L - n] == tail[0])
            for j in range(1, n):
                hits = hits[ctx[hits + j] == tail[j]]
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in ctx[start:start + k]]
        return []


@dataclass(frozen=True)
class SpecConfig:
    """How a model speculates: `method` "ngram" (prompt lookup, n from `lookup_max` down to
    `lookup_min`) or "draft" (the model `draft_model` proposes greedily); `k` tokens a step."""

    method: str
    k: int
    lookup_max: int = 3
    lookup_min: int = 1
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        k = self.k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= MAX_DRAFT:
            raise ConfigError(f"num_speculative_tokens must be an integer from 1 to {MAX_DRAFT}, got {k!r}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method 'draft' needs a draft model (speculative_model / -md PATH)")
        if self.method == "ngram":
            NgramProposer(self.lookup_max, self.lookup_min)     # checks the lookup sizes

    def ngram(self) -> NgramProposer:
        return NgramProposer(self.lookup_max, self.lookup_min)


def spec_config(speculative_config: Mapping[str, Any] | None = None, speculative_model: Any = None,
                num_speculative_tokens: Any = None) -> SpecConfig | None:
    """The speculation `LLM(...)` asks for, from vLLM's `speculative_config` dict ({"method":
    "ngram" | "draft", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min":
    m, "model": draft path}) and/or the `speculative_model` / `num_speculative_tokens`
    keywords ("draft_model", vLLM's method name, is "draft"); None: no speculation. A wrong or
    contradictory value is a ConfigError naming it."""
    if speculative_config is None and speculative_model is None and num_speculative_tokens is None:
        return None
    cfg: dict[str, Any] = {}
    if speculative_config is not None:
        if not isinstance(speculative_config, Mapping):
            raise ConfigError(f"speculative_config must be a dict like {{'method': 'ngram', "
                              f"'num_speculative_tokens': 4}}, got {type(speculative_config).__name__}")
        bad = [key for key in speculative_config if key not in _CONFIG_KEYS]
        if bad:
            raise ConfigError(f"speculative_config has an unknown key {bad[0]!r} (known: {', '.join(_CONFIG_KEYS)})")
        cfg.update(speculative_config)
    for key, value in (("model", speculative_model), ("num_speculative_tokens", num_speculative_tokens)):
        if value is None:
            continue
        if cfg.get(key) is not None and cfg[key] != value:
            name = "speculative_model" if key == "model" else key
            raise ConfigError(f"{name}={value!r} contradicts speculative_config's {key}={cfg[key]!r}")
        cfg[key] = value
    model = cfg.get("model")
    if model is not None and not isinstance(model, str):
        model = str(model)
    method = cfg.get("method") or ("draft" if model is not None else "ngram")
    method = "draft" if method == "draft_model" else method        # vLLM's name for it
    if method == "ngram" and model is not None:
        raise ConfigError("speculative method 'ngram' takes no draft model (speculative_model)")
    if "num_speculative_tokens" not in cfg:
        raise ConfigError("speculative decoding needs num_speculative_tokens (tokens drafted a step)")
    return SpecConfig(method, cfg["num_speculative_tokens"], cfg.get("prompt_lookup_max", 3),
                      cfg.get("prompt_lookup_min", 1), model)


def accept_greedy(draft: Sequence[int], argmax_at: Callable[[int], int]) -> list[int]:
    """The tokens a greedy verification gives: `argmax_at(i)` is the target's pick after the
    pending token and draft[:i]. Drafted tokens are kept while they equal that pick; the first
    pick that differs (or, all kept, the pick after the last) ends the run."""
    out: list[int] = []
    for i, x in enumerate(draft):
        t = int(argmax_at(i))
        out.append(t)
        if t != int(x):
            return out
    out.append(int(argmax_at(len(draft))))
    return out


def accept_sampled(draft: Sequence[int], dist_at: Callable[[int], Distribution], rng: np.random.Generator,
                   draft_dists: Sequence[Distribution] | None = None) -> list[int]:
    """The tokens rejection sampling gives (Leviathan et al. 2023): `dist_at(i)` is the target's
    distribution after the pending token and draft[:i]; `draft_dists[i]` the distribution the
    proposer drew draft[i] from (None: each drafted token was a sure pick, a point mass). Each
    output token is distributed as the target's, whatever the draft."""
    out: list[int] = []
    for i, x in enumerate(draft):
        x = int(x)
        ids, p = dist_at(i)
        px = _prob(ids, p, x)
        if draft_dists is None:
            q_ids, q = np.array([x]), np.ones(1)
        else:
            q_ids, q = draft_dists[i]
        qx = _prob(q_ids, q, x)
        if qx <= 0:
            raise ValueError(f"drafted token {x} has probability 0 under its own proposal")
        if rng.random() < min(1.0, px / qx):
            out.append(x)
            continue
        out.append(_draw(rng, *_residual(ids, p, q_ids, q)))
        return out
    out.append(_draw(rng, *dist_at(len(draft))))
    return out


@dataclass
class SpecStats:
    """Counts of a speculating scheduler: verification steps, tokens drafted, drafted tokens
    accepted and tokens given (accepted + the target's own one per verification)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def count(self, n_drafted: int, n_tokens: int) -> None:
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += min(n_tokens - 1, n_drafted)
        self.emitted += n_tokens


def _prob(ids: np.ndarray, p: np.ndarray, x: int) -> float:
    at = np.flatnonzero(ids == x)
    return float(p[at[0]]) if at.size else 0.0


def _residual(ids: np.ndarray, p: np.ndarray, q_ids: np.ndarray, q: np.ndarray) -> Distribution:
    """norm(max(0, p - q)) over p's tokens (a token outside p's support has p = 0). Where p <= q
    everywhere (p == q, acceptance was sure), p itself."""
    q_on_p = np.zeros(ids.size)
    common, at_p, at_q = np.intersect1d(ids, q_ids, return_indices=True)
    q_on_p[at_p] = q[at_q]
    r = np.maximum(p - q_on_p, 0.0)
    return (ids, r / r.sum()) if r.sum() > 0 else (ids, p)


def _draw(rng: np.random.Generator, ids: np.ndarray, p: np.ndarray) -> int:
    return int(ids[int(rng.choice(ids.size, p=p / p.sum()))])


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


class Speculator:
    """What a scheduler speculates with (`metatp.scheduler`): the proposer its config names
    (`proposer`, any `Proposer`), `k`, and the counts (`stats`). The scheduler hands it a step's
    decode items and spare rows (`drafts`: what to verify) and each verification's outcome
    (`verified`: what to rewind). A draft model (`draft`, `metatp.draft.DraftModel`) keeps a
    sequence per request, given back by `forget`."""

    def __init__(self, config: SpecConfig, draft: Any = None) -> None:
        if config.method == "draft" and draft is None:
            raise ConfigError("speculative method 'draft' needs its draft model loaded (metatp.draft)")
        self.config = config
        self.k = config.k
        self.stats = SpecStats()
        self.draft = draft
        self.proposer: Proposer | None = config.ngram() if config.method == "ngram" else None
        self._length: dict[int, int] = {}     # request id -> its draft length now (`record`)

    def propose(self, request_id: int, context_ids: Sequence[int], k: int) -> list[int]:
        """At most `k` drafted tokens after `context_ids` (request `request_id`'s tokens), and
        at most the request's current draft length."""
        k = min(k, self._length.get(request_id, self.k))
        if k <= 0:
            return []
        if self.draft is not None:
            return self.draft.propose(request_id, context_ids, k)
        return self.proposer.propose(context_ids, k)

    def propose_many(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """`propose` for several requests (request id, context, k): a draft model decodes them
        in the same passes."""
        asks = [(rid, ctx, min(k, self._length.get(rid, self.k))) for rid, ctx, k in asks]
        if self.draft is not None:
            return self.draft.propose_many(asks)
        return [self.proposer.propose(ctx, k) if k > 0 else [] for _, ctx, k in asks]

    def drafts(self, items: Sequence[ScheduledItem], spare_rows: int,
               pass_rows: int) -> list[tuple[ScheduledItem, list[int]]]:
        """The tokens to verify after the pending token of each decode item (in order, while
        rows are left): at most k (the request's draft length), as many as its request may still
        generate after the pending one, what is left of the step's `spare_rows`, and what a pass
        of `pass_rows` rows holds with the pending token (so the verified rows compute the bits a
        plain decode step would). Only items given a draft come back. A draft model's failed pass
        (a MetatpError) drafts nothing this step."""
        asks: list[tuple[ScheduledItem, int]] = []
        for w in items:
            r = w.request
            k = min(self.k, r.max_new - len(r.output_ids) - 1, spare_rows, pass_rows - 1)
            if k > 0:
                asks.append((w, k))
                spare_rows -= k
        if not asks:
            return []
        try:
            drafted = self.propose_many([(w.request.id, w.request.history, k) for w, k in asks])
        except MetatpError:
            return []
        return [(w, draft[:k]) for (w, k), draft in zip(asks, drafted) if draft[:k]]

    def verified(self, request_id: int, n_drafted: int, n_tokens: int) -> int:
        """A verification of `n_drafted` tokens gave `n_tokens` (`record`); returns how many of
        the verified positions were rejected, whose cells the scheduler rewinds."""
        self.record(request_id, n_drafted, n_tokens)
        return n_drafted + 1 - n_tokens

    def record(self, request_id: int, n_drafted: int, n_tokens: int) -> None:
        """A verification of `n_drafted` tokens gave `n_tokens`. The request's draft length
        follows its acceptance: doubled (up to k) when every drafted token was kept, else one
        past what was kept -- a request whose drafts miss stops paying for k rows a step. The
        draft depends only on tokens already decided, so the output distribution is unchanged."""
        self.stats.count(n_drafted, n_tokens)
        accepted = n_tokens - 1
        now = self._length.get(request_id, self.k)
        self._length[request_id] = min(self.k, 2 * now) if accepted >= n_drafted else min(self.k, accepted + 1)

    def forget(self, request_id: int) -> None:
        """The request has ended: its draft length (and a draft model's sequence) go."""
        self._length.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
