"""Greedy tokens read from vocabulary-split logits without gathering the vocabulary.

A greedy request needs only the index of each row's first largest logit. Where the output layer
is split along the vocabulary, each device reduces its own slice to (largest value, its global
index, whether every value was finite) per row, and only those three numbers per row and device
cross between processes (one small all-gather) instead of the whole vocabulary (`read_across`'s
Allgatherv). The pick is the same as `argmax` of the gathered row: the largest value, the
lowest index among equals. A row with a non-finite logit gives None, so the caller reads the
whole row and reports the NaN/inf as it always has (every process learns this from the same
all-gather, so they all make that read together).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metatp.ir.tensor import Tensor

__all__ = ["read_argmax", "combine"]


def _device_best(local: np.ndarray, spans: list[tuple[int, int, int]]) -> np.ndarray:
    """[3, rows]: (largest value, its global index, all finite) over this device's chunks
    (global start, local start, length), ties to the lower global index."""
    rows = local.shape[0]
    best = np.full(rows, -np.inf)
    idx = np.zeros(rows)
    finite = np.ones(rows, dtype=bool)
    for g, loc, length in spans:
        part = local[:, loc:loc + length]
        finite &= np.isfinite(part).all(axis=1)
        at = part.argmax(axis=1)
        val = part[np.arange(rows), at].astype(np.float64)
        better = val > best                      # strictly: an equal value later keeps the earlier index
        best = np.where(better, val, best)
        idx = np.where(better, g + at, idx)
    return np.stack([best, idx, finite.astype(np.float64)])


def read_argmax(ex: Any, t: Tensor) -> tuple[list[int | None], int]:
    """Per row of the logits `t` ([n_vocab, rows] in ggml order) on the plan executor `ex`: the
    greedy token, or None where a logit is not finite. Also returns the bytes this process
    received for it (the small all-gather; 0 in one process)."""
    tp = ex.plan.of(t)
    st = tp.sync_state
    if ex.plan.n_devices == 1 or st.is_mirrored or st.is_partial or st.axis != 0:
        full = ex.read(t)
        full = full.reshape(-1, full.shape[-1])
        ok = np.isfinite(full).all(axis=1)
        return [int(a) if f else None for a, f in zip(full.argmax(axis=1), ok)], 0
    ex.backend.synchronize()
    rows = int(np.prod(t.ne[1:]))
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for j, g, loc, length in st.chunks():
        spans.setdefault(j, []).append((g, loc, length))
    mine = []
    for d in ex.devices:
        local = np.asarray(ex.host_value(d, t)).reshape(rows, -1)
        mine.append(_device_best(local, spans.get(d, [])))
    received = 0
    if len(ex.devices) < ex.plan.n_devices:
        counts = [3 * rows] * ex.plan.n_devices
        parts = ex.backend.collective.allgather([m.reshape(-1) for m in mine], counts)
        every = [np.asarray(p).reshape(3, rows) for p in parts]
        received = 8 * 3 * rows * (ex.plan.n_devices - len(ex.devices))
    else:
        every = mine
    return combine(every), received


def combine(every: list[np.ndarray]) -> list[int | None]:
    """Every device's [3, rows] (`_device_best`) -> per row the global pick (None: not finite)."""
    stacked = np.stack(every)                    # [devices, 3, rows]
    vals, idxs, fin = stacked[:, 0], stacked[:, 1], stacked[:, 2].min(axis=0) > 0
    top = vals.max(axis=0)
    tied = np.where(vals == top, idxs, np.inf).min(axis=0)   # the lowest index holding the max
    return [int(i) if f else None for i, f in zip(tied, fin)]

