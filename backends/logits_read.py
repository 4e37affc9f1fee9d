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

import math
from typing import Any

import numpy as np

from metatp.backends.numpy.native import row_best
from metatp.ir.tensor import Tensor

__all__ = ["read_argmax", "combine"]


def _device_best(local: np.ndarray, spans: list[tuple[int, int, int]], threads: int | None = None) -> np.ndarray:
    """[3, rows]: (largest value, its global index, all finite) over this device's chunks
    (global start, local start, length), ties to the lower global index. A row is all finite
    exactly when its largest and smallest values are (argmax picks a NaN, min passes one on), so
    a chunk is read by two reductions and nothing its size is made; with the compiled kernels, by
    one pass on the kernel threads (`native.row_best`: a row's value and index are unspecified
    once it is not finite, so `finite` gates them; `threads`: the backend's kernel threads)."""
    rows = local.shape[0]
    best = np.full(rows, -np.inf)
    idx = np.zeros(rows)
    finite = np.ones(rows, dtype=bool)
    for g, loc, length in spans:
        part = local[:, loc:loc + length]
        picked = row_best(part, threads)         # one compiled pass on the kernel threads
        if picked is not None:
            val, at, fin = picked
            val = val.astype(np.float64)
            finite &= fin
        else:
            at = part.argmax(axis=1)
            val = np.take_along_axis(part, at[:, None], axis=1)[:, 0].astype(np.float64)
            finite &= np.isfinite(val) & np.isfinite(part.min(axis=1))
        better = finite & (val > best)           # strictly: an equal value later keeps the earlier index
        best = np.where(better, val, best)
        idx = np.where(better, g + at, idx)
    return np.stack([best, idx, finite.astype(np.float64)])


def _one_row(locals_: list[np.ndarray], spans: list[list[tuple[int, int, int]]]) -> int | None:
    """The pick of a single row held by devices in this process, in Python numbers: a decode
    step of one sequence, where numpy's per-call cost was most of the time (three reductions a
    chunk instead of a dozen array calls a device; at N=3 ~90 -> ~20 us a step)."""
    best, pick, finite = -math.inf, 0, True
    for local, chunks in zip(locals_, spans):
        for g, loc, length in chunks:
            part = local[0, loc:loc + length]
            at = int(part.argmax())
            val = float(part[at])
            finite = finite and math.isfinite(val) and math.isfinite(float(part.min()))
            if val > best or (val == best and g + at < pick):
                best, pick = val, g + at
    return pick if finite else None


def _spans(ex: Any, t: Tensor) -> dict[int, list[tuple[int, int, int]]]:
    """Per device the (global start, local start, length) of its vocabulary chunks: fixed by the
    plan, so worked out once per executable."""
    memo = ex.__dict__.setdefault("_argmax_spans", {})
    hit = memo.get(t)
    if hit is None:
        hit = memo[t] = {}
        for j, g, loc, length in ex.plan.of(t).sync_state.chunks():
            hit.setdefault(j, []).append((g, loc, length))
    return hit


def read_argmax(ex: Any, t: Tensor) -> tuple[list[int | None], int]:
    """Per row of the logits `t` ([n_vocab, rows] in ggml order) on the plan executor `ex`: the
    greedy token, or None where a logit is not finite. Also returns the bytes this process
    received for it (the small all-gather; 0 in one process)."""
    st = ex.plan.of(t).sync_state
    rows = int(np.prod(t.ne[1:]))
    if ex.plan.n_devices == 1:
        spans = {d: [(0, 0, int(t.ne[0]))] for d in ex.devices}
    elif st.is_mirrored or st.is_partial or st.axis != 0:
        full = ex.read(t)
        full = full.reshape(-1, full.shape[-1])
        ok = np.isfinite(full).all(axis=1)
        return [int(a) if f else None for a, f in zip(full.argmax(axis=1), ok)], 0
    else:
        spans = _spans(ex, t)
    ex.backend.synchronize()
    locals_ = [np.asarray(ex.host_value(d, t)).reshape(rows, -1) for d in ex.devices]
    whole = len(ex.devices) == ex.plan.n_devices
    if whole and rows == 1:
        return [_one_row(locals_, [spans.get(d, []) for d in ex.devices])], 0
    threads = ex.backend.describe().kernel_threads       # the user's kernel threads (None: the default)
    mine = [_device_best(local, spans.get(d, []), threads) for d, local in zip(ex.devices, locals_)]
    if whole:
        return combine(mine), 0
    counts = [3 * rows] * ex.plan.n_devices
    parts = ex.backend.collective.allgather([m.reshape(-1) for m in mine], counts)
    every = [np.asarray(p).reshape(3, rows) for p in parts]
    return combine(every), 8 * 3 * rows * (ex.plan.n_devices - len(ex.devices))


def combine(every: list[np.ndarray]) -> list[int | None]:
    """Every device's [3, rows] (`_device_best`) -> per row the global pick (None: not finite)."""
    stacked = np.stack(every)                    # [devices, 3, rows]
    vals, idxs, fin = stacked[:, 0], stacked[:, 1], stacked[:, 2].min(axis=0) > 0
    top = vals.max(axis=0)
    tied = np.where(vals == top, idxs, np.inf).min(axis=0)   # the lowest index holding the max
    return [int(i) if f else None for i, f in zip(tied, fin)]

