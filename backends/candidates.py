"""Sampling candidates read from vocabulary-split logits without gathering the vocabulary.

A sampled row needs the whole vocabulary only where the sampler may pick from all of it. Where
the output layer is split along the vocabulary, each device reduces its slice, per row, to its
K largest logits (values and global ids, sorted by value then id), its largest value and the sum
of exp(logit - that value), at temperature 1 and at the row's sampling temperature: 2K + 5
numbers instead of its slice, in one all-gather. A request's penalties and logit_bias (its
step's `Adjustment`, made by `metatp.penalties`) are applied by each device to its own slice first
(`adjust(shard, adj, lo)`: the same float64 sums as on the whole row), so the candidates, the
bound and the mass are of the adjusted logits; the max, sum and finiteness stay the raw ones'.

Every process then holds the same `RowCandidates` per row: the merged candidates, an upper
bound on every logit not among them (the K-th value of each device that holds more than K;
`bound`), the log-sum-exp of the whole row (`lse`, the softmax's normaliser up to float
rounding) and the mass of the whole row at the temperature (`mass`, what top-p's nucleus is a
share of). The sampler (`metatp.sampling.CandidateSpec.covers`) decides from these alone, alike
on every process, whether they cover everything it may pick; where not, the caller reads the
whole row. In one process with simulated devices nothing crosses, and the row is not put
together; on CuPy each device's slice is copied to the host and reduced there (`host_value`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from metatp.ir.tensor import Tensor
from metatp.backends.logit_adjustment import Adjustment, adjust

__all__ = ["RowCandidates", "read_candidates", "candidates_pay", "device_candidates", "merge_rows"]


@dataclass(frozen=True)
class RowCandidates:
    """One row of logits as every process holds it after the all-gather.

    `values` [devices, K] (float64 logits, adjusted) and `ids` [devices, K] (global token ids): each
    device's K largest, by value then id, padded with -inf / -1 where it holds fewer; `sizes`:
    how many vocabulary entries each device holds; `maxes`, `sums`: each device's largest logit
    and sum of exp(logit - largest) (float64, raw logits); `tsums`, `amaxes`: each device's sum
    of exp((logit - amax) / temperature) at `temperature` and its largest logit amax, after the
    request's adjustment (values are too); `finite`: every raw logit of the row is finite."""

    values: np.ndarray
    ids: np.ndarray
    sizes: tuple[int, ...]
    maxes: np.ndarray
    sums: np.ndarray
    finite: bool
    n_vocab: int
    tsums: np.ndarray
    amaxes: np.ndarray
    temperature: float = 1.0

    @property
    def k(self) -> int:
        return self.values.shape[1]

    def narrowed(self, k: int) -> "RowCandidates":
        """The candidates each device would have sent with `k` (<= K) per row: its first k."""
        if k >= self.k:
            return self
        return RowCandidates(self.values[:, :k], self.ids[:, :k], self.sizes, self.maxes, self.sums,
                             self.finite, self.n_vocab, self.tsums, self.amaxes, self.temperature)

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, their logits, float64) of every device's candidates."""
        real = self.ids >= 0
        ids, vals = self.ids[real], self.values[real]
        order = np.argsort(ids, kind="stable")
        return ids[order], vals[order]

    def bound(self) -> float:
        """A value no logit outside the candidates exceeds: the largest K-th value of a device
        that holds more than K (-inf: the candidates are the whole vocabulary)."""
        rest = [float(self.values[d, -1]) for d, n in enumerate(self.sizes) if n > self.k]
        return max(rest, default=-math.inf)

    @property
    def lse(self) -> float:
        """log(sum(exp(logits))) over the whole row, from each device's max and sum."""
        m = float(self.maxes.max())
        return m + math.log(float((self.sums * np.exp(self.maxes - m)).sum()))

    def mass(self) -> float:
        """sum(exp((logit - max) / temperature)) over the whole (adjusted) row, from each device's."""
        m = self.amaxes.max()
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            scale = np.where(self.amaxes > -np.inf, np.exp((self.amaxes - m) / self.temperature), 0.0)
            return float((self.tsums * scale).sum())


def _columns(spans: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(local columns, their global token ids) of a device's chunks (global start, local start, length)."""
    cols = [np.arange(loc, loc + n) for _, loc, n in spans]
    gids = [np.arange(g, g + n) for g, _, n in spans]
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(cols) if cols else empty), (np.concatenate(gids) if gids else empty)


def device_candidates(local: np.ndarray, spans: list[tuple[int, int, int]], k: int,
                      temps: list[float] | None = None, adjs: list[Adjustment | None] | None = None) -> np.ndarray:
    """[rows, 2k + 5] float64 for one device's slice `local` [rows, n_local]: its k largest
    logits (by value, then lower id) after the row's adjustment (`adjs`), their global ids (-inf
    / -1 padding where it holds fewer), its raw max, its sum of exp(x - max), whether all its
    raw logits are finite, and after the adjustment its sum of exp((x - amax) / T) at the row's
    temperature T (`temps`, default 1) and its max amax. Row by row, so that a row's numbers do
    not depend on the rows beside it."""
    rows = local.shape[0]
    cols, gid = _columns(spans)
    n_local = cols.size
    out = np.empty((rows, 2 * k + 5))
    out[:, :k], out[:, k:2 * k] = -np.inf, -1
    kk = min(k, n_local)
    for r in range(rows):
        x = np.asarray(local[r, cols], dtype=np.float32)
        finite = bool(np.isfinite(x).all())
        x64 = np.where(np.isnan(x), -np.inf, x.astype(np.float64))
        m = float(x64.max()) if n_local else -math.inf
        out[r, 2 * k] = m
        out[r, 2 * k + 1] = float(np.exp(x64 - m).sum()) if finite and n_local else 0.0
        out[r, 2 * k + 2] = 1.0 if finite else 0.0
        adj = None if adjs is None else adjs[r]
        xa = x64 if adj is None else _adjusted(x64, adj, spans)
        at = np.arange(n_local) if kk == n_local else np.argpartition(-xa, kk - 1)[:kk]
        at = at[np.lexsort((gid[at], -xa[at]))]
        out[r, :kk], out[r, k:k + kk] = xa[at], gid[at]
        temp = 1.0 if temps is None or not temps[r] > 0 else temps[r]
        am = float(xa.max()) if n_local else -math.inf
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            out[r, 2 * k + 3] = float(np.exp((xa - am) / temp).sum()) if finite and am > -math.inf else 0.0
        out[r, 2 * k + 4] = am
    return out


def _adjusted(x64: np.ndarray, adj: Adjustment, spans: list[tuple[int, int, int]]) -> np.ndarray:
    """A device's row (its chunks one after another) with the request's adjustment, chunk by chunk."""
    out, off = x64.copy(), 0
    for g, _, n in spans:
        out[off:off + n] = adjust(x64[off:off + n], adj, g)
        off += n
    return out


def merge_rows(every: list[np.ndarray], sizes: list[int], k: int, n_vocab: int,
               temps: list[float] | None = None) -> list[RowCandidates]:
    """Every device's `device_candidates` -> one RowCandidates per row."""
    stacked = np.stack(every)                       # [devices, rows, 2k + 5]
    out = []
    for r in range(stacked.shape[1]):
        part = stacked[:, r]
        out.append(RowCandidates(part[:, :k].copy(), part[:, k:2 * k].astype(np.int64),
                                 tuple(sizes), part[:, 2 * k].copy(), part[:, 2 * k + 1].copy(),
                                 bool(part[:, 2 * k + 2].min() > 0), n_vocab, part[:, 2 * k + 3].copy(),
                                 part[:, 2 * k + 4].copy(), 1.0 if temps is None else temps[r]))
    return out


def _split(ex: Any, t: Tensor) -> bool:
    st = ex.plan.of(t).sync_state
    return ex.plan.n_devices > 1 and not (st.is_mirrored or st.is_partial or st.axis != 0)


def candidates_pay(ex: Any, t: Tensor, k: int) -> bool:
    """Are `k` candidates per device fewer bytes than the row (a small vocabulary over many
    devices is cheaper gathered)? Only where `t` is split along the vocabulary. A row's own k
    decides, not its batch-mates', so its path does not depend on them."""
    return _split(ex, t) and 8 * (2 * k + 5) * ex.plan.n_devices < ex.itemsize(t) * int(t.ne[0])


def read_candidates(ex: Any, t: Tensor, k: int, temps: list[float] | None = None,
                    adjs: list[Adjustment | None] | None = None) -> tuple[list[RowCandidates] | None, int]:
    """Per row of the logits `t` ([n_vocab, rows] in ggml order) on the plan executor `ex`, its
    `RowCandidates` with `k` per device (after `adjs[row]`, its mass at `temps[row]`); None where
    `t` is not split along the vocabulary (the caller reads the row: nothing to save). Also the
    bytes this process received for it (one all-gather of 2k + 5 float64 per row and device; 0
    in one process). Every process of the plan makes this call alike."""
    if not _split(ex, t):
        return None, 0
    st = ex.plan.of(t).sync_state
    ex.backend.synchronize()
    rows = int(np.prod(t.ne[1:]))
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for j, g, loc, length in st.chunks():
        spans.setdefault(j, []).append((g, loc, length))
    sizes = [sum(s[2] for s in spans.get(d, [])) for d in range(ex.plan.n_devices)]
    mine = []
    for d in ex.devices:
        local = np.asarray(ex.host_value(d, t)).reshape(rows, -1)
        mine.append(device_candidates(local, spans.get(d, []), k, temps, adjs))
    width = 2 * k + 5
    received = 0
    if len(ex.devices) < ex.plan.n_devices:
        counts = [width * rows] * ex.plan.n_devices
        parts = ex.backend.collective.allgather([m.reshape(-1) for m in mine], counts)
        every = [np.asarray(p).reshape(rows, width) for p in parts]
        received = 8 * width * rows * (ex.plan.n_devices - len(ex.devices))
    else:
        every = mine
    return merge_rows(every, sizes, k, int(t.ne[0]), temps), received
