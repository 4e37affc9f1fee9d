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
    """Sum `bufs` in place with recursive doubling; every buffer ends with the same bits.

    1. zero-fill inactive devices; 2. fold the devices beyond the largest power of two `p2`
    into devices 0..n-p2-1; 3. butterfly over p2 devices: at distance off = p2/2, ..., 1 every
    device adds its partner's value (all copies of a step are taken before its adds);
    4. copy the result back to the folded devices."""
    n = len(bufs)
    _zero_inactive(bufs, active)
    if n <= 1:
        return
    p2 = _pow2_floor(n)
    for j in range(p2, n):                       # fold
        tmp = np.array(bufs[j], copy=True)
        bufs[j - p2] += tmp
    off = p2 // 2
    while off >= 1:
        tmps = [np.array(bufs[j ^ off], copy=True) for j in range(p2)]   # all sends before the adds
        for j in range(p2):
            bufs[j] += tmps[j]
        off //= 2
    for j in range(p2, n):                       # copy back
        bufs[j][...] = bufs[j - p2]


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
