"""One step's change to one request's logits, applied where the logits are.

`metatp.penalties` makes an `Adjustment` per request and step (penalties, logit_bias, bans);
a backend applies it to each device's vocabulary shard (`backends.candidates`) as the sampler
applies it to a whole row. It lives at the backend level because backends must not import the
API layer; `metatp.penalties` re-exports both names for its users.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Adjustment", "adjust"]


@dataclass(frozen=True)
class Adjustment:
    """One step's change to one request's logits: `terms` (ids, float64 values) added in order
    (each ids array without repeats), then `banned` ids set to -inf."""

    terms: tuple[tuple[np.ndarray, np.ndarray], ...]
    banned: np.ndarray


def adjust(logits: np.ndarray, adj: Adjustment, lo: int = 0) -> np.ndarray:
    """`adj` applied to `logits`, the vocabulary slice starting at token id `lo` (0: the whole
    row); ids outside the slice are someone else's. Returns a float64 copy."""
    x = np.asarray(logits).astype(np.float64)
    hi = lo + x.shape[-1]
    for ids, vals in adj.terms:
        sel = (ids >= lo) & (ids < hi)
        x[..., ids[sel] - lo] += vals[sel]
    b = adj.banned[(adj.banned >= lo) & (adj.banned < hi)]
    x[..., b - lo] = -np.inf
    return x
