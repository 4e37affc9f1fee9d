"""What a request's own tokens and biases do to its logits before sampling: OpenAI's
frequency / presence penalties and logit_bias, and vLLM's min_tokens.

The work is split so that it can later run where the logits are, one vocabulary shard at a
time: `Penalties.step(generated)` makes this step's `Adjustment` (small: token ids and values,
from the request's own tokens only, so batch-mates never meet), and `adjust(logits, adj, lo)`
applies it to a row or to the shard of it that starts at token id `lo`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from metatp.backends.logit_adjustment import Adjustment, adjust
from metatp.ir.errors import ConfigError

__all__ = ["Penalties", "Adjustment", "adjust", "release_unstopped", "BAN_BIAS"]

BAN_BIAS = -100.0      # OpenAI: "-100 should result in a ban"; here the logit becomes -inf, a true ban
_EMPTY = np.zeros(0, dtype=np.int64)
_MAX_ID = 2 ** 62      # no vocabulary is larger; keeps every id an int64


class Penalties:
    """One request's penalties: the constant part (bias, bans) made once, `step` per token.

    frequency/presence (OpenAI): logit[j] -= frequency * count[j] + presence * (count[j] > 0),
    counting the tokens this request has generated (not its prompt, as vLLM and OpenAI do).
    logit_bias: added; a bias of -100 bans the token. min_tokens: `end_ids` (what would end the
    generation: EOS unless ignore_eos, and stop_token_ids) are banned until that many tokens
    are out. `active` is False when none of these is set: the sampler then skips all of it."""

    def __init__(self, frequency: float, presence: float, logit_bias: dict[int, float], min_tokens: int,
                 end_ids: Iterable[int] = (), n_vocab: int | None = None) -> None:
        self.frequency, self.presence, self.min_tokens = frequency, presence, min_tokens
        limit = _MAX_ID if n_vocab is None else n_vocab
        bad = [k for k in logit_bias if k >= limit]
        if bad:
            raise ConfigError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{limit - 1})")
        end_ids = [i for i in end_ids if i < limit]      # a stop id past the vocabulary is never sampled
        keep = {k: b for k, b in sorted(logit_bias.items()) if b != 0.0 and b != BAN_BIAS}
        self.bias_ids = np.array(list(keep), dtype=np.int64)
        self.bias_vals = np.array(list(keep.values()), dtype=np.float64)
        self.bias_bans = np.array(sorted(k for k, b in logit_bias.items() if b == BAN_BIAS), dtype=np.int64)
        self.end_ids = np.array(sorted(set(end_ids)), dtype=np.int64) if min_tokens > 0 else _EMPTY
        self.both_bans = np.union1d(self.bias_bans, self.end_ids)
        self.active = bool(frequency or presence or self.bias_ids.size or self.bias_bans.size or self.end_ids.size)
        if n_vocab is not None and self.both_bans.size >= n_vocab:
            raise ConfigError("logit_bias bans every token of the vocabulary (with min_tokens' end tokens): "
                              "nothing is left to sample")
        self._source: Sequence[int] | None = None
        self._seen, self._ids, self._counts = 0, _EMPTY, _EMPTY     # counts of _source[:_seen]

    def _count(self, generated: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the generated tokens, kept up to date a token at a time while the
        caller passes the same growing list (a request's output_ids); anything else is counted afresh."""
        n = len(generated)
        if generated is not self._source or n < self._seen or n - self._seen > 8:
            self._source = generated
            self._ids, self._counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        else:
            for t in generated[self._seen:]:
                i = int(np.searchsorted(self._ids, t))
                if i < self._ids.size and self._ids[i] == t:
                    self._counts[i] += 1
                else:
                    self._ids, self._counts = np.insert(self._ids, i, t), np.insert(self._counts, i, 1)
        self._seen = n
        return self._ids, self._counts

    def step(self, generated: Sequence[int]) -> Adjustment | None:
        """This step's adjustment, from the tokens generated so far; None: nothing to do."""
        terms = []
        if (self.frequency or self.presence) and len(generated):
            ids, counts = self._count(generated)
            terms.append((ids, -(self.frequency * counts + self.presence)))
        if self.bias_ids.size:
            terms.append((self.bias_ids, self.bias_vals))
        banned = self.both_bans if len(generated) < self.min_tokens else self.bias_bans
        if not terms and not banned.size:
            return None
        return Adjustment(tuple(terms), banned)

    def __call__(self, logits: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        adj = self.step(generated)
        return logits if adj is None else adjust(logits, adj)


def release_unstopped(matcher: Any, piece: str) -> str:
    """Before min_tokens tokens are out, stop strings end nothing (vLLM: a stop string counts only
    when it ends in the text of a later token): `piece` joins the stop matcher's (a
    output_processor.StopMatcher) held text, and all of it is released but the longest tail that could
    still start a stop string and holds no whole one."""
    matcher.text += piece
    text, stops = matcher.text, matcher.stops
    keep = 0
    for k in range(min(matcher.hold, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops) and not any(s in tail for s in stops):
            keep = k
            break
    matcher.text = text[len(text) - keep:]
    return text[:len(text) - keep]
