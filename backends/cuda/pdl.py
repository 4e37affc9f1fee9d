"""Programmatic dependent launch (PDL) for CuPy kernels, through NVIDIA's cuda-bindings.

With the programmatic stream serialization attribute a kernel may start while the kernel before
it in the stream is still running: its blocks are scheduled once every block of the one before
has reached ``griddepcontrol.launch_dependents`` (or exited), and they wait in
``griddepcontrol.wait`` until it has completed and its writes are visible (quant.cuh's
``mt_pdl_wait`` / ``mt_pdl_launch_dependents``). What overlaps is the launch and scheduling of
one kernel with the tail of the previous one: on Hopper a few microseconds a kernel, which a
decode step of a few hundred kernels pays in full (llama.cpp reports +6-13% decode speed).
Stream capture records these programmatic edges into a CUDA graph (CUDA >= 12.3).

CuPy 14 launches a RawKernel through ``cuLaunchKernel`` only: it cannot set launch attributes.
So a programmatic launch goes through ``cuLaunchKernelEx`` of ``cuda.bindings.driver`` (the
``pdl`` extra: cuda-bindings 12.x, about 8 MB), with the CuPy kernel's ``CUfunction``
(``RawKernel.kernel.ptr``), CuPy's current stream and the arguments packed as CuPy packs them
(`pack_args`). Everything else stays CuPy's. Importing this module needs neither CuPy nor
cuda-bindings.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from metatp.ir.errors import BackendUnavailableError

__all__ = ["MIN_COMPUTE_CAPABILITY", "INSTALL_HINT", "PackedArgs", "pack_args", "require_capable", "load_driver",
           "PdlLauncher", "ProgrammaticKernel"]

#: griddepcontrol is Hopper's (sm_90) and later: below it a programmatic launch buys nothing
MIN_COMPUTE_CAPABILITY = 90
INSTALL_HINT = "pip install 'metatp[pdl]' (NVIDIA's cuda-bindings 12.x)"
_SLOT = 8          # bytes per packed argument: every kernel parameter here is at most 8 bytes


def require_capable(gpu: int, compute_capability: int, gpu_name: str = "") -> None:
    """Refuse pdl=True on a GPU below sm_90 (compute capability as CuPy spells it: 90 for 9.0)."""
    if int(compute_capability) < MIN_COMPUTE_CAPABILITY:
        cc = int(compute_capability)
        raise BackendUnavailableError(
            f"cupy backend: pdl=True needs compute capability 9.0 or newer (programmatic dependent launch, "
            f"Hopper); GPU {gpu}{f' ({gpu_name})' if gpu_name else ''} is {cc // 10}.{cc % 10}: leave pdl off")


def load_driver() -> Any:
    """``cuda.bindings.driver``, or a BackendUnavailableError saying what to install."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise BackendUnavailableError(f"cupy backend: pdl=True launches through cuda-bindings' cuLaunchKernelEx, "
                                      f"which is not importable ({e}); {INSTALL_HINT}") from None
    return driver


# --------------------------------------------------------------------------- arguments
@dataclass
class PackedArgs:
    """Kernel arguments as cuLaunchKernelEx takes them (``void** kernelParams``): one 8-byte slot
    per argument in `values`, and `pointers`, the array of the slots' addresses."""

    values: ctypes.Array
    pointers: ctypes.Array
    sizes: tuple[int, ...]

    @property
    def address(self) -> int:
        """The ``void**`` to hand the driver (0 for a kernel without parameters)."""
        return ctypes.addressof(self.pointers) if self.sizes else 0

    def value_bytes(self, i: int) -> bytes:
        """The bytes argument i's pointer points at (what the driver copies for that parameter)."""
        return ctypes.string_at(self.pointers[i], self.sizes[i])


def _arg_bytes(a: Any) -> bytes:
    """One argument's bytes, as CuPy's launch passes it: a device array as its pointer, a numpy
    scalar as its own bytes, a Python int as int64 and a float as float64."""
    if isinstance(a, np.ndarray):
        raise TypeError("a host (numpy) array cannot be a kernel argument; pass a device array or np.uint64 pointer")
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is not None:                        # a cupy ndarray
        return np.uint64(int(ptr)).tobytes()
    if isinstance(a, np.generic):
        if a.dtype.itemsize > _SLOT:
            raise TypeError(f"kernel argument of {a.dtype.itemsize} bytes (at most {_SLOT}): {a!r}")
        return a.tobytes()
    if isinstance(a, int):                     # bool too, as CuPy (an int subclass)
        return np.int64(a).tobytes()
    if isinstance(a, float):
        return np.float64(a).tobytes()
    raise TypeError(f"unsupported kernel argument type {type(a).__name__} (None must be passed as np.uint64(0))")


def pack_args(args: Sequence[Any]) -> PackedArgs:
    """The arguments of one launch packed for cuLaunchKernelEx (kept alive until it returns:
    the driver copies the values at the call)."""
    raw = [_arg_bytes(a) for a in args]
    n = len(raw)
    values = (ctypes.c_uint64 * max(1, n))()
    base = ctypes.addressof(values)
    for i, b in enumerate(raw):
        ctypes.memmove(base + _SLOT * i, b, len(b))
    pointers = (ctypes.c_void_p * max(1, n))(*[base + _SLOT * i for i in range(n)])
    return PackedArgs(values, pointers, tuple(len(b) for b in raw))


def _dims(t: Sequence[int]) -> tuple[int, int, int]:
    """A grid or block tuple as three dimensions (CuPy pads with 1 and raises 0 to 1)."""
    d = (tuple(int(x) for x in t) + (1, 1, 1))[:3]
    return max(1, d[0]), max(1, d[1]), max(1, d[2])


# --------------------------------------------------------------------------- launching
class PdlLauncher:
    """Launches CUfunctions with the programmatic stream serialization attribute.

    `driver`: ``cuda.bindings.driver`` (loaded when not given); `error(status)`: the exception a
    failed launch raises (the runtime's, so `faults.DeviceFaults` translates it; RuntimeError by
    default)."""

    def __init__(self, driver: Any = None, error: Callable[[int], BaseException] | None = None) -> None:
        self.driver = driver if driver is not None else load_driver()
        self._error = error or (lambda status: RuntimeError(f"cuLaunchKernelEx failed: CUresult {status}"))
        attr = self.driver.CUlaunchAttribute()
        attr.id = self.driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        self._attrs = [attr]
        self._initialized = False

    def config(self, grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int) -> Any:
        """The CUlaunchConfig of one launch: its dimensions, dynamic shared memory, stream and the attribute."""
        drv = self.driver
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = _dims(grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = _dims(block)
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = drv.CUstream(int(stream))
        cfg.attrs = self._attrs
        cfg.numAttrs = len(self._attrs)
        return cfg

    def launch(self, function: int, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
               shared_mem: int, stream: int) -> None:
        """cuLaunchKernelEx of CUfunction `function` on stream handle `stream`."""
        drv = self.driver
        if not self._initialized:          # CuPy has initialized the driver; this only binds the entry points
            self._check(drv.cuInit(0))
            self._initialized = True
        packed = pack_args(args)
        self._check(drv.cuLaunchKernelEx(self.config(grid, block, shared_mem, stream), drv.CUfunction(int(function)),
                                         packed.address, 0))

    def _check(self, result: Any) -> None:
        status = int(result[0] if isinstance(result, tuple) else result)
        if status != 0:
            raise self._error(status)


class ProgrammaticKernel:
    """A CuPy RawKernel that can also be launched programmatically (``programmatic=True``): what
    `runtime.CupyRuntime.kernel` hands out once pdl is enabled. `stream()`: the current stream's
    handle."""

    __slots__ = ("raw", "launcher", "stream", "_function")

    def __init__(self, raw: Any, launcher: PdlLauncher, stream: Callable[[], int]) -> None:
        self.raw, self.launcher, self.stream = raw, launcher, stream
        self._function: int | None = None

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:     # a CUfunction attribute: both paths see it
        self.raw.max_dynamic_shared_size_bytes = n

    def function(self) -> int:
        """The kernel's CUfunction handle (a RawKernel's ``kernel.ptr``; a Function's ``ptr``)."""
        if self._function is None:
            fn = getattr(self.raw, "kernel", self.raw)
            self._function = int(fn.ptr)
        return self._function

    def __call__(self, grid, block, args, shared_mem: int = 0, programmatic: bool = False) -> None:
        if programmatic:
            self.launcher.launch(self.function(), grid, block, args, shared_mem, self.stream())
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)
