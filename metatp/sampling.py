"""Sampling parameters (vLLM's names) and the sampler that turns logits into a token."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from metatp.backends.candidates import RowCandidates
from metatp import request_fields
from metatp.penalties import Adjustment, Penalties
from metatp.request_fields import MAX_N, check_seed

__all__ = ["SamplingParams", "Sampler", "CandidateSpec", "check_seed", "MAX_N"]

K_MAX = 256      # top_k up to this is sampled from each device's top_k candidates (beyond: the gathered row)
K_MIN_P = 64     # candidates per device for min_p or top_p alone (their kept tokens are usually far fewer)
_KEYWORD_EXTRAS = ("frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "stop_token_ids")


@dataclass
class SamplingParams:
    """How to pick tokens, with vLLM's defaults: temperature 1.0 (plain sampling), top_p 1,
    top_k -1 (off), max_tokens 16 -- so `SamplingParams(n=3)` gives three different samples, as
    in vLLM; pass temperature=0 for greedy decoding.
    temperature 0 is greedy (argmax; the first index wins a tie); a tiny
    one (even a denormal) is the limit of the softmax: the maximal logits, ties drawn uniformly.

    `n`: samples per prompt (vLLM), at most MAX_N; with a seed, sample i > 0 draws from its own
    stream of it.
    `logprobs`: None, or report each token's log-probability (of the raw logits, as vLLM does)
    and that many of the most likely alternatives (0: only the token's own).
    `prompt_logprobs` (vLLM's): the same for every prompt token (the first has none), in
    `RequestOutput.prompt_logprobs`.
    `frequency_penalty`, `presence_penalty` (OpenAI's, -2..2, over the tokens generated so far),
    `logit_bias` ({token id: bias}, -100..100 added to the logits; -100 bans the token) and
    `min_tokens` (vLLM's: EOS, stop_token_ids and stop strings end nothing before that many
    tokens) are applied after repetition_penalty: see metatp.penalties.
    Structured output (metatp.structured, needs llguidance), at most one of: `json_object`
    (True: any JSON object), `json_schema` (a dict or its JSON text), `guided_regex`,
    `guided_choice` (a list of strings), `guided_grammar` (Lark or GBNF). Tokens that would leave
    the constraint get -inf logits (greedy too); the request stops when the output is complete.
    A bad constraint is a ConfigError naming its field.
    `cache_salt` (vLLM's): a request reuses prefix-cache blocks only from requests with the same
    salt (and, in a server, the same API-key tenant): an unguessable salt keeps others from timing
    whether its prompt was seen. None: the tenant's unsalted blocks. Never shown in repr.
    vLLM's output options (`LLM.generate`): `skip_special_tokens` (True: control tokens leave no
    text; False: they show as the model writes them), `spaces_between_special_tokens` (either
    value: special tokens are written with no spaces around them, as vLLM's V1 fast
    detokenizer writes them -- True leaves the tokenizer's text as it is, False only strips a
    space a decoder prefixed to a special token after another, and metatp's prefixes none),
    `include_stop_str_in_output` (the matched stop string ends the
    text), `detokenize` (False: token ids only, no text; stop strings need text and are refused)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    json_object: bool = False
    json_schema: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = field(default=None, repr=False)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    constraint: str | None = field(default=None, init=False, repr=False, compare=False)   # llguidance's grammar

    def __post_init__(self) -> None:
        """Each field through its one check (metatp.request_fields), in this order: the first
        wrong field is the one a FieldError (a ConfigError) names."""
        self.n = request_fields.N.check(self.n)
        self.logprobs = request_fields.LOGPROBS.check(self.logprobs)
        self.prompt_logprobs = request_fields.PROMPT_LOGPROBS.check(self.prompt_logprobs)
        self.max_tokens = request_fields.MAX_TOKENS.check(self.max_tokens)
        self.temperature = request_fields.TEMPERATURE.check(self.temperature)
        self.top_k = request_fields.TOP_K.check(self.top_k)
        self.top_p = request_fields.TOP_P.check(self.top_p)
        self.min_p = request_fields.MIN_P.check(self.min_p)
        self.repetition_penalty = request_fields.REPETITION_PENALTY.check(self.repetition_penalty)
        self.seed = request_fields.SEED.check(self.seed)
        self.stop = request_fields.stop(self.stop)
        self.stop_token_ids = request_fields.token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = request_fields.IGNORE_EOS.check(self.ignore_eos)
        self.frequency_penalty = request_fields.FREQUENCY_PENALTY.check(self.frequency_penalty)
        self.presence_penalty = request_fields.PRESENCE_PENALTY.check(self.presence_penalty)
        self.logit_bias = request_fields.logit_bias(self.logit_bias) or None
        self.min_tokens = request_fields.min_tokens(self.min_tokens, self.max_tokens)
        self.json_object = request_fields.JSON_OBJECT.check(self.json_object)
        self.cache_salt = request_fields.CACHE_SALT.check(self.cache_salt)
        self._check_output_options()
        if self.json_object or self.json_schema is not None or self.guided_regex is not None \
                or self.guided_choice is not None or self.guided_grammar is not None:
            from metatp.structured import grammar_of
            self.constraint = grammar_of(self)

    def _check_output_options(self) -> None:
        """vLLM's detokenization options: each a bool, and only the combinations metatp honours."""
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                     "detokenize"):
            setattr(self, name, request_fields.Flag(name).check(getattr(self, name)))
        if not self.detokenize and self.stop:
            raise request_fields.FieldError("detokenize", "stop strings need text: detokenize=False cannot be "
                                                          "combined with stop (use stop_token_ids)")

    @property
    def penalized(self) -> bool:
        """Is any of frequency/presence penalty, logit_bias, min_tokens set (else no work for them)?"""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_keywords(self, extra: dict[str, Any]) -> "SamplingParams":
        """These params with llama-cpp-python's frequency_penalty / presence_penalty / logit_bias
        keyword arguments (and vLLM's min_tokens / stop_token_ids) of `LLM.create_completion` and
        `create_chat_completion`; None keeps the default. Any other name: TypeError, as Python says."""
        bad = [k for k in extra if k not in _KEYWORD_EXTRAS]
        if bad:
            raise TypeError(f"got an unexpected keyword argument {bad[0]!r} (the sampling keywords beyond the "
                            f"named ones: {', '.join(_KEYWORD_EXTRAS)})")
        given = {k: v for k, v in extra.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self


@dataclass(frozen=True)
class CandidateSpec:
    """A StepItem's logits mode for a row sampled from vocabulary-split logits without gathering
    them (`metatp.backends.candidates`): `k` candidates per device, and what decides, from the
    candidates alone and alike on every process (under MPI it travels with the step), whether
    they cover this request's pick (`covers`); where not, the row is gathered.

    Covered: greedy (with logprobs) when the largest candidate exceeds every other logit's bound;
    a sample when its kept tokens are provably candidates -- top_k <= k with the k-th value
    above the bound, or min_p whose threshold lies above it (top_p then works within those) --
    or, for top_p alone, when its nucleus is reached by candidates above the bound for any
    whole-row mass within a margin of the devices' (`_nucleus`). Plain temperature sampling
    may pick any token of the vocabulary: it never comes here (`Sampler.candidate_spec`).
    Logprobs: the top `logprobs` must lie above the bound. `adjust`: the request's penalties and
    logit_bias this step, which each device applies to its own slice before choosing candidates
    (with logprobs, which are of the raw logits, such a request reads the whole row)."""

    k: int
    temperature: float
    top_k: int
    min_p: float
    logprobs: int = -1          # -1: none asked
    top_p: float = 1.0
    adjust: Adjustment | None = field(default=None, compare=False)   # this step's penalties, per device

    def covers(self, rc: RowCandidates) -> bool:
        if not rc.finite:                   # the caller reads the row and reports the NaN/inf
            return False
        rc = rc.narrowed(self.k)
        ids, vals = rc.merged()
        rest = rc.bound()
        if not vals.size or not vals.max() > rest:
            return False
        if self.logprobs > 0:
            if vals.size < self.logprobs or not np.sort(vals)[-self.logprobs] > rest:
                return False
        return self.temperature == 0.0 or _support(vals, self, rc.n_vocab, ids, rest, rc.mass()) is not None


class Sampler:
    """Applies penalties, temperature, top-k, top-p and min-p, then draws (or takes argmax).

    The draw is made over the kept tokens only, in ascending id order (`_support`, `_draw`), so
    the same arithmetic runs whether the row was gathered or only its candidates were read
    (`from_candidates`): the two give the same token from the same seed. (Before, the draw ran
    over the whole vocabulary, and min_p compared normalised probabilities; a seeded sample may
    differ from then's in rare last-bit cases. Same seed, same output still holds, whatever the
    batch-mates and the number of devices.)"""

    def __init__(self, params: SamplingParams, rng: np.random.Generator, end_ids: Sequence[int] = (),
                 n_vocab: int | None = None) -> None:
        """`end_ids`: the tokens that end this generation (min_tokens bans them until then);
        `n_vocab`: where given, logit_bias ids are checked against it (ConfigError)."""
        self.p = params
        self.rng = np.random.default_rng(params.seed) if params.seed is not None else rng
        self.penalties = None
        if params.penalized:
            pen = Penalties(params.frequency_penalty, params.presence_penalty, params.logit_bias or {},
                            params.min_tokens, end_ids, n_vocab)
            self.penalties = pen if pen.active else None

    def candidate_spec(self, n_vocab: int) -> CandidateSpec | None:
        """The logits mode that reads this sampler's row as candidates (`CandidateSpec`; with
        penalties, `step_spec` adds each step's adjustment), or None where it needs the whole row
        every step: repetition_penalty (its float32 overflow rule looks at the whole history's
        logits), penalties with logprobs (those are of the raw logits), or a pick that may be
        any token (plain temperature, a top_k past K_MAX without min_p). Structured output is
        the caller's to exclude."""
        p = self.p
        n_lp = -1 if p.logprobs is None else p.logprobs
        if p.repetition_penalty != 1.0 or (self.penalties is not None and n_lp >= 0):
            return None
        # one candidate more than needed: the needed ones then lie strictly above each
        # device's last (the bound on the rest) unless they tie with it
        if p.greedy:
            wanted = n_lp >= 0 or self.penalties is not None     # else the argmax read
            return CandidateSpec(max(1, n_lp) + 1, 0.0, -1, 0.0, n_lp) if wanted else None
        top_k = p.top_k if 0 < p.top_k < n_vocab else -1
        if 0 < top_k <= K_MAX:
            k = top_k
        elif p.min_p > 0 or (top_k < 0 and p.top_p < 1.0):
            k = K_MIN_P
        else:
            return None
        return CandidateSpec(max(k, n_lp, 1) + 1, p.temperature, top_k, p.min_p, n_lp, p.top_p)

    def step_spec(self, spec: CandidateSpec, generated: Sequence[int]) -> CandidateSpec:
        """`spec` with this step's adjustment (penalties, logit_bias, min_tokens' bans) from the
        tokens generated so far -- what the sampler would apply to the gathered row."""
        if self.penalties is None:
            return spec
        return dataclasses.replace(spec, adjust=self.penalties.step(generated))

    def __call__(self, logits: np.ndarray, history: Sequence[int] = (), generated: Sequence[int] = (),
                 allowed: np.ndarray | None = None) -> int:
        """`history`: prompt and generated tokens (repetition_penalty's); `generated`: the
        generated ones alone (frequency/presence penalties and min_tokens count these);
        `allowed`: structured output's mask (bool per token id; ids past it are banned too)."""
        x = self.processed(logits, history, generated, allowed)
        if self.p.greedy:
            return int(np.argmax(x))
        return self._draw(*_support(x, self.p, x.size))

    def processed(self, logits: np.ndarray, history: Sequence[int] = (), generated: Sequence[int] = (),
                  allowed: np.ndarray | None = None) -> np.ndarray:
        """The logits after repetition_penalty, the penalties and logit_bias, and the mask: what
        temperature and truncation then work on (arguments as `__call__`)."""
        p = self.p
        x = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0 and len(history):
            x = _penalize(x, np.unique(np.asarray(history, dtype=np.int64)), p.repetition_penalty)
        if self.penalties is not None:
            x = self.penalties(x, generated)
        if allowed is not None:
            x = _masked(x, allowed)
        return x

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (), generated: Sequence[int] = (),
                     allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The distribution `__call__` draws from, as (token ids ascending, probabilities): the
        same processing and truncation, so speculative decoding's acceptance rule
        (`metatp.speculative`) preserves what a plain draw would give. Greedy: the argmax, 1."""
        x = self.processed(logits, history, generated, allowed)
        if self.p.greedy:
            return np.array([int(np.argmax(x))]), np.ones(1)
        ids, w = self._top_p(*_support(x, self.p, x.size))
        return ids, w / w.sum()

    def from_candidates(self, rc: RowCandidates) -> int:
        """The token `__call__` would draw from the whole row, drawn from a row's candidates
        (`metatp.backends.candidates`, penalties applied by the devices), which
        `CandidateSpec.covers` has found to hold everything this sampler may pick; the same
        random draw. ValueError where they do not cover it."""
        ids, vals = rc.merged()
        rest = rc.bound()
        if self.p.greedy:
            if not vals.size or not vals.max() > rest:
                raise ValueError("the candidates do not hold the row's largest logit")
            return int(ids[int(np.argmax(vals))])
        support = _support(vals, self.p, rc.n_vocab, ids, rest, rc.mass())
        if support is None:
            raise ValueError("the candidates do not cover what this sampler may pick")
        return self._draw(*support)

    def _draw(self, ids: np.ndarray, w: np.ndarray, nucleus: bool = False) -> int:
        """top-p over the kept tokens (`ids` ascending, weights `w` > 0; `nucleus`: top-p's
        cut is made already), then one draw: the same arithmetic on the same arrays whether they
        came from the whole row or from its candidates, so the two draw the same token from the
        same random state."""
        ids, w = self._top_p(ids, w, nucleus)
        return int(ids[int(self.rng.choice(w.size, p=w / w.sum()))])

    def _top_p(self, ids: np.ndarray, w: np.ndarray, nucleus: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """top-p's cut of the kept tokens (`ids` ascending, weights `w`), unless made already."""
        if self.p.top_p < 1.0 and not nucleus:
            order = np.argsort(-w, kind="stable")
            cum = np.cumsum(w[order])
            cut = int(np.searchsorted(cum, self.p.top_p * cum[-1])) + 1
            sel = np.sort(order[:cut])
            ids, w = ids[sel], w[sel]
        return ids, w


def _support(x: np.ndarray, p: SamplingParams, n_vocab: int, ids: np.ndarray | None = None,
             rest: float = -math.inf, mass: float | None = None) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """The tokens temperature, top-k and min-p keep, as (ids ascending, weights exp(z - max z) > 0,
    False) with z the scaled logits. `x`: the whole row (`ids` None), or some of its tokens `ids`
    (ascending) with every other logit at most `rest`: then None unless the kept tokens are
    provably among them (top-k's k-th value or min-p's threshold above what `rest` scales to),
    or, for top-p alone, its nucleus is (`_nucleus`, from the whole row's `mass`; True last)."""
    with np.errstate(over="ignore", invalid="ignore"):   # an overflow is a -inf logit: weight 0
        z = _scaled(np.append(x.astype(np.float64), rest), p.temperature)   # rest <= max: the same scaling
        z, z_rest = z[:-1], z[-1]
        covered = rest == -math.inf
        keep = np.ones(z.size, dtype=bool)
        if 0 < p.top_k < n_vocab:
            if z.size < p.top_k:
                return None
            kth = np.partition(z, -p.top_k)[-p.top_k]
            keep &= z >= kth
            covered = covered or bool(z_rest < kth)
        w = np.exp(z - z.max())
        if p.min_p > 0:
            keep &= w >= p.min_p
            covered = covered or bool(np.exp(z_rest - z.max()) < p.min_p)
        keep &= w > 0
        w_rest = float(np.exp(z_rest - z.max()))
    if not covered:
        if mass is None or p.top_p >= 1.0 or p.min_p > 0 or 0 < p.top_k < n_vocab:
            return None
        return _nucleus(ids[keep], w[keep], w_rest, p.top_p, mass, float(z.max()))
    at = np.flatnonzero(keep)
    return (at if ids is None else ids[at]), w[at], False


def _nucleus(ids: np.ndarray, w: np.ndarray, w_rest: float, top_p: float, mass: float,
             z_max: float) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """top-p's nucleus of a row known only by some tokens (`ids` ascending, weights `w`), the
    others weighing at most `w_rest`, and the whole row's weight `mass` (from each device's
    sum, so within float rounding of the sum the gathered row makes). The tokens above `w_rest`
    are a prefix of the whole row's descending order; where the cut falls inside that prefix at
    the same place for any total within a margin of `mass` -- far wider than the two sums'
    rounding -- it is the gathered row's cut. Else None."""
    order = np.argsort(-w, kind="stable")
    sure = int((w[order] > w_rest).sum())
    cum = np.cumsum(w[order][:sure])
    margin = 1e-8 + 1e-14 * abs(z_max)          # the exponents' rounding grows with |z|
    lo = int(np.searchsorted(cum, top_p * mass * (1 - margin)))
    hi = int(np.searchsorted(cum, top_p * mass * (1 + margin)))
    if lo != hi or hi >= sure:
        return None
    sel = np.sort(order[:hi + 1])
    return ids[sel], w[sel], True


_F32 = np.finfo(np.float32)
_F32_TINY = np.float32(np.nextafter(np.float32(0), np.float32(1)))    # the least positive float32


def _penalize(x: np.ndarray, ids: np.ndarray, penalty: float) -> np.ndarray:
    """Seen tokens' logits divided by the penalty where positive, multiplied where negative
    (llama.cpp's repeat penalty), in float32 with the penalty as a float32 -- one beyond float32's
    range taken at its edge, so never 0 or inf and 0 * penalty stays 0. Where a result overflows
    float32, the logits come back as float64 (where none can overflow), so the ordering the
    penalty defines survives and the temperature below never meets inf."""
    r = np.float32(min(max(penalty, float(_F32_TINY)), float(_F32.max)))
    v = x[ids]
    with np.errstate(over="ignore"):
        out = np.where(v > 0, v / r, v * r)
    if not np.isfinite(out).all():
        x = x.astype(np.float64)
        v = v.astype(np.float64)
        out = np.where(v > 0, v / np.float64(r), v * np.float64(r))
    else:
        x = x.copy()
    x[ids] = out
    return x


def _masked(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The logits with every token `allowed` does not allow at -inf (a copy). When the mask
    leaves nothing (the penalties' bans met the constraint's), the constraint wins: its tokens
    keep their logits, so the output still fits it."""
    n = min(x.shape[-1], allowed.shape[-1])
    if n == x.shape[-1]:
        out = np.where(allowed[:n], x, x.dtype.type(-np.inf))
    else:                          # logits past the mask (a padded vocabulary): never allowed
        out = np.full_like(x, -np.inf)
        out[:n] = np.where(allowed[:n], x[:n], -np.inf)
    if not np.isfinite(out).any() and allowed[:n].any():
        out[:n] = np.where(allowed[:n], np.where(np.isfinite(x[:n]), x[:n], 0.0), -np.inf)
    return out


def _scaled(x: np.ndarray, temperature: float) -> np.ndarray:
    """Logits over the temperature (float64; the caller ignores overflow). Where the largest
    quotient overflows (a tiny or denormal temperature), the max is taken off first: the largest
    logits give 0, the rest their distance over the temperature (-inf where it overflows), which
    is the softmax's limit -- greedy among the maximal logits -- and never inf - inf. Otherwise
    exactly the plain quotient, so ordinary temperatures draw what they always drew."""
    z = x / temperature
    if math.isfinite(float(z.max())):
        return z
    return (x - x.max()) / temperature

