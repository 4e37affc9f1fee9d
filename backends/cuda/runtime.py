"""The one device API of the CUDA backend, over CuPy 13/14: devices, streams, events, memory,
NVRTC modules, cuBLAS and NCCL calls; and the GPU probe that decides whether "auto" picks it.

CuPy's exceptions stop here: every call that allocates, copies, launches, waits or communicates is
guarded by `faults.DeviceFaults`, which raises metatp's typed errors in their place (`DeviceMemoryError` with the bytes asked for and free,
`DeviceFaultError` naming the kernel, `CollectiveError` naming the NCCL call and its GPUs) and,
after a sticky fault, refuses every later call at once.

Everything the backend does on a device goes through a runtime object, so a test can hand the
backend another one (`metatp.testing.EmuRuntime`: the same calls on the CPU). The
runtime is also the kernel engine the launchers use (`launch.using(runtime)`, entered by
`kernels()`): it compiles each ``cuda/<family>.cu`` once per GPU with NVRTC and caches the
kernels. Importing this module needs neither CuPy nor a GPU; CuPy is imported when a
`CupyRuntime` is made or the probe runs.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Sequence

import numpy as np

from metatp.backends.cuda.faults import CheckedKernel, DeviceFaults, cupy_errors
from metatp.backends.cuda.launch import COMPILE_OPTIONS, module_source, using
from metatp.backends.cuda.pdl import PdlLauncher, ProgrammaticKernel, require_capable

__all__ = ["CupyRuntime", "DeviceContext", "gpu_probe", "gpu_available", "PROBE_SOURCE"]

_lock = threading.RLock()

_CUDA_R_32F, _CUDA_R_16F = 0, 2
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_MEMCPY_H2D, _MEMCPY_DEFAULT = 1, 4
#: cuBLAS (major * 10000 + minor * 100 + patch) and CUDA runtime (major * 1000 + minor * 10) versions
#: from which a stream capture takes our GEMM: cuBLAS 12.2 takes its workspace from cudaMallocAsync
#: (a node of the graph) instead of a buffer each capture would keep (PyTorch drops its own workspace
#: for CUDA >= 12.2 for that reason)
GEMM_CAPTURE_CUBLAS = 120200
GEMM_CAPTURE_RUNTIME = 12020


class DeviceContext:
    """Enter a GPU and one of its streams together (re-enterable)."""

    def __init__(self, device_ctx, stream_ctx) -> None:
        self._device = device_ctx
        self._stream = stream_ctx

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)
        return False


class CupyRuntime:
    """Device operations on CuPy 13/14 (cupy-cuda12x or cupy-cuda13x)."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        self._cublas = None
        self._gemm_capture: bool | None = None     # `gemm_capturable`, asked once
        self._nccl = None
        self._modules: dict[tuple[str, int], Any] = {}
        self._kernels: dict[tuple[str, str, int], Any] = {}
        self._sms: dict[int, int] = {}
        self._comm_gpus: dict[int, int] = {}        # id(NCCL communicator) -> its GPU (for errors)
        self.programmatic = False     # launch PDL-ready kernels programmatically (`enable_pdl`, launch.launch)
        self._pdl = None              # pdl.PdlLauncher once enabled
        self.faults = DeviceFaults(cupy_errors(), self.current_gpu,
                                   lambda gpu: self.mem_info(gpu)[0] + self.pool_free_bytes(gpu))

    def current_gpu(self) -> int:
        return int(self.cp.cuda.runtime.getDevice())

    # ---- devices, streams, events
    def n_gpus(self) -> int:
        return int(self.cp.cuda.runtime.getDeviceCount())

    def device(self, gpu: int):
        return self.cp.cuda.Device(gpu)

    def new_stream(self, gpu: int):
        with self.cp.cuda.Device(gpu):
            return self.cp.cuda.Stream(non_blocking=True)

    def new_event(self, gpu: int):
        with self.cp.cuda.Device(gpu):
            return self.cp.cuda.Event(disable_timing=True)

    def context(self, gpu: int, stream) -> DeviceContext:
        return DeviceContext(self.cp.cuda.Device(gpu), stream)

    def kernels(self):
        """Launch every kernel inside the block with this runtime's NVRTC modules."""
        return using(self)

    # ---- kernel engine (launch.KernelEngine): NVRTC modules, cached per (family, GPU)
    def kernel(self, family: str, name: str):
        gpu = int(self.cp.cuda.runtime.getDevice())
        key = (family, name, gpu)
        k = self._kernels.get(key)
        if k is None:
            with _lock:
                mod = self._modules.get((family, gpu))
                if mod is None:
                    mod = self._modules[(family, gpu)] = self.cp.RawModule(code=module_source(family),
                                                                           options=COMPILE_OPTIONS)
                raw = mod.get_function(name)
                if self._pdl is not None:
                    raw = ProgrammaticKernel(raw, self._pdl, self._current_stream_handle)
                k = self._kernels[key] = CheckedKernel(raw, name, gpu, self.faults)
        return k

    def precompile(self, gpus: Sequence[int], families: Sequence[str], workers: int | None = None) -> dict[str, float]:
        """Compile the kernel modules of `families` before the first launch, all at once: one
        thread a module (NVRTC releases the GIL while it compiles), so a fresh machine waits for
        the slowest module instead of the sum of them (CuPy's disk cache then makes the next
        process's compile a load). One GPU of each compute capability compiles (another GPU of
        the same one loads the cached cubin at its first launch). Returns each module's seconds
        (a module already compiled: not listed). A compile error is raised as the lazy path
        would raise it at the first launch."""
        from concurrent.futures import ThreadPoolExecutor

        firsts: dict[int, int] = {}
        for gpu in gpus:
            firsts.setdefault(self.capability(gpu), gpu)
        todo = [(f, g) for g in firsts.values() for f in families if (f, g) not in self._modules]
        if not todo:
            return {}

        def compile_one(item: tuple[str, int]) -> tuple[tuple[str, int], Any, float]:
            family, gpu = item
            t0 = time.perf_counter()
            with self.cp.cuda.Device(gpu):
                mod = self.cp.RawModule(code=module_source(family), options=COMPILE_OPTIONS)
                mod.compile()
            return item, mod, time.perf_counter() - t0

        n = max(1, min(len(todo), workers or os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="metatp-nvrtc") as pool:
            done = list(pool.map(compile_one, todo))
        seconds: dict[str, float] = {}
        with _lock:
            for key, mod, s in done:
                self._modules.setdefault(key, mod)
                seconds[key[0]] = max(seconds.get(key[0], 0.0), s)
        return seconds

    def enable_pdl(self, gpus: Sequence[int]) -> None:
        """Launch every PDL-ready kernel with the programmatic stream serialization attribute from
        now on (cuLaunchKernelEx of cuda-bindings, `pdl`). BackendUnavailableError when the binding
        is missing or a GPU is below sm_90."""
        from cupy_backends.cuda.api.driver import CUDADriverError

        for gpu in gpus:
            require_capable(gpu, self.capability(gpu), self.gpu_name(gpu))
        with _lock:
            self._pdl = PdlLauncher(error=CUDADriverError)
            self._kernels.clear()             # kernels handed out before: plain RawKernels
            self.programmatic = True

    def _current_stream_handle(self) -> int:
        return int(self.cp.cuda.get_current_stream().ptr)

    def capability(self, gpu: int) -> int:
        """GPU `gpu`'s compute capability as an int (90: sm_90)."""
        return int(self.cp.cuda.Device(gpu).compute_capability)

    def sm_count(self) -> int:
        gpu = int(self.cp.cuda.runtime.getDevice())
        n = self._sms.get(gpu)
        if n is None:
            try:
                n = int(self.cp.cuda.Device(gpu).attributes["MultiProcessorCount"])
            except Exception:  # noqa: BLE001
                n = 80
            self._sms[gpu] = n
        return n

    def record(self, stream, event) -> None:
        with self.faults.guard():
            stream.record(event)

    def wait(self, stream, event) -> None:
        with self.faults.guard():
            stream.wait_event(event)

    def synchronize(self, stream) -> None:
        with self.faults.guard():         # a kernel's fault surfaces at the next wait for it
            stream.synchronize()

    def host_wait(self, event) -> None:
        with self.faults.guard():
            event.synchronize()

    def device_synchronize(self, gpu: int) -> None:
        """Wait for everything on a GPU, the legacy stream included (where CuPy's uploads and
        zero-fills run: our non-blocking streams do not wait for it)."""
        with self.faults.guard(gpu), self.cp.cuda.Device(gpu):
            self.cp.cuda.runtime.deviceSynchronize()

    def gpu_name(self, gpu: int) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(gpu)
        name = props.get("name", b"?")
        return name.decode() if isinstance(name, bytes) else str(name)

    def mem_info(self, gpu: int) -> tuple[int, int]:
        with self.cp.cuda.Device(gpu):
            free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def pool_free_bytes(self, gpu: int) -> int:
        """Bytes CuPy's memory pool holds but does not use on a GPU: free for our allocations,
        yet missing from cudaMemGetInfo's count."""
        with self.cp.cuda.Device(gpu):
            return int(self.cp.get_default_memory_pool().free_bytes())

    def enable_peer_access(self, gpus: Sequence[int]) -> None:
        rt = self.cp.cuda.runtime
        for a in gpus:
            for b in gpus:
                if a == b:
                    continue
                try:
                    if rt.deviceCanAccessPeer(a, b):
                        with self.cp.cuda.Device(a):
                            rt.deviceEnablePeerAccess(b)
                except Exception:  # noqa: BLE001 - already enabled, or not possible: copies still work (staged)
                    pass

    # ---- memory
    def empty(self, shape, dtype):
        with self.faults.guard(needed=_nbytes(shape, dtype)):
            return self.cp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        with self.faults.guard(needed=_nbytes(shape, dtype)):
            return self.cp.zeros(shape, dtype=dtype)

    def upload(self, host: np.ndarray):
        with self.faults.guard(needed=int(host.nbytes)):
            return self.cp.asarray(np.ascontiguousarray(host))

    def download(self, arr) -> np.ndarray:
        with self.faults.guard():
            return self.cp.asnumpy(arr)

    def view(self, root, offset: int, shape, strides, dtype):
        if any(s == 0 for s in shape):
            return self.cp.empty(shape, dtype=dtype)
        return self.cp.ndarray(tuple(shape), dtype=dtype, memptr=root.data + int(offset),
                               strides=tuple(int(s) for s in strides))

    def pinned(self, nbytes: int) -> np.ndarray:
        import cupyx

        with self.faults.guard(needed=max(nbytes, 1)):         # page-locked host memory
            return cupyx.empty_pinned((max(nbytes, 1),), dtype=np.uint8)

    def memcpy(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        with self.faults.guard():
            self.cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, _MEMCPY_DEFAULT, stream.ptr)

    def memcpy_h2d(self, dst_ptr: int, host: np.ndarray, nbytes: int, stream) -> None:
        with self.faults.guard():
            self.cp.cuda.runtime.memcpyAsync(dst_ptr, host.ctypes.data, nbytes, _MEMCPY_H2D, stream.ptr)

    def memset(self, ptr: int, nbytes: int, stream) -> None:
        with self.faults.guard():
            self.cp.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream.ptr)

    # ---- CUDA graphs (errors inside a capture abandon it and mark nothing: `faults.capturing`)
    def begin_capture(self, stream) -> None:
        with self.faults.guard():
            stream.begin_capture()
        self.faults.capturing += 1

    def end_capture(self, stream):
        """The captured graph. A capture that was invalidated (a call inside it that CUDA cannot
        capture) raises here, and CUDA ends it all the same; should the stream still be
        capturing after an error, its capture is ended again, so eager work can follow."""
        self.faults.capturing -= 1
        try:
            with self.faults.guard():
                return stream.end_capture()
        except Exception:
            self._end_leftover_capture(stream)
            raise

    def _end_leftover_capture(self, stream) -> None:
        """End a capture a failed cudaStreamEndCapture left open (its graph, if any, dropped)."""
        rt = self.cp.cuda.runtime
        try:
            if rt.streamIsCapturing(stream.ptr) != rt.streamCaptureStatusNone:
                rt.streamEndCapture(stream.ptr)
        except Exception:  # noqa: BLE001 - nothing more can be done; the first error is the one raised
            pass

    def launch_graph(self, graph, stream) -> None:
        with self.faults.guard():
            graph.launch(stream=stream)

    # ---- cuBLAS
    def gemm_available(self) -> bool:
        if self._cublas is None:
            try:
                from cupy_backends.cuda.libs import cublas

                cublas.gemmEx  # noqa: B018 - loads the library (ImportError if libcublas is missing)
                self._cublas = cublas
                self.faults.learn(blas=(cublas.CUBLASError,))
            except Exception:  # noqa: BLE001
                self._cublas = False
        return bool(self._cublas)

    def gemm_capturable(self) -> bool:
        """Can a CUDA-graph capture take `gemm`? cuBLAS >= 12.2 under a CUDA runtime >= 12.2 (asked
        once, through CuPy, on the current GPU). Host alpha / beta (pointer mode host) are read at
        capture: fine, ours are the constants 1 and 0. False where the versions cannot be read."""
        if self._gemm_capture is None:
            self._gemm_capture = self.gemm_available() and self._gemm_versions_capture()
        return self._gemm_capture

    def _gemm_versions_capture(self) -> bool:
        try:
            cublas_version = int(self._cublas.getVersion(self.cp.cuda.device.get_cublas_handle()))
            runtime_version = int(self.cp.cuda.runtime.runtimeGetVersion())
        except Exception:  # noqa: BLE001 - a version we cannot read: the plan stays eager
            return False
        return cublas_version >= GEMM_CAPTURE_CUBLAS and runtime_version >= GEMM_CAPTURE_RUNTIME

    def gemm(self, m: int, n: int, k: int, w_ptr: int, x_ptr: int, y_ptr: int, ldy: int,
             dtype: str, stream, gpu: int) -> None:
        """y[n, m] (f32, row stride ldy) = x[n, k] @ w[m, k]^T, inputs f16 or f32 (cuBLAS). Issued
        on `stream`: inside a capture it becomes nodes of the graph (`gemm_capturable`).

        CuPy's gemmEx binds the handle to the *current* stream before the call (an explicit
        setStream is overridden), and the handle belongs to the current device: so both are
        entered here, whatever context the caller is in."""
        cublas = self._cublas
        with self.faults.guard(gpu), self.cp.cuda.Device(gpu), stream:
            handle = self.cp.cuda.device.get_cublas_handle()
            cublas.setPointerMode(handle, 0)    # host alpha/beta
            ab = _CUDA_R_16F if dtype == "f16" else _CUDA_R_32F
            cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k, self._one.ctypes.data, w_ptr, ab,
                          k, x_ptr, ab, k, self._zero.ctypes.data, y_ptr, _CUDA_R_32F, ldy,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    def matmul(self, a, b):
        with self.faults.guard():
            return self.cp.matmul(a, b)

    # ---- NCCL
    def nccl_module(self):
        if self._nccl is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from cupy.cuda import nccl
            self._nccl = nccl if getattr(nccl, "available", False) else False
            if self._nccl:
                self.faults.learn(nccl=(nccl.NcclError,))
        return self._nccl or None

    def nccl_comms(self, gpus: Sequence[int]):
        """One communicator per GPU (a failed init is a CollectiveError that marks nothing: no
        work has run on them; the caller may use another all-reduce)."""
        nccl = self.nccl_module()
        if nccl is None:
            return None
        self.faults.check()
        try:
            comms = list(nccl.NcclCommunicator.initAll(list(gpus)))
        except self.faults.types as e:
            raise self.faults.translate(e, op="init", gpus=tuple(gpus), marks=False) from e
        self._comm_gpus.update((id(c), g) for c, g in zip(comms, gpus))
        return comms

    def nccl_unique_id(self) -> bytes:
        """A fresh NCCL unique id (rank 0 draws it; MPI carries it to the others)."""
        return self.nccl_module().get_unique_id()

    def nccl_rank_comm(self, n_ranks: int, uid, rank: int):
        """This process's rank of an n-rank communicator that spans processes (on the current GPU)."""
        gpu = self.current_gpu()
        self.faults.check()
        try:
            comm = self.nccl_module().NcclCommunicator(n_ranks, uid, rank)
        except self.faults.types as e:
            raise self.faults.translate(e, op="init", gpus=(gpu,), marks=False) from e
        self._comm_gpus[id(comm)] = gpu
        return comm

    def _collective_error(self, e: BaseException, op: str, comms) -> Exception:
        """A failed NCCL call as a CollectiveError naming it and its communicators' GPUs."""
        gpus = tuple(g for g in (self._comm_gpus.get(id(c)) for c in comms) if g is not None)
        return self.faults.translate(e, op=op, gpus=gpus)

    def nccl_allreduce(self, calls) -> None:
        """calls: (comm, ptr, count, dtype 'f32'|'bf16', stream) per rank, in one NCCL group."""
        nccl = self.nccl_module()
        codes = {"f32": getattr(nccl, "NCCL_FLOAT32", 7), "bf16": getattr(nccl, "NCCL_BFLOAT16", 9)}
        op = getattr(nccl, "NCCL_SUM", 0)
        self.faults.check()
        try:
            nccl.groupStart()
            try:
                for comm, ptr, count, dtype, stream in calls:
                    comm.allReduce(ptr, ptr, count, codes[dtype], op, stream.ptr)
            finally:
                nccl.groupEnd()
        except self.faults.types as e:
            raise self._collective_error(e, "all-reduce", [c[0] for c in calls]) from e

    def nccl_send(self, comm, ptr: int, count: int, dtype: int, peer: int, stream) -> None:
        """ncclSend of `count` elements of NCCL type code `dtype` at `ptr` to rank `peer` (NCCL >= 2.7)."""
        self.faults.check()
        try:
            comm.send(ptr, count, dtype, peer, stream.ptr)
        except self.faults.types as e:
            raise self._collective_error(e, f"send to rank {peer}", [comm]) from e

    def nccl_recv(self, comm, ptr: int, count: int, dtype: int, peer: int, stream) -> None:
        """ncclRecv of `count` elements of NCCL type code `dtype` from rank `peer` into `ptr`."""
        self.faults.check()
        try:
            comm.recv(ptr, count, dtype, peer, stream.ptr)
        except self.faults.types as e:
            raise self._collective_error(e, f"receive from rank {peer}", [comm]) from e


def _nbytes(shape, dtype) -> int:
    n = int(np.prod(shape, dtype=np.int64)) if not isinstance(shape, int) else shape
    return n * np.dtype(dtype).itemsize


# =============================================================== the GPU probe
#: A kernel that needs NVRTC, the CUDA headers CuPy adds to every compile, the driver and a
#: device: what `gpu_available` compiles and runs once, so "auto" never picks a broken GPU.
PROBE_SOURCE = 'extern "C" __global__ void metatp_probe(int* p) { if (p) *p = 7; }'

_probe_result: tuple[bool, str] | None = None


def _install_hint(err: str) -> str:
    """What to pip install for a failed probe compile (CuPy's message says what is missing)."""
    low = err.lower()
    if "nvrtc" in low:
        return ("NVRTC (the CUDA runtime compiler) could not be loaded: pip install nvidia-cuda-nvrtc-cu12 "
                "(CUDA 12; nvidia-cuda-nvrtc for CUDA 13), or pip install 'metatp[cuda]'")
    if "header" in low or "cuda root" in low or "cuda_path" in low or "include" in low:
        return ("the CUDA headers CuPy compiles with are missing: pip install nvidia-cuda-runtime-cu12 "
                "(CUDA 12; nvidia-cuda-runtime for CUDA 13), or pip install 'metatp[cuda]'")
    return "see the error above; pip install 'metatp[cuda]' brings CuPy with NVRTC and the CUDA headers"


def gpu_probe() -> tuple[bool, str]:
    """(usable, why not): cupy imports, sees a device, and compiles and runs a one-line kernel.

    Run once per process. A visible GPU that cannot compile (NVRTC or the headers missing)
    gives one RuntimeWarning saying what to install; no cupy or no device stays silent, as
    numpy is then the expected choice."""
    global _probe_result
    if _probe_result is not None:
        return _probe_result
    with _lock:
        if _probe_result is None:
            _probe_result = _run_probe()
    return _probe_result


def _run_probe() -> tuple[bool, str]:
    try:
        import cupy  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install
        return False, f"cupy is not importable ({type(e).__name__}: {e}); pip install 'metatp[cuda]'"
    try:
        if not cupy.cuda.is_available():
            return False, "cupy is installed but sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        return False, f"cupy cannot query CUDA devices ({type(e).__name__}: {e})"
    try:
        out = cupy.zeros(1, dtype=np.int32)
        cupy.RawKernel(PROBE_SOURCE, "metatp_probe")((1,), (1,), (out,))
        if int(out.get()[0]) != 7:
            raise RuntimeError("the probe kernel ran but wrote nothing")
    except Exception as e:  # noqa: BLE001 - CompileException, RuntimeError (no NVRTC / headers), CUDA errors
        err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        why = f"a CUDA device is visible but a trivial kernel does not compile and run ({err}); {_install_hint(err)}"
        warnings.warn(f"metatp: GPU not usable, using the numpy backend: {why}", RuntimeWarning, stacklevel=4)
        return False, why
    return True, ""


def gpu_available() -> bool:
    """True when the cupy backend can run here (see `gpu_probe`)."""
    return gpu_probe()[0]
