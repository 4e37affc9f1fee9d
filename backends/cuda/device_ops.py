"""The small callables a CUDA step list is made of (so a step list is data, replayable and
capturable): memset, device-to-device copy, event record / wait, and host work.

Kernel launches are `launch.Launch` objects; everything else a step does is one of these.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Memset", "Memcpy", "Record", "Wait", "HostStep"]


class Memset:
    """Zero `nbytes` at `ptr` on `stream`."""

    def __init__(self, rt: Any, ptr: int, nbytes: int, stream: Any) -> None:
        self.rt, self.ptr, self.nbytes, self.stream = rt, ptr, nbytes, stream

    def __call__(self) -> None:
        if self.nbytes:
            self.rt.memset(self.ptr, self.nbytes, self.stream)


class Memcpy:
    """Copy `nbytes` from `src` to `dst` (device addresses, possibly on two GPUs) on `stream`."""

    def __init__(self, rt: Any, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.rt, self.dst, self.src, self.nbytes, self.stream = rt, dst, src, nbytes, stream

    def __call__(self) -> None:
        if self.nbytes:
            self.rt.memcpy(self.dst, self.src, self.nbytes, self.stream)


class Record:
    """Record `event` on `stream` (what a `Wait` on another stream orders against)."""

    def __init__(self, rt: Any, stream: Any, event: Any) -> None:
        self.rt, self.stream, self.event = rt, stream, event

    def __call__(self) -> None:
        self.rt.record(self.stream, self.event)


class Wait:
    """Make `stream` wait for the last record of `event` issued before this step runs."""

    def __init__(self, rt: Any, stream: Any, event: Any) -> None:
        self.rt, self.stream, self.event = rt, stream, event

    def __call__(self) -> None:
        self.rt.wait(self.stream, self.event)


class HostStep:
    """Work that is not a pre-recorded kernel launch (cuBLAS, cupy ops): runs eagerly and
    keeps a plan out of CUDA-graph capture."""

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self.fn = fn
        self.what = what

    def __call__(self) -> None:
        self.fn()
