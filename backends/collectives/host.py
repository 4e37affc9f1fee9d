"""Run an all-reduce schedule on numpy buffers: the collective of devices simulated in one process.

`prepare_schedule` turns a Schedule into a list of numpy calls over views fixed at prepare
time, so a decode step pays only the calls. Two rules keep it cheap and exact:

- a round's source range is copied to a temporary only when the same round writes it (the
  ring never needs one);
- two transfers that swap and add the same range (the butterfly's doubling rounds) become one
  add and one copy: a + b and b + a are the same float, so the bits equal the two adds.

A compiled path can stand in for a schedule when it has the same bits (`HOST_KERNELS`: the C
butterfly of `cpu_kernels`); the choice is explicit in `HostCollective`, never silent.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from metatp.backends.numpy import native
from metatp.backends.collectives.base import Collective, Group, Step
from metatp.backends.collectives.schedule import (Mode, Schedule, Transfer, TransferOp, check_schedule, mode_names,
                                                  resolve_mode)
from metatp.ir.errors import ConfigError

__all__ = ["HostCollective", "HOST_KERNELS", "host_mode", "prepare_schedule", "run_schedule", "allreduce"]

# Compiled runners with exactly a schedule's bits: mode name -> prepare(bufs, active) -> step or
# None (None: these buffers don't suit it; the schedule runs on numpy instead).
HOST_KERNELS: dict[str, Callable[[list[np.ndarray], list[bool]], Step | None]] = {
    "butterfly": native.prepare_allreduce,
}


def host_mode(name: str) -> Mode:
    """The mode a host backend runs for an option value ("auto": the butterfly, as today)."""
    mode = resolve_mode(name, auto="butterfly")
    if mode.device_only:
        runnable = [m for m in mode_names() if not resolve_mode(m).device_only]
        raise ConfigError(f"allreduce={name!r} is a device-side collective: {mode.summary}; "
                          f"the numpy backend runs one of {', '.join(runnable)}")
    return mode


def _check_bufs(bufs: Sequence[np.ndarray], active: Sequence[bool] | None) -> list[bool]:
    if active is None:
        active = [True] * len(bufs)
    if len(active) != len(bufs):
        raise ValueError(f"active has {len(active)} entries for {len(bufs)} buffers")
    if any(b.shape != bufs[0].shape or b.dtype != bufs[0].dtype for b in bufs):
        raise ValueError("all-reduce buffers must share one shape and dtype")
    return [bool(a) for a in active]


def _zero_step(bufs: Sequence[np.ndarray], active: list[bool]) -> list[tuple]:
    """Fill (not multiply: that keeps NaN) the buffers of devices that computed nothing."""
    return [(np.ndarray.fill, (b, 0)) for b, on in zip(bufs, active) if not on]


def _round_calls(rnd: Sequence[Transfer], region: Callable[[int, int, int], np.ndarray]) -> list[tuple]:
    """numpy calls for one round: snapshots of sources this round overwrites, then the writes."""
    def key(t):
        return (t.dst, t.src, t.op, t.start, t.length)

    present = {key(t) for t in rnd}
    paired = {key(t) for t in rnd
              if t.op is TransferOp.ADD and (t.src, t.dst, t.op, t.start, t.length) in present}
    writes = [(t.dst, t.start, t.start + t.length) for t in rnd]
    snaps, calls = [], []
    for t in rnd:
        if key(t) in paired:
            if t.dst < t.src:       # one add for the pair, then the partner takes the sum
                a, b = region(t.dst, t.start, t.length), region(t.src, t.start, t.length)
                calls += [(np.add, (a, b, a)), (np.copyto, (b, a))]
            continue
        src = region(t.src, t.start, t.length)
        if any(d == t.src and lo < t.start + t.length and t.start < hi for d, lo, hi in writes):
            tmp = np.empty_like(src)
            snaps.append((np.copyto, (tmp, src)))
            src = tmp
        dst = region(t.dst, t.start, t.length)
        calls.append((np.add, (dst, src, dst)) if t.op is TransferOp.ADD else (np.copyto, (dst, src)))
    return snaps + calls


def prepare_schedule(bufs: Sequence[np.ndarray], s: Schedule, active: Sequence[bool] | None = None) -> Step:
    """A step that all-reduces `bufs` in place by schedule `s` (flat element ranges of each
    buffer in C order). Buffers may be strided views; if a partial range meets one that is not
    contiguous, the step works on contiguous copies and writes the result back."""
    flags = _check_bufs(bufs, active)
    if len(bufs) != s.n_devices or (bufs and bufs[0].size != s.n_elements):
        raise ValueError(f"schedule is for {s.n_devices} x {s.n_elements} elements, "
                         f"got {len(bufs)} x {bufs[0].size if bufs else 0}")
    check_schedule(s)
    calls = _zero_step(bufs, flags)
    partial = any(t.length != s.n_elements for rnd in s.rounds for t in rnd)
    work = list(bufs)
    staged = partial and not all(b.flags.c_contiguous for b in bufs)
    if staged:
        work = [np.array(b, order="C") for b in bufs]
        calls += [(np.copyto, (w, b)) for w, b in zip(work, bufs)]
    flat = [w.reshape(-1) if w.flags.c_contiguous else None for w in work]

    def region(d: int, start: int, length: int) -> np.ndarray:
        if start == 0 and length == s.n_elements:
            return work[d]
        return flat[d][start:start + length]

    for rnd in s.rounds:
        calls += _round_calls(rnd, region)
    if staged:
        calls += [(np.copyto, (b, w)) for w, b in zip(work, bufs)]

    def run() -> None:
        for f, args in calls:
            f(*args)
    return run


def run_schedule(bufs: Sequence[np.ndarray], s: Schedule, active: Sequence[bool] | None = None) -> None:
    """Prepare and run once (tests, one-off reductions)."""
    prepare_schedule(bufs, s, active)()


class HostCollective(Collective):
    """The Collective of devices simulated in one process, for a mode of the table.

    use_kernels: run the mode's compiled path (`HOST_KERNELS`) when it has one and the buffers
    suit it; it has the schedule's bits, so the choice changes speed, never results."""

    def __init__(self, mode: str = "auto", *, use_kernels: bool = False, group: Group | None = None) -> None:
        self.mode = host_mode(mode)
        self.name = self.mode.name
        self.use_kernels = use_kernels
        if group is not None and not group.all_local:
            raise ConfigError("the host collective needs every device of its group in this process")
        self.group = group

    def prepare_allreduce(self, bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None,
                          stream: Any = None) -> Step:
        """The step summing `bufs` in place (`stream`: unused, the host runs it on the caller's thread)."""
        if not bufs:
            return lambda: None
        flags = _check_bufs(bufs, active)
        if self.group is not None and len(bufs) != self.group.size:
            raise ValueError(f"{len(bufs)} buffers for a group of {self.group.size} devices")
        kernel = HOST_KERNELS.get(self.name) if self.use_kernels and len(bufs) > 1 else None
        step = kernel(list(bufs), flags) if kernel is not None else None
        if step is not None:
            return step
        return prepare_schedule(bufs, self.mode.schedule(len(bufs), bufs[0].size), flags)

    def allreduce(self, bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None) -> None:
        self.prepare_allreduce(bufs, active)()

    def for_devices(self, devices: Sequence[int]) -> HostCollective:
        """The same mode over a subset of the devices (-sm layer,tensor: one stage's tensor group)."""
        return HostCollective(self.mode.name, use_kernels=self.use_kernels, group=Group(tuple(devices)))


def allreduce(bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None, mode: str = "auto") -> None:
    """Sum `bufs` in place with `mode` on the host (numpy only, no compiled path)."""
    HostCollective(mode).allreduce(bufs, active)
