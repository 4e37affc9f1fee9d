"""Log-probabilities from logits, as vLLM reports them: the log-softmax of the raw logits (before
penalties, temperature or truncation), a token's value and its top alternatives. One definition
for the tokens a request generates and for the tokens of its prompt (`echo` + `logprobs`,
`prompt_logprobs`), so the two agree where they meet.

A row sampled from vocabulary-split logits without gathering them comes as `RowCandidates`
(`metatp.backends.candidates`): its log-softmax is a candidate's logit minus the row's
log-sum-exp, combined from each device's max and sum (equal to the gathered row's within float
rounding: the sums add in another order), and its top alternatives are the merged candidates'
(`CandidateSpec.covers` has checked they lie above every other logit).

The Python API reports them as vLLM does: per token a dict {token id: `Logprob`} holding the
chosen token and the top alternatives (`CompletionOutput.logprobs`, `RequestOutput.prompt_logprobs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from metatp.backends.candidates import RowCandidates

__all__ = ["Logprob", "token_logprob", "prompt_logprobs", "prompt_logprob_dicts", "logprob_dict"]


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability as vLLM reports it: `rank` 1 is the likeliest token (None
    where the top alternatives asked for do not reach this token: its rank is past them and
    metatp does not count the rest of the row for a generated token); `decoded_token` its text
    (None when SamplingParams(detokenize=False))."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dict(token: int, logprob: float, top: dict[int, float] | None,
                 token_text: Callable[[int], str] | None, rank: int | None = None) -> dict[int, Logprob]:
    """{token: its Logprob, each top alternative: its Logprob}, vLLM's per-position logprobs. The
    ranks come from the top values (a value's rank: 1 + how many are larger), exact wherever the
    top reaches the value; `rank` (the token's, where the caller counted it) wins over that."""
    top = top or {}
    values = sorted(top.values(), reverse=True)

    def rank_of(v: float) -> int | None:
        above = sum(1 for x in values if x > v)
        return above + 1 if above < len(values) else None

    def entry(t: int, v: float, r: int | None) -> Logprob:
        return Logprob(float(v), r, None if token_text is None else token_text(t))

    out = {token: entry(token, logprob, rank if rank is not None else rank_of(logprob))}
    for t, v in top.items():
        if t != token:
            out[t] = entry(t, v, rank_of(v))
    return out


def token_logprob(logits: np.ndarray | RowCandidates, token: int, k: int) -> tuple[float, dict[int, float]]:
    """log-softmax of one row of logits: `token`'s value and the top `k` (ties: lower id first)."""
    if isinstance(logits, RowCandidates):
        return _candidate_logprob(logits, token, k)
    x = np.asarray(logits).astype(np.float64)
    m = x.max()
    lse = m + math.log(float(np.exp(x - m).sum()))
    top: dict[int, float] = {}
    if k > 0:
        k = min(k, x.size)
        kth = np.partition(x, x.size - k)[x.size - k]
        above = np.flatnonzero(x > kth)          # then the lowest ids of those equal to the k-th
        idx = np.concatenate([above, np.flatnonzero(x == kth)[:k - above.size]])
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = {int(i): float(x[i] - lse) for i in idx}
    return float(x[token] - lse), top


def _candidate_logprob(rc: RowCandidates, token: int, k: int) -> tuple[float, dict[int, float]]:
    """`token_logprob` of a row read as candidates: `token` must be one of them."""
    ids, vals = rc.merged()
    x = vals.astype(np.float64)
    at = np.flatnonzero(ids == token)
    if not at.size:
        raise ValueError(f"token {token} is not among the row's candidates")
    lse = rc.lse
    top: dict[int, float] = {}
    if k > 0:
        order = np.lexsort((ids, -x))[:k]
        top = {int(ids[i]): float(x[i] - lse) for i in order}
    return float(x[at[0]] - lse), top


def prompt_logprobs(logits: np.ndarray, ids: list[int], k: int) -> list[tuple[float, dict[int, float], int] | None]:
    """Per prompt position, the logprob of its token given the ones before, the top `k` there
    and the token's rank (1 = the likeliest), from a scoring pass's logits [len(ids), n_vocab]
    (row i predicts token i + 1); the first token has none (None), as in OpenAI's and vLLM's
    answers."""
    if logits.shape[0] != len(ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for a prompt of {len(ids)} tokens")
    out: list[tuple[float, dict[int, float], int] | None] = [None]
    for i in range(1, len(ids)):
        row = logits[i - 1]
        lp, top = token_logprob(row, ids[i], k)
        out.append((lp, top, int((row > row[ids[i]]).sum()) + 1))
    return out


def prompt_logprob_dicts(logits: np.ndarray, ids: list[int], k: int,
                         token_text: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
    """`prompt_logprobs` in the shape of `CompletionOutput.logprobs`: per prompt token (None for
    the first) {its id: its Logprob, and each of the top `k`: theirs} (vLLM's RequestOutput.prompt_logprobs)."""
    return [None if e is None else logprob_dict(t, e[0], e[1], token_text, rank=e[2])
            for t, e in zip(ids, prompt_logprobs(logits, ids, k))]
