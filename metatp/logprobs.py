"""Log-probabilities from logits, as vLLM reports them: the log-softmax of the raw logits (before
penalties, temperature or truncation), a token's value and its top alternatives. One definition
for the tokens a request generates and for the tokens of its prompt (`echo` + `logprobs`,
`prompt_logprobs`), so the two agree where they meet.

A row sampled from vocabulary-split logits without gathering them comes as `RowCandidates`
(`metatp.backends.candidates`): its log-softmax is a candidate's logit minus the row's
log-sum-exp, combined from each device's max and sum (equal to the gathered row's within float
rounding: the sums add in another order), and its top alternatives are the merged candidates'
(`CandidateSpec.covers` has checked they lie above every other logit)."""

from __future__ import annotations

import math

import numpy as np

from metatp.backends.candidates import RowCandidates

__all__ = ["token_logprob", "prompt_logprobs", "prompt_logprob_dicts"]


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


def prompt_logprob_dicts(logits: np.ndarray, ids: list[int], k: int) -> list[dict[int, float] | None]:
    """`prompt_logprobs` in the shape of `CompletionOutput.logprobs`: per prompt token (None for
    the first) {its id: its logprob, and each of the top `k`: theirs} (vLLM's RequestOutput.prompt_logprobs)."""
    return [None if e is None else {t: e[0], **e[1]} for t, e in zip(ids, prompt_logprobs(logits, ids, k))]
