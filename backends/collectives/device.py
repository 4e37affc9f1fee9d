"""Lower an all-reduce `Schedule` to device steps: copies, in-place adds, event records and waits.

A device backend runs each device's steps on that device's stream; streams run concurrently,
so the schedule's rule "within a round every read happens before any write" becomes events.
Per round:

1. every destination waits until its source's buffer holds the round's value (the source's
   `ready` event), copies the source's range [start, start + length) into its receive buffer
   (an ADD, or a COPY into a range someone else reads this round) or straight into its own
   buffer (any other COPY), and records `read_done`;
2. every source waits for the `read_done` of each device that read it (only then may it
   change its own buffer);
3. every destination adds the received range into its own (ADD) or moves it in (a staged
   COPY), and records `ready`.

Only each transfer's range moves, so the ring sends 2(n-1)/n of the buffer per device and the
butterfly whole buffers. What a device does is the backend's (`DeviceSteps`: its streams,
copies and add kernel); which dtype travels is the caller's choice (`wire.wire_dtype`): the
buffers given here already hold the wire type. Zeroing the inactive devices' buffers and any
conversion to and from the wire type come before and after these steps.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from metatp.backends.collectives.base import Step
from metatp.backends.collectives.schedule import Schedule, TransferOp, check_schedule

__all__ = ["DeviceSteps", "lower_schedule"]


class DeviceSteps(Protocol):
    """Steps on device d's stream (buffers are flat, contiguous, of the wire type)."""

    def copy(self, d: int, dst: Any, src: Any) -> list[Step]:
        """dst[...] = src (same length; src may live on another device)."""

    def add(self, d: int, dst: Any, src: Any) -> list[Step]:
        """dst += src (both on device d)."""

    def record(self, d: int, event: Any) -> Step:
        ...

    def wait(self, d: int, event: Any) -> Step:
        ...


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(a < end and start < b for a, b in ranges)


def lower_schedule(s: Schedule, send: Sequence[Any], recv: Sequence[Any], dev: DeviceSteps,
                   ready: Sequence[Any], read_done: Sequence[Any]) -> list[tuple[int, list[Step]]]:
    """[(device, steps)] in issue order for schedule `s` over `send[d]` (each device's value,
    reduced in place) with `recv[d]` as receive scratch of the same length. `ready[d]` and
    `read_done[d]` are device d's two events. The first step of every device records `ready`
    (the caller's prologue has put the value in place)."""
    check_schedule(s)
    if len(send) != s.n_devices or len(recv) != s.n_devices:
        raise ValueError(f"schedule for {s.n_devices} devices, got {len(send)} / {len(recv)} buffers")
    out: list[tuple[int, list[Step]]] = [(d, [dev.record(d, ready[d])]) for d in range(s.n_devices)]
    for rnd in s.rounds:
        read_ranges: dict[int, list[tuple[int, int]]] = {}
        for t in rnd:
            read_ranges.setdefault(t.src, []).append((t.start, t.start + t.length))
        staged = set()
        for i, t in enumerate(rnd):                       # 1. reads
            lo, hi = t.start, t.start + t.length
            direct = t.op is TransferOp.COPY and not _overlaps(read_ranges.get(t.dst, []), lo, hi)
            target = send[t.dst] if direct else recv[t.dst]
            if not direct:
                staged.add(i)
            out.append((t.dst, [dev.wait(t.dst, ready[t.src]), *dev.copy(t.dst, target[lo:hi], send[t.src][lo:hi]),
                                dev.record(t.dst, read_done[t.dst])]))
        for t in rnd:                                     # 2. sources wait for their readers
            out.append((t.src, [dev.wait(t.src, read_done[t.dst])]))
        for i, t in enumerate(rnd):                       # 3. writes
            lo, hi = t.start, t.start + t.length
            steps: list[Step] = []
            if t.op is TransferOp.ADD:
                steps += dev.add(t.dst, send[t.dst][lo:hi], recv[t.dst][lo:hi])
            elif i in staged:
                steps += dev.copy(t.dst, send[t.dst][lo:hi], recv[t.dst][lo:hi])
            steps.append(dev.record(t.dst, ready[t.dst]))
            out.append((t.dst, steps))
    return out
