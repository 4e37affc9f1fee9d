"""Device faults as metatp's typed errors, and the state of a device that failed.

A device library raises its own exceptions: CuPy's OutOfMemoryError, CUDA runtime and driver
errors carrying a status number, NCCL and cuBLAS errors. `DeviceFaults.translate` turns them, once
and by type, into `DeviceMemoryError` (the bytes asked for and the bytes free), `DeviceFaultError`
(naming the kernel where one was launched) and `CollectiveError` (naming the NCCL call and its
GPUs). A runtime (`runtime.CupyRuntime`; the emulator's `EmuRuntime` with stand-in types) holds
one `DeviceFaults` built from its library's exception types (`LibraryErrors`), wraps its device
calls in `guard`, and hands the launchers `CheckedKernel`s.

Out of memory leaves the device usable: what fits still runs. A sticky CUDA error (an illegal
address, a device assert, a failed launch: the context is unusable afterwards) or a failed NCCL
communicator marks the runtime failed (`failed`): every later call is refused at once with that
error (`DeviceFaultError.again`) instead of queueing behind a dead context or waiting for a
collective that will not return. Errors met while a CUDA graph is being captured mark nothing:
the capture is abandoned and the step runs another way (`capture.Runner`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from metatp.ir.errors import CollectiveError, DeviceError, DeviceFaultError, DeviceMemoryError

__all__ = ["LibraryErrors", "DeviceFaults", "CheckedKernel", "cupy_errors", "allocating", "STICKY_CUDA_ERRORS"]

#: CUDA errors after which the context is unusable (cudaError_t and CUresult share these numbers):
#: ECC uncorrectable, illegal address, launch timeout, device assert, hardware stack error, illegal
#: instruction, misaligned address, invalid address space, invalid PC, launch failure
STICKY_CUDA_ERRORS = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})
_CUDA_OUT_OF_MEMORY = 2          # cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY
_CUBLAS_ALLOC_FAILED = 3


@dataclass(frozen=True)
class LibraryErrors:
    """A device library's exception types, by what they mean. `cuda` and `blas` errors carry
    the library's status number as `.status`."""

    out_of_memory: tuple[type[BaseException], ...] = ()
    cuda: tuple[type[BaseException], ...] = ()
    nccl: tuple[type[BaseException], ...] = ()
    blas: tuple[type[BaseException], ...] = ()

    @property
    def all(self) -> tuple[type[BaseException], ...]:
        return self.out_of_memory + self.cuda + self.nccl + self.blas


def cupy_errors() -> LibraryErrors:
    """CuPy's memory and CUDA exception types. NCCL's and cuBLAS's join when those libraries load
    (`DeviceFaults.learn`): importing them here would load them for every runtime."""
    from cupy.cuda.memory import OutOfMemoryError
    from cupy_backends.cuda.api.driver import CUDADriverError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    return LibraryErrors((OutOfMemoryError,), (CUDARuntimeError, CUDADriverError))


def _words(e: BaseException) -> str:
    """The library's own message, one line (its status name and meaning)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class DeviceFaults:
    """One runtime's translation of its library's exceptions, and whether its device failed.

    current_gpu: the id of the GPU calls go to now (asked only when an error names none);
    free_bytes(gpu): what the device can still give (asked only after an allocation failed)."""

    def __init__(self, errors: LibraryErrors, current_gpu: Callable[[], int],
                 free_bytes: Callable[[int], int]) -> None:
        self.errors = errors
        self.types = errors.all
        self.failed: DeviceFaultError | None = None
        self.capturing = 0                  # CUDA graph captures in progress (their errors mark nothing)
        self._current_gpu = current_gpu
        self._free_bytes = free_bytes

    def learn(self, **kinds: tuple[type[BaseException], ...]) -> None:
        """Add the exception types of a library loaded later (nccl=..., blas=...)."""
        self.errors = replace(self.errors, **kinds)
        self.types = self.errors.all

    def check(self) -> None:
        """Refuse at once when the device has failed."""
        if self.failed is not None:
            raise self.failed.again()

    def guard(self, gpu: int | None = None, needed: int | None = None) -> "_Guard":
        """``with faults.guard(...)``: refuse when failed; a library error inside comes out typed
        (`needed`: the bytes an allocation asks for)."""
        return _Guard(self, gpu, needed)

    def translate(self, e: BaseException, gpu: int | None = None, needed: int | None = None,
                  kernel: str | None = None, op: str | None = None,
                  gpus: tuple[int, ...] | None = None, marks: bool = True) -> DeviceError:
        """`e` (one of `types`) as metatp's error; a sticky one marks this runtime failed. `op` and
        `gpus`: the NCCL call and the GPUs of its communicators. marks=False: an error that
        leaves the device as it was (a communicator that failed to start ran no work)."""
        errors = self.errors
        if gpu is None and not isinstance(e, errors.nccl):
            gpu = self._ask(self._current_gpu)
        status = e.status if isinstance(e, errors.cuda + errors.blas) else None   # the library's number
        if (isinstance(e, errors.out_of_memory) or (isinstance(e, errors.cuda) and status == _CUDA_OUT_OF_MEMORY)
                or (isinstance(e, errors.blas) and status == _CUBLAS_ALLOC_FAILED)):
            free = None if gpu is None else self._ask(lambda: self._free_bytes(gpu))
            return DeviceMemoryError(gpu, needed, free)
        marks = marks and not self.capturing
        if isinstance(e, errors.nccl):
            err: DeviceFaultError = CollectiveError(op or "call", tuple(gpus or ()), _words(e), sticky=marks)
        elif isinstance(e, errors.blas):
            err = DeviceFaultError(gpu, _words(e), kernel or "cuBLAS gemm", sticky=False)
        else:
            err = DeviceFaultError(gpu, _words(e), kernel, sticky=marks and status in STICKY_CUDA_ERRORS)
        if err.sticky and self.failed is None:
            self.failed = err
        return err

    @staticmethod
    def _ask(query: Callable[[], int]) -> int | None:
        """A query of a device that may have failed: None when it cannot answer."""
        try:
            return int(query())
        except Exception:  # noqa: BLE001 - a broken context answers nothing
            return None


class _Guard:
    """The context manager `DeviceFaults.guard` returns (a small class: it wraps every copy and
    graph launch of a step)."""

    __slots__ = ("faults", "gpu", "needed")

    def __init__(self, faults: DeviceFaults, gpu: int | None, needed: int | None) -> None:
        self.faults, self.gpu, self.needed = faults, gpu, needed

    def __enter__(self) -> None:
        self.faults.check()

    def __exit__(self, kind, e, tb) -> bool:
        if e is not None and isinstance(e, self.faults.types):
            raise self.faults.translate(e, self.gpu, self.needed) from e
        return False


class CheckedKernel:
    """A compiled kernel whose launch errors come out typed, naming it: what a runtime's
    `kernel()` hands the launchers, called like a ``cupy.RawKernel``."""

    __slots__ = ("raw", "name", "gpu", "faults")

    def __init__(self, raw: Any, name: str, gpu: int, faults: DeviceFaults) -> None:
        self.raw, self.name, self.gpu, self.faults = raw, name, gpu, faults

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = n

    def __call__(self, grid, block, args, shared_mem: int = 0, programmatic: bool = False) -> None:
        """Launch; `programmatic`: with the programmatic stream serialization attribute (the raw
        kernel must take it: the runtime hands out such kernels once pdl is enabled)."""
        faults = self.faults
        if faults.failed is not None:
            raise faults.failed.again()
        try:
            if programmatic:
                self.raw(grid, block, args, shared_mem=shared_mem, programmatic=True)
            else:
                self.raw(grid, block, args, shared_mem=shared_mem)
        except faults.types as e:
            raise faults.translate(e, self.gpu, kernel=self.name) from e


@contextlib.contextmanager
def allocating(what: str) -> Iterator[None]:
    """Name what the allocations inside are for (a weight, the KV cache, a plan's buffers) in
    their DeviceMemoryError: the runtime knows only the bytes. The innermost name wins."""
    try:
        yield
    except DeviceMemoryError as e:
        if e.what is None:
            e.what = what
            e.args = (e.gpu, e.needed, e.free, what)
        raise
