"""The small callables a CUDA step list is made of (so a step list is data, replayable and
capturable): memset, device-to-device copy, event record / wait, a library call on the device
stream, and host work.

Kernel launches are `launch.Launch` objects; everything else a step does is one of these. Whether
CUDA can capture a step into a graph (`capturable`): everything but `HostStep` (work CUDA cannot
capture: cupy ops that allocate) and a `StreamCall` whose library says no (a cuBLAS older than 12.2).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Memset", "Memcpy", "Record", "Wait", "StreamCall", "HostStep", "capturable"]


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


class StreamCall:
    """Work a host call issues on the device stream, such as a cuBLAS GEMM: ordered with the
    kernels around it and, where the library allows (`capturable`: the runtime's answer when the
    step was made, e.g. `gemm_capturable`), captured with them into the step's CUDA graph, so a
    plan of launches and stream calls replays one graph. Where it does not, the plan runs eagerly,
    as with a `HostStep`."""

    def __init__(self, fn: Callable[[], None], what: str, capturable: bool) -> None:
        self.fn = fn
        self.what = what
        self.capturable = bool(capturable)

    def __call__(self) -> None:
        self.fn()


class HostStep:
    """Work that is not a pre-recorded kernel launch and that CUDA cannot capture (cupy ops,
    which allocate): runs eagerly and keeps a plan out of CUDA-graph capture."""

    capturable = False

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self.fn = fn
        self.what = what

    def __call__(self) -> None:
        self.fn()


def capturable(step: Any) -> bool:
    """Can CUDA capture `step` into a graph? Launches, copies, memsets, records and waits can; a
    `StreamCall` when its library said so; a `HostStep` never."""
    return bool(getattr(step, "capturable", True))
