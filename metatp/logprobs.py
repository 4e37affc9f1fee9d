"""Log-probabilities from logits, as vLLM reports them: the log-softmax of the raw logits (before
penalties, temperature or truncation), a token's value and its top alternatives. One definition
for the tokens a request generates and for the tokens of its prompt (`echo` + `logprobs`,
`prompt_logprobs`), so the two agree where they meet."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["token_logprob", "prompt_logprobs", "prompt_logprob_dicts"]


def token_logprob(logits: np.ndarray, token: int, k: int) -> tuple[float, dict[int, float]]:
    """log-softmax of one row of logits: `token`'s value and the top `k` (ties: lower id first)."""
    x = np.asarray(logits).astype(np.float64)
    m = x.max()
    lse = m + math.log(float(np.exp(x - m).sum()))
    top: dict[int, float] = {}
    if k > 0:
        idx = np.argpartition(-x, min(k, x.size - 1))[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = {int(i): float(x[i] - lse) for i in idx}
    return float(x[token] - lse), top


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
