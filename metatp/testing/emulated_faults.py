"""Injected device faults for the emulated runtime: the emulated library's exception types (what
CuPy and NCCL would raise) and the plan of which call fails.

`EmuRuntime.inject(kind, after_n_calls)` arms one `Injection`; the runtime calls `trip(kind)` at
each call of that kind, and the call that trips raises the emulated library's exception *inside*
the runtime's guard, so the backend meets the typed errors the real runtime's translation gives
(`backends.cuda.faults`). Kinds:

- "oom": device allocations (empty, zeros, upload, pinned) of at least `min_bytes`: an
  `EmulatedOutOfMemory`, as CuPy's memory pool raises it;
- "launch": kernels as they run (launched eagerly, or replayed in a CUDA graph: then the graph
  launch fails, as a fault surfaces at the next call on a GPU): an `EmulatedCudaError` of `status`
  (default 719, cudaErrorLaunchFailure: sticky; 701, too many resources, is not);
- "nccl": NCCL all-reduces, sends and receives as they are called (a captured graph calls them
  once, while it is captured: an error there abandons the capture): an `EmulatedNcclError` of
  `status` (default 2, ncclSystemError).
"""

from __future__ import annotations

from dataclasses import dataclass

from metatp.backends.cuda.faults import LibraryErrors

__all__ = ["EmulatedOutOfMemory", "EmulatedCudaError", "EmulatedNcclError", "EMULATED_ERRORS", "Injection",
           "FaultPlan", "KINDS"]

KINDS = ("oom", "launch", "nccl")

_CUDA_WORDS = {
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    701: ("cudaErrorLaunchOutOfResources", "too many resources requested for launch"),
    710: ("cudaErrorAssert", "device-side assert triggered"),
    716: ("cudaErrorMisalignedAddress", "misaligned address"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
    900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"),
}
_NCCL_WORDS = {
    1: ("ncclUnhandledCudaError", "call to CUDA function failed"),
    2: ("ncclSystemError", "unhandled system error"),
    3: ("ncclInternalError", "internal error"),
    6: ("ncclRemoteError", "remote process exited or there was a network error"),
}


class EmulatedOutOfMemory(MemoryError):
    """CuPy's OutOfMemoryError, emulated."""

    def __init__(self, size: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (emulated).")
        self.size = size


class EmulatedCudaError(RuntimeError):
    """CuPy's CUDARuntimeError, emulated: `status` is the cudaError_t number; `detail`, what the
    emulator saw (the kernel, the address), follows CUDA's words on the same line."""

    def __init__(self, status: int, detail: str = "") -> None:
        name, meaning = _CUDA_WORDS.get(status, (f"cudaError{status}", "emulated error"))
        super().__init__(f"{name}: {meaning}" + (f" ({detail})" if detail else ""))
        self.status = status


class EmulatedNcclError(RuntimeError):
    """cupy's NcclError, emulated: `status` is the ncclResult_t number."""

    def __init__(self, status: int) -> None:
        name, meaning = _NCCL_WORDS.get(status, (f"ncclError{status}", "emulated error"))
        super().__init__(f"{name}: {meaning}")
        self.status = status


#: what the emulated runtime's `DeviceFaults` translates
EMULATED_ERRORS = LibraryErrors(out_of_memory=(EmulatedOutOfMemory,), cuda=(EmulatedCudaError,),
                                nccl=(EmulatedNcclError,))


@dataclass
class Injection:
    """One armed fault: `after` calls of its kind succeed, then `times` calls fail (None: every
    later one); an "oom" counts only allocations of at least `min_bytes`."""

    kind: str
    after: int = 0
    status: int | None = None
    min_bytes: int = 0
    times: int | None = 1

    def error(self, nbytes: int) -> Exception:
        if self.kind == "oom":
            return EmulatedOutOfMemory(nbytes)
        if self.kind == "launch":
            return EmulatedCudaError(719 if self.status is None else self.status)
        return EmulatedNcclError(2 if self.status is None else self.status)


class FaultPlan:
    """The armed injections of one emulated runtime, by kind; `fired` counts the faults raised."""

    def __init__(self) -> None:
        self.armed: dict[str, Injection] = {}
        self.fired = 0

    def arm(self, injection: Injection) -> None:
        if injection.kind not in KINDS:
            raise ValueError(f"unknown fault kind {injection.kind!r}; kinds: {', '.join(KINDS)}")
        if injection.after < 0 or (injection.times is not None and injection.times < 1):
            raise ValueError(f"after_n_calls must be >= 0 and times >= 1 or None, got {injection}")
        self.armed[injection.kind] = injection

    def clear(self) -> None:
        self.armed.clear()

    def trip(self, kind: str, nbytes: int = 0) -> None:
        """Called at every call of `kind`: raises the emulated library error when it is this call's turn."""
        inj = self.armed.get(kind)
        if inj is None or (kind == "oom" and nbytes < inj.min_bytes):
            return
        if inj.after > 0:
            inj.after -= 1
            return
        if inj.times is not None:
            inj.times -= 1
            if inj.times == 0:
                del self.armed[kind]
        self.fired += 1
        raise inj.error(nbytes)
