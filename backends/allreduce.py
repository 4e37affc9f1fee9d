"""In-place all-reduce (sum) over per-device buffers: llama.cpp's fallback butterfly (digest §6).

Devices that did not compute the value (empty slice) contribute zeros: their buffers are
*filled* with zeros first (not multiplied by 0, which keeps NaN garbage).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["allreduce_butterfly", "allreduce_sum", "reduce_steps"]


def _zero_inactive(bufs: Sequence[np.ndarray], active: Sequence[bool] | None) -> None:
    if active is None:
        return
    if len(active) != len(bufs):
        raise ValueError(f"active has {len(active)} entries for {len(bufs)} buffers")
    for b, on in zip(bufs, active):
        if not on:
            b.fill(0)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def reduce_steps(n: int) -> int:
    """Temporary-buffer steps the butterfly takes: ceil(log2 n) (fold + recursive doubling)."""
    return (n - 1).bit_length() if n > 1 else 0


def allreduce_butterfly(bufs: list[np.ndarray], active: Sequence[bool] | None = None) -> None:
    """Sum `bufs` in place with the bits of llama.cpp's butterfly; every buffer ends the same.

    The butterfly (fold the devices beyond the largest power of two `p2` into 0..n-p2-1, then at
    distance off = p2/2, ..., 1 every device adds its partner's value, then copy back to the
    folded ones) leaves partners j and j^off with equal values after each step, because float
    addition is commutative. So the lower half of each step already holds every value, and
    this computes just that half — one add per pair and one broadcast, no temporaries — with
    the same bits as the full exchange."""
    n = len(bufs)
    _zero_inactive(bufs, active)
    if n <= 1:
        return
    p2 = _pow2_floor(n)
    for j in range(p2, n):                       # fold
        np.add(bufs[j - p2], bufs[j], out=bufs[j - p2])
    off = p2 // 2
    while off >= 1:
        for j in range(off):
            np.add(bufs[j], bufs[j + off], out=bufs[j])
        off //= 2
    for j in range(1, n):                        # every device receives the result
        np.copyto(bufs[j], bufs[0])


def allreduce_sum(bufs: list[np.ndarray], active: Sequence[bool] | None = None) -> None:
    """The plain reference: every buffer becomes the sum of the active ones (in device order)."""
    _zero_inactive(bufs, active)
    if len(bufs) <= 1:
        return
    total = np.array(bufs[0], copy=True)
    for b in bufs[1:]:
        total += b
    for b in bufs:
        b[...] = total
