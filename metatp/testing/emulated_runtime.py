"""EmuRuntime: the CUDA backend's device API on the CPU, for tests without a GPU.

``CupyBackend(layout, runtime=EmuRuntime())`` is the one seam: the runtime brings its own kernel
engine (an `Emulator`). Device memory is numpy arrays, kernels run on the CUDA emulator, streams and
events are ordered by issue order, NCCL is a sum over the emulated GPUs, and CUDA-graph capture
records launches and stream calls (cuBLAS GEMMs, NCCL) and replays them in order. Everything above
this layer (plans, launches, all-reduce schedules, graphs) is the real backend code.

Device faults: ``inject(kind, after_n_calls)`` makes a later call raise what the library would
(out of memory, a failed launch, an NCCL error; `emulated_faults`), inside the same guard as the
real runtime's (`backends.cuda.faults.DeviceFaults`), so the backend meets metatp's typed errors.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Sequence

import numpy as np

from metatp.backends.cuda.faults import CheckedKernel, DeviceFaults
from metatp.backends.cuda.launch import using
from metatp.backends.cuda.pdl import require_capable
from metatp.backends.cuda.runtime import DeviceContext
from metatp.testing.cuda_emulator import Emulator
from metatp.testing.emulated_faults import EMULATED_ERRORS, EmulatedCudaError, FaultPlan, Injection
from metatp.ir.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

__all__ = ["EmuRuntime"]

_stream_handles = itertools.count(0x1000, 0x10)


class _EmuStream:
    """A stream: its own fake handle (`ptr`, as a cupy Stream has), so NCCL's stream argument
    can be told apart from another stream's."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        self.ptr = next(_stream_handles)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _EmuEvent:
    """An event of one GPU. As in CUDA, it may only be recorded on a stream of its own GPU
    (cudaEventRecord: invalid resource handle otherwise), and inside a graph capture a stream
    may only wait for an event recorded in that capture (a wait on one recorded outside it
    breaks the capture: cudaErrorStreamCaptureIsolation)."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        self.capture: int | None = None        # the capture it was last recorded in (None: outside one)


class _EmuDevice:
    def __init__(self, emu: Emulator, gpu: int) -> None:
        self.emu = emu
        self.gpu = gpu
        self._prev: list[int] = []

    def __enter__(self):
        self._prev.append(self.emu.current_device)
        self.emu.current_device = self.gpu
        return self

    def __exit__(self, *exc):
        self.emu.current_device = self._prev.pop()
        return False


class _EmuComm:
    """A rank of an emulated NCCL communicator (sums at the end of a group) on GPU `gpu`."""

    def __init__(self, rank: int, gpu: int) -> None:
        self.rank = rank
        self.gpu = gpu


class EmuRuntime:
    """The backend's device operations on the CPU: numpy arrays, kernels on the emulator.

    Work runs in issue order (a valid serialisation of the streams; events are no-ops), a
    captured graph records the work and replays it, NCCL is emulated for distinct
    "GPUs". `n_gpus` pretends to have that many GPUs (each its own memory, all host RAM).
    `nccl_capture=False` makes NCCL refuse to run inside a graph capture (as an old NCCL
    does), `mem_free` / `pool_free` are what the memory queries report; `peer_access` records
    the GPU sets peer access was enabled for. `inject` arms a device fault (tests only).
    `compute_capability` is every emulated GPU's (90: sm_90, which `enable_pdl` needs); after
    `enable_pdl` the launchers launch PDL-ready kernels programmatically, and the emulator counts
    those launches (`emu.programmatic`) and checks that every thread waited.

    `gemm` (cuBLAS is there) and `gemm_capture` (a capture can take the GEMM, as cuBLAS >= 12.2:
    `gemm_capturable`); a GEMM issued inside a capture is recorded and runs at each replay
    (`gemm_runs` counts the GEMMs that ran, eagerly or replayed). `gemm_breaks_capture`: the runtime
    says yes but a GEMM inside a capture fails and invalidates it, as a call CUDA cannot capture
    does (the capture's end then fails too, and ends it)."""

    name = "emulator"

    def __init__(self, n_gpus: int = 1, sm_count: int = 4, nccl: bool = True, gemm: bool = True,
                 nccl_capture: bool = True, mem_free: int = 8 << 30, pool_free: int = 0,
                 compute_capability: int = 90, gemm_capture: bool = True,
                 gemm_breaks_capture: bool = False) -> None:
        self.emu = Emulator(sm_count=sm_count)
        self._n_gpus = n_gpus
        self._nccl = nccl
        self._gemm = gemm
        self._gemm_capture = gemm_capture
        self._gemm_breaks_capture = gemm_breaks_capture
        self.gemm_runs = 0
        self._capture_invalidated = False
        self._nccl_capture = nccl_capture
        self.mem_free = mem_free
        self.pool_free = pool_free
        self.graph_launches = 0
        self.nccl_calls = 0
        self.peer_access: list[list[int]] = []
        self.compute_capability = compute_capability
        self.programmatic = False          # launch PDL-ready kernels programmatically (`enable_pdl`)
        self._capture_id = 0           # which capture events were recorded in (`_EmuEvent`)
        self._kernels: dict[tuple[str, str, int], CheckedKernel] = {}
        self.precompiled: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
        self.fault_plan = FaultPlan()
        self.faults = DeviceFaults(EMULATED_ERRORS, lambda: self.emu.current_device,
                                   lambda gpu: self.mem_free + self.pool_free)
        self.emu.before_launch = lambda name: self.fault_plan.trip("launch")

    # ---- fault injection
    def inject(self, kind: str, after_n_calls: int = 0, *, status: int | None = None, min_bytes: int = 0,
               times: int | None = 1) -> None:
        """Make a later call fail as the device library would: kind "oom" (allocations of at least
        `min_bytes`), "launch" (kernel and graph launches; `status` a cudaError_t, 719 by
        default) or "nccl" (NCCL calls; `status` an ncclResult_t, 2 by default). The first
        `after_n_calls` calls of the kind succeed, then `times` calls fail (None: all later ones)."""
        self.fault_plan.arm(Injection(kind, after_n_calls, status, min_bytes, times))

    def n_gpus(self) -> int:
        return self._n_gpus

    def device(self, gpu: int):
        return _EmuDevice(self.emu, gpu)

    def new_stream(self, gpu: int):
        return _EmuStream(gpu)

    def new_event(self, gpu: int):
        return _EmuEvent(gpu)

    def context(self, gpu: int, stream) -> DeviceContext:
        return DeviceContext(_EmuDevice(self.emu, gpu), stream)

    def kernels(self):
        """Launch every kernel inside the block on this runtime's emulator (checked kernels, as
        the real runtime hands out: `kernel`)."""
        return using(self)

    # ---- kernel engine (launch.KernelEngine) over the emulator
    def precompile(self, gpus: Sequence[int], families: Sequence[str], workers: int | None = None) -> dict[str, float]:
        """Records what the backend asked to compile ahead (`precompiled`); the emulator builds a
        family at its first launch (its builds are cached on disk per source), so nothing is timed."""
        self.precompiled.append((tuple(gpus), tuple(families)))
        return {}

    def kernel(self, family: str, name: str) -> CheckedKernel:
        gpu = self.emu.current_device
        k = self._kernels.get((family, name, gpu))
        if k is None:
            k = self._kernels[(family, name, gpu)] = CheckedKernel(self.emu.kernel(family, name), name, gpu,
                                                                   self.faults)
        return k

    def sm_count(self) -> int:
        return self.emu.sm_count()

    def capability(self, gpu: int) -> int:
        """Every emulated GPU's compute capability (`compute_capability`)."""
        return self.compute_capability

    def enable_pdl(self, gpus: Sequence[int]) -> None:
        """As the real runtime's: refused below sm_90; the emulator's kernels take the attribute
        themselves (no binding needed)."""
        for gpu in gpus:
            require_capable(gpu, self.compute_capability, self.gpu_name(gpu))
        self.programmatic = True

    def record(self, stream, event) -> None:
        self.faults.check()
        if isinstance(event, _EmuEvent) and isinstance(stream, _EmuStream):
            if event.gpu != stream.gpu:
                raise RuntimeError(f"cudaEventRecord: an event of GPU {event.gpu} on a stream of GPU {stream.gpu} "
                                   "(cudaErrorInvalidResourceHandle)")
            event.capture = self._capture_id if self.emu.capture is not None else None

    def wait(self, stream, event) -> None:
        self.faults.check()
        if self.emu.capture is not None and isinstance(event, _EmuEvent) and event.capture != self._capture_id:
            raise RuntimeError("cudaStreamWaitEvent inside a capture on an event not recorded in it "
                               "(cudaErrorStreamCaptureIsolation)")

    def synchronize(self, stream) -> None:
        self.faults.check()

    def host_wait(self, event) -> None:
        self.faults.check()

    def device_synchronize(self, gpu: int) -> None:
        self.faults.check()

    def gpu_name(self, gpu: int) -> str:
        return f"emulated GPU {gpu}"

    def mem_info(self, gpu: int) -> tuple[int, int]:
        return self.mem_free, 8 << 30

    def pool_free_bytes(self, gpu: int) -> int:
        return self.pool_free

    def enable_peer_access(self, gpus: Sequence[int]) -> None:
        self.peer_access.append(list(gpus))

    def _allocate(self, nbytes: int, make):
        """A device allocation: where an "oom" fault trips, inside the guard."""
        with self.faults.guard(needed=nbytes):
            self.fault_plan.trip("oom", nbytes)
            return make()

    def empty(self, shape, dtype):
        return self._allocate(_nbytes(shape, dtype), lambda: np.empty(shape, dtype=dtype))

    def zeros(self, shape, dtype):
        return self._allocate(_nbytes(shape, dtype), lambda: np.zeros(shape, dtype=dtype))

    def upload(self, host: np.ndarray):
        return self._allocate(int(host.nbytes), lambda: np.array(host, copy=True, order="C"))

    def download(self, arr) -> np.ndarray:
        self.faults.check()
        return np.array(arr, copy=True)

    def view(self, root, offset: int, shape, strides, dtype):
        """The root's address + `offset`, as the real runtime's ``memptr + offset``: a carved view is
        exactly as (mis)aligned as on the GPU (roots differ: numpy's 16-byte aligned, CuPy's 256;
        no access needs more than 16)."""
        if any(s == 0 for s in shape):
            return np.empty(shape, dtype=dtype)
        base = root if root.base is None else root.base
        extra = root.ctypes.data - base.ctypes.data
        return np.ndarray(tuple(shape), dtype=dtype, buffer=base, offset=extra + int(offset),
                          strides=tuple(int(s) for s in strides))

    def pinned(self, nbytes: int) -> np.ndarray:
        return self._allocate(max(nbytes, 1), lambda: np.zeros(max(nbytes, 1), dtype=np.uint8))

    def memcpy(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        self.faults.check()
        self.emu.dispatch(lambda: ctypes.memmove(dst_ptr, src_ptr, nbytes))

    def memcpy_h2d(self, dst_ptr: int, host: np.ndarray, nbytes: int, stream) -> None:
        self.faults.check()
        data = host.ctypes.data
        self.emu.dispatch(lambda: ctypes.memmove(dst_ptr, data, nbytes))

    def memset(self, ptr: int, nbytes: int, stream) -> None:
        self.faults.check()
        self.emu.dispatch(lambda: ctypes.memset(ptr, 0, nbytes))

    def begin_capture(self, stream) -> None:
        self.faults.check()
        if self.emu.capture is not None:
            raise RuntimeError("a capture is already active")
        self._capture_id += 1
        self.emu.capture = []
        self._capture_invalidated = False
        self.faults.capturing += 1

    def end_capture(self, stream):
        """The recorded work; an invalidated capture ends too, and raises as cudaStreamEndCapture does."""
        self.faults.capturing -= 1
        graph, self.emu.capture = self.emu.capture, None
        if self._capture_invalidated:
            self._capture_invalidated = False
            with self.faults.guard():
                raise EmulatedCudaError(901)            # cudaErrorStreamCaptureInvalidated
        return graph

    def launch_graph(self, graph, stream) -> None:
        with self.faults.guard():           # a kernel's injected fault, as it runs in the graph
            self.graph_launches += 1
            for work in graph:
                work()

    def gemm_available(self) -> bool:
        return self._gemm

    def gemm_capturable(self) -> bool:
        """As the real runtime's (cuBLAS >= 12.2 there): `gemm_capture`."""
        return self._gemm and self._gemm_capture

    def gemm(self, m: int, n: int, k: int, w_ptr: int, x_ptr: int, y_ptr: int, ldy: int,
             dtype: str, stream, gpu: int) -> None:
        self.faults.check()
        if self.emu.capture is not None and self._gemm_breaks_capture:
            self._capture_invalidated = True
            with self.faults.guard():
                raise EmulatedCudaError(900)            # cudaErrorStreamCaptureUnsupported
        dt = np.float16 if dtype == "f16" else np.float32

        def run() -> None:
            self.gemm_runs += 1
            w = _host_array(w_ptr, (m, k), dt).astype(np.float32)
            x = _host_array(x_ptr, (n, k), dt).astype(np.float32)
            y = np.lib.stride_tricks.as_strided(_host_array(y_ptr, ((n - 1) * ldy + m,), np.float32),
                                                (n, m), (ldy * 4, 4))
            y[...] = x @ w.T
        self.emu.dispatch(run)

    def matmul(self, a, b):
        return np.matmul(a, b)

    def nccl_module(self):
        return self if self._nccl else None

    def nccl_comms(self, gpus: Sequence[int]):
        if not self._nccl:
            return None
        if len(set(gpus)) != len(gpus):
            raise RuntimeError("NCCL: duplicate GPU in one communicator (ncclInvalidUsage)")
        return [_EmuComm(r, g) for r, g in enumerate(gpus)]

    def nccl_unique_id(self) -> bytes:
        """128 random bytes (the size of a real ncclUniqueId)."""
        from metatp.testing.mpi_nccl import fake_unique_id

        return fake_unique_id()

    def nccl_rank_comm(self, n_ranks: int, uid, rank: int):
        """A communicator spanning MPI processes: the stand-in that sums over MPI."""
        if not self._nccl:
            raise RuntimeError("NCCL is not available (emulated)")
        from metatp.testing.mpi_nccl import MpiNcclComm

        return MpiNcclComm(n_ranks, uid, rank)

    def nccl_allreduce(self, calls) -> None:
        if self.emu.capture is not None and not self._nccl_capture:
            raise RuntimeError("NCCL: this NCCL cannot be captured into a CUDA graph")
        self.faults.check()
        calls = list(calls)
        try:
            self.fault_plan.trip("nccl")
        except EMULATED_ERRORS.nccl as e:
            gpus = tuple(c[0].gpu if isinstance(c[0], _EmuComm) else self.emu.current_device for c in calls)
            raise self.faults.translate(e, op="all-reduce", gpus=gpus) from e
        self.nccl_calls += 1
        if not all(isinstance(c[0], _EmuComm) for c in calls):
            self._rank_allreduce(calls)
            return

        def run() -> None:
            count, dtype = calls[0][2], calls[0][3]
            dt = np.uint16 if dtype == "bf16" else np.float32
            vals = [_host_array(ptr, (count,), dt) for _, ptr, _, _, _ in calls]
            f32 = [bf16_bits_to_f32(v) if dtype == "bf16" else v for v in vals]
            total = np.sum(np.stack(f32).astype(np.float32), axis=0, dtype=np.float32)
            out = f32_to_bf16_bits(total) if dtype == "bf16" else total
            for v in vals:
                v[...] = out
        self.emu.dispatch(run)


    def _p2p(self, kind: str, comm, ptr: int, count: int, dtype: int, peer: int, stream) -> None:
        """ncclSend / ncclRecv as CuPy makes them (`comm.send(ptr, count, dtype, peer, stream.ptr)`),
        on a communicator spanning processes only (the stand-in sends over MPI), in issue order
        (recorded while a graph is captured, run again on every replay)."""
        if self.emu.capture is not None and not self._nccl_capture:
            raise RuntimeError("NCCL: this NCCL cannot be captured into a CUDA graph")
        from metatp.testing.mpi_nccl import MpiNcclComm

        if not isinstance(comm, MpiNcclComm):
            raise RuntimeError(f"NCCL {kind}: the emulator sends between MPI ranks only, got {type(comm).__name__}")
        self.faults.check()
        try:
            self.fault_plan.trip("nccl")
        except EMULATED_ERRORS.nccl as e:
            raise self.faults.translate(e, op=f"{kind} to rank {peer}" if kind == "send" else
                                        f"receive from rank {peer}", gpus=(self.emu.current_device,)) from e
        self.nccl_calls += 1
        call = comm.send if kind == "send" else comm.recv
        handle = stream.ptr
        self.emu.dispatch(lambda: call(ptr, count, dtype, peer, handle))

    def nccl_send(self, comm, ptr: int, count: int, dtype: int, peer: int, stream) -> None:
        self._p2p("send", comm, ptr, count, dtype, peer, stream)

    def nccl_recv(self, comm, ptr: int, count: int, dtype: int, peer: int, stream) -> None:
        self._p2p("recv", comm, ptr, count, dtype, peer, stream)

    def _rank_allreduce(self, calls) -> None:
        """Communicators spanning processes (`mpi_nccl.MpiNcclComm`): each call as CuPy makes it,
        `comm.allReduce(ptr, ptr, count, dtype code, NCCL_SUM, stream.ptr)`, run in issue order
        (recorded when a graph is being captured, run again on every replay)."""
        from metatp.testing.mpi_nccl import NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_SUM

        codes = {"f32": NCCL_FLOAT32, "bf16": NCCL_BFLOAT16}
        for comm, ptr, count, dtype, stream in calls:
            self.emu.dispatch(lambda c=comm, p=ptr, n=count, t=codes[dtype], h=stream.ptr:
                              c.allReduce(p, p, n, t, NCCL_SUM, h))


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _host_array(ptr: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = (ctypes.c_char * max(n, 1)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

