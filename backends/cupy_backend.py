"""The cupy backend: runs a Plan on N devices, one GPU each or several "virtual devices"
sharing a GPU, with metatp's CUDA kernels (``cuda/*.cu`` through ``cuda_kernels``).

Layout of the work, per plan (``prepare``):

* every device owns buffers holding only its slice of every tensor: weights stay in their
  GGUF encoding (raw quant blocks; a split cuts whole blocks), the KV cache is f16,
  activations are f32 in one arena per device (``passes.memory.assign_offsets``), views are
  strided windows built from the plan's per-device ``Local`` (shape, strides, offset);
* every node becomes a few pre-recorded kernel launches with frozen arguments
  (``cuda_kernels.recording``), so a step is a walk over launch lists. Fusions cut a llama
  decode layer to 8 launches: RMS norm folded into the q/k/v projections (one launch for
  the three), RoPE of Q and K in one launch, K and V cache rows in one launch, the
  residual (or bias) added in the matvec epilogue, RMS norm + gate/up + GLU in one matvec;
  plus RMS_NORM/NORM x weight wherever a norm is not folded. Each fusion falls back to
  single launches when a layout does not suit its kernel;
* between subgraphs one all-reduce of the cut tensor: NCCL when every device is its own
  GPU, otherwise a butterfly of device-to-device copies and adds ordered by events (the
  only choice for virtual devices); FP32 on the wire below a size threshold, BF16 above;
* per-step values (token ids, positions, KV row indices, the mask and the attended KV
  length) live in one device input block refreshed by a single host-to-device copy, so
  the whole decode step is captured once as a CUDA graph and replayed for every token of
  a KV bucket (``cuda_graphs=True``; eager mode stays available).

``runtime``: how device operations are done. ``CupyRuntime`` (the default) uses CuPy 13/14;
``EmuRuntime`` runs everything on the CPU with the kernel emulator of ``cuda_kernels``
(numpy arrays, work executed in issue order, graph capture recorded and replayed), which is
how this backend is tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from metatp.backends import cuda_kernels as ck
from metatp.backends.base import Backend, WeightSource
from metatp.backends.slicing import local_raw_shape as _local_raw_shape, split_raw
from metatp.ir.errors import ConfigError, UnsupportedOpError
from metatp.ir.ops import OPS, GluOp, Op, RopeMode, UnaryOp
from metatp.ir.tensor import Flag, GGMLType, Tensor, type_size
from metatp.passes.memory import assign_offsets
from metatp.passes.plan import DeviceLayout, Local, Plan

__all__ = ["CupyBackend", "CupyExecutable", "CupyRuntime", "WireThresholds",
           "wire_dtype", "Transfer", "butterfly_schedule", "simulate_schedule", "split_raw",
           "WIRE_MODES", "ALLREDUCE_MODES"]

WIRE_MODES = ("auto", "f32", "bf16")
ALLREDUCE_MODES = ("auto", "nccl", "butterfly")
KV_DTYPES = ("f16", "bf16", "f32")
MULTI_GPU_GRAPHS = ("whole", "segments")
MATMUL_DTYPES = ("f16", "f32")
# Folding an RMS norm into a matvec makes every block recompute the norm of x: worth one
# launch for q/k/v or gate/up, not for a 49k-row lm head (thousands of blocks).
NORM_FOLD_MAX_ROWS = 8192


# =============================================================== all-reduce logic (pure Python)
@dataclass(frozen=True)
class WireThresholds:
    """Element counts below which an all-reduce travels as FP32 (above: BF16), per device
    count, as llama.cpp's cut-offs: n <= 2, n == 3, n >= 4."""

    n2: int = 32768
    n3: int = 131072
    n4: int = 262144

    def fp32_limit(self, n_devices: int) -> int:
        if n_devices <= 2:
            return self.n2
        return self.n3 if n_devices == 3 else self.n4


def wire_dtype(n_devices: int, n_elements: int, mode: str = "auto",
               thresholds: WireThresholds = WireThresholds()) -> str:
    """"f32" or "bf16": what one all-reduce of n_elements puts on the wire.

    mode "f32" keeps every reduction exact; "bf16" always halves the bytes; "auto" uses FP32
    for small tensors (latency-bound decode vectors) and BF16 for large ones (prefill)."""
    if mode not in WIRE_MODES:
        raise ConfigError(f"wire mode must be one of {', '.join(WIRE_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "f32" if n_elements < thresholds.fp32_limit(n_devices) else "bf16"


@dataclass(frozen=True)
class Transfer:
    """One step of a butterfly round: device `dst` reads device `src`'s value and adds it to
    its own ("add") or takes it ("copy")."""

    dst: int
    src: int
    op: str


def butterfly_schedule(n: int) -> list[list[Transfer]]:
    """Rounds of the all-reduce over n devices (the numpy reference's order, so every
    device ends with the same bits): fold the devices beyond the largest power of two p2
    into 0..n-p2-1, recursive doubling over p2 at distances p2/2 .. 1, copy back."""
    if n <= 1:
        return []
    p2 = 1 << (n.bit_length() - 1)
    rounds: list[list[Transfer]] = []
    if n > p2:
        rounds.append([Transfer(j - p2, j, "add") for j in range(p2, n)])
    off = p2 // 2
    while off >= 1:
        rounds.append([Transfer(j, j ^ off, "add") for j in range(p2)])
        off //= 2
    if n > p2:
        rounds.append([Transfer(j, j - p2, "copy") for j in range(p2, n)])
    return rounds


def simulate_schedule(bufs: list[np.ndarray], schedule: list[list[Transfer]],
                      active: Sequence[bool] | None = None) -> None:
    """Run a schedule on host arrays exactly as the device ops are ordered: per round every
    read happens before any write. (Tests compare it with backends.allreduce.)"""
    if active is not None:
        for b, on in zip(bufs, active):
            if not on:
                b.fill(0)
    for rnd in schedule:
        got = {t.dst: np.array(bufs[t.src], copy=True) for t in rnd}
        for t in rnd:
            if t.op == "add":
                bufs[t.dst] += got[t.dst]
            else:
                bufs[t.dst][...] = got[t.dst]


# =============================================================== runtimes
_CUDA_R_32F, _CUDA_R_16F = 0, 2
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_MEMCPY_H2D, _MEMCPY_DEFAULT = 1, 4


class _DeviceContext:
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
        self._nccl = None

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

    def context(self, gpu: int, stream) -> _DeviceContext:
        return _DeviceContext(self.cp.cuda.Device(gpu), stream)

    def kernels(self):
        return contextlib.nullcontext()

    @staticmethod
    def record(stream, event) -> None:
        stream.record(event)

    @staticmethod
    def wait(stream, event) -> None:
        stream.wait_event(event)

    @staticmethod
    def synchronize(stream) -> None:
        stream.synchronize()

    @staticmethod
    def host_wait(event) -> None:
        event.synchronize()

    def device_synchronize(self, gpu: int) -> None:
        """Wait for everything on a GPU, the legacy stream included (where CuPy's uploads and
        zero-fills run: our non-blocking streams do not wait for it)."""
        with self.cp.cuda.Device(gpu):
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
        return self.cp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype=dtype)

    def upload(self, host: np.ndarray):
        return self.cp.asarray(np.ascontiguousarray(host))

    def download(self, arr) -> np.ndarray:
        return self.cp.asnumpy(arr)

    def view(self, root, offset: int, shape, strides, dtype):
        if any(s == 0 for s in shape):
            return self.cp.empty(shape, dtype=dtype)
        return self.cp.ndarray(tuple(shape), dtype=dtype, memptr=root.data + int(offset),
                               strides=tuple(int(s) for s in strides))

    def pinned(self, nbytes: int) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned((max(nbytes, 1),), dtype=np.uint8)

    def memcpy(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        self.cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, _MEMCPY_DEFAULT, stream.ptr)

    def memcpy_h2d(self, dst_ptr: int, host: np.ndarray, nbytes: int, stream) -> None:
        self.cp.cuda.runtime.memcpyAsync(dst_ptr, host.ctypes.data, nbytes, _MEMCPY_H2D, stream.ptr)

    def memset(self, ptr: int, nbytes: int, stream) -> None:
        self.cp.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream.ptr)

    # ---- CUDA graphs
    @staticmethod
    def begin_capture(stream) -> None:
        stream.begin_capture()

    @staticmethod
    def end_capture(stream):
        return stream.end_capture()

    @staticmethod
    def launch_graph(graph, stream) -> None:
        graph.launch(stream=stream)

    # ---- cuBLAS
    def gemm_available(self) -> bool:
        if self._cublas is None:
            try:
                from cupy_backends.cuda.libs import cublas

                cublas.gemmEx  # noqa: B018 - loads the library (ImportError if libcublas is missing)
                self._cublas = cublas
            except Exception:  # noqa: BLE001
                self._cublas = False
        return bool(self._cublas)

    def gemm(self, m: int, n: int, k: int, w_ptr: int, x_ptr: int, y_ptr: int, ldy: int,
             dtype: str, stream, gpu: int) -> None:
        """y[n, m] (f32, row stride ldy) = x[n, k] @ w[m, k]^T, inputs f16 or f32 (cuBLAS).

        CuPy's gemmEx binds the handle to the *current* stream before the call (an explicit
        setStream is overridden), and the handle belongs to the current device: so both are
        entered here, whatever context the caller is in."""
        cublas = self._cublas
        with self.cp.cuda.Device(gpu), stream:
            handle = self.cp.cuda.device.get_cublas_handle()
            cublas.setPointerMode(handle, 0)    # host alpha/beta
            ab = _CUDA_R_16F if dtype == "f16" else _CUDA_R_32F
            cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k, self._one.ctypes.data, w_ptr, ab,
                          k, x_ptr, ab, k, self._zero.ctypes.data, y_ptr, _CUDA_R_32F, ldy,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    def matmul(self, a, b):
        return self.cp.matmul(a, b)

    # ---- NCCL
    def nccl_module(self):
        if self._nccl is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from cupy.cuda import nccl
            self._nccl = nccl if getattr(nccl, "available", False) else False
        return self._nccl or None

    def nccl_comms(self, gpus: Sequence[int]):
        nccl = self.nccl_module()
        if nccl is None:
            return None
        return list(nccl.NcclCommunicator.initAll(list(gpus)))

    def nccl_allreduce(self, calls) -> None:
        """calls: (comm, ptr, count, dtype 'f32'|'bf16', stream) per rank, in one NCCL group."""
        nccl = self.nccl_module()
        codes = {"f32": getattr(nccl, "NCCL_FLOAT32", 7), "bf16": getattr(nccl, "NCCL_BFLOAT16", 9)}
        op = getattr(nccl, "NCCL_SUM", 0)
        nccl.groupStart()
        try:
            for comm, ptr, count, dtype, stream in calls:
                comm.allReduce(ptr, ptr, count, codes[dtype], op, stream.ptr)
        finally:
            nccl.groupEnd()


# =============================================================== weights
_STORAGE = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16,
            GGMLType.I32: np.int32}
_KV_STORAGE = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}


def __getattr__(name: str):
    """EmuRuntime (tests only) lives in cupy_emulated; keep it importable from here."""
    if name == "EmuRuntime":
        from metatp.backends.cupy_emulated import EmuRuntime

        return EmuRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _np_shape(ne) -> tuple[int, int, int, int]:
    return (ne[3], ne[2], ne[1], ne[0])


@dataclass
class RawWeight:
    """A weight slice kept in its GGUF encoding on one device: `data` uint8 rows."""

    data: Any
    wtype: str                      # cuda_kernels weight type name ("q4_1", "f16", ...)
    ne: tuple[int, int, int, int]   # local ggml shape
    nb: tuple[int, int, int, int]   # local byte strides (contiguous)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _weight_type_name(t: GGMLType) -> str | None:
    name = GGMLType(t).name.lower()
    return name if name in ck.WEIGHT_TYPES else None


_QUANT_READERS = {Op.MUL_MAT, Op.MUL_MAT_ID, Op.GET_ROWS}


def quant_only_weight(t: Tensor, plan: Plan) -> bool:
    """True when every reader takes `t` as src0 of MUL_MAT / MUL_MAT_ID / GET_ROWS (kernels that
    read raw quant blocks), so it can stay encoded; anything else needs it as f32."""
    if not (t.flags & Flag.WEIGHT):
        return False
    readers = [n for n in plan.graph.nodes if any(s is t for s in n.src) or n.view_src is t]
    if not readers:
        return False
    for n in readers:
        if n.view_src is t or n.op not in _QUANT_READERS or n.src[0] is not t:
            return False
        if any(s is t for s in n.src[1:]):
            return False
        if n.op is Op.MUL_MAT and (t.ne[2] != 1 or t.ne[3] != 1):
            return False
    return True


def _dequantize_host(raw: np.ndarray, ggml_type: GGMLType, ne) -> np.ndarray:
    ggml_type = GGMLType(ggml_type)
    shape = _np_shape(ne)
    if ggml_type == GGMLType.F32:
        return np.ascontiguousarray(raw).view(np.float32).reshape(shape)
    if ggml_type == GGMLType.F16:
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(shape)
    from gguf import quants

    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, _local_raw_shape(ggml_type, ne)[-1])
    return np.ascontiguousarray(quants.dequantize(rows, ggml_type), dtype=np.float32).reshape(shape)


# =============================================================== devices
class _Device:
    """One logical device: a GPU, its own stream, the events the all-reduce orders with."""

    def __init__(self, rt, index: int, gpu: int) -> None:
        self.index = index
        self.gpu = gpu
        self.stream = rt.new_stream(gpu)
        self.ctx = rt.context(gpu, self.stream)
        self.ready = rt.new_event(gpu)      # "my buffer holds this round's value"
        self.read_done = rt.new_event(gpu)  # "I finished reading my partner's buffer"
        self.done = rt.new_event(gpu)       # end of step (joins the GPU's lead stream)
        self.fork = rt.new_event(gpu)       # start of step (recorded by the GPU's lead)
        self.inputs_copied = rt.new_event(gpu)
        self.step_fork = rt.new_event(gpu)  # several GPUs, one graph: the first GPU's lead starts the others
        self.step_done = rt.new_event(gpu)  # ... and waits for them (recorded by each GPU's lead)


# =============================================================== the backend
class CupyBackend(Backend):
    """N devices on CuPy: one GPU each when there are enough, else virtual devices (several
    logical devices with their own stream and buffers on one GPU).

    cuda_graphs: capture the decode step (plans whose matmuls all use matvec) on its second
    run and replay it. allreduce: "auto" (NCCL when every device is a distinct GPU and
    NCCL works, else butterfly), "nccl", "butterfly". wire: "auto" (FP32 below
    `wire_thresholds`, BF16 above), "f32" (exact), "bf16". kv_dtype: KV cache storage
    ("f16"). matmul_dtype: operand type of the dequantize + cuBLAS path used above
    MATVEC_MAX_TOKENS tokens ("f16"; "f32" for exactness). gpus: the GPU ids to use
    (default all visible; device d runs on gpus[d % len(gpus)]). multi_gpu_graphs: how a step
    over several GPUs is captured: "whole" (one graph spanning the GPUs, NCCL calls captured
    inside it; falls back to "segments" when that capture fails) or "segments" (one graph per
    subgraph and device, collectives run eagerly between them)."""

    name = "cupy"

    def __init__(self, layout: DeviceLayout | None = None, numerics: str = "exact", *,
                 cuda_graphs: bool = True, allreduce: str = "auto", wire: str = "auto",
                 wire_thresholds: WireThresholds = WireThresholds(), kv_dtype: str = "f16",
                 matmul_dtype: str = "f16", gpus: Sequence[int] | None = None,
                 multi_gpu_graphs: str = "whole", runtime=None) -> None:
        if numerics != "exact":
            raise ConfigError(f"cupy backend: numerics={numerics!r} is not supported (only 'exact'; the "
                              "numpy backend emulates llama.cpp's rounding)")
        from metatp.backends.collectives.schedule import ALIASES

        allreduce = ALIASES.get(allreduce, allreduce)      # llama.cpp's none/internal: the butterfly
        if allreduce not in ALLREDUCE_MODES:
            raise ConfigError(f"cupy backend: allreduce must be one of {', '.join(ALLREDUCE_MODES)}, "
                              f"got {allreduce!r}")
        wire_dtype(2, 0, wire)   # validates the mode
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if matmul_dtype not in MATMUL_DTYPES:
            raise ConfigError(f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {matmul_dtype!r}")
        if multi_gpu_graphs not in MULTI_GPU_GRAPHS:
            raise ConfigError(f"multi_gpu_graphs must be one of {', '.join(MULTI_GPU_GRAPHS)}, "
                              f"got {multi_gpu_graphs!r}")
        self.layout = layout or DeviceLayout()
        self.n = self.layout.n_devices
        self.numerics = numerics
        self.cuda_graphs = bool(cuda_graphs)
        self.wire = wire
        self.wire_thresholds = wire_thresholds
        self.kv_dtype = kv_dtype
        self.matmul_dtype = matmul_dtype
        self.multi_gpu_graphs = multi_gpu_graphs
        self.rt = runtime if runtime is not None else CupyRuntime()
        n_gpus = self.rt.n_gpus()
        if n_gpus < 1:
            raise UnsupportedOpError("cupy backend: no CUDA device")
        self.gpus = list(gpus) if gpus is not None else list(range(n_gpus))
        self.devices = [_Device(self.rt, d, self.gpus[d % len(self.gpus)]) for d in range(self.n)]
        self.distinct_gpus = len({dev.gpu for dev in self.devices}) == self.n
        self.virtual = not self.distinct_gpus
        self.leaf: list[dict[Tensor, Any]] = [{} for _ in range(self.n)]
        self._executables: dict[int, CupyExecutable] = {}
        self.allreduce_mode = allreduce
        self.comms = self._init_nccl(allreduce)
        self.nccl_failures = 0
        used = sorted({dev.gpu for dev in self.devices})
        if len(used) > 1:        # also for virtual devices spread over several GPUs (gpus=[0, 1], 4 devices)
            self.rt.enable_peer_access(used)

    def _init_nccl(self, mode: str):
        """NCCL communicators (one per device) when every device is its own GPU, else None."""
        if mode == "butterfly" or self.n == 1:
            return None
        if not self.distinct_gpus:
            if mode == "nccl":
                raise ConfigError(f"allreduce='nccl' needs {self.n} distinct GPUs; devices share GPUs "
                                  "(NCCL cannot use one GPU twice): use 'butterfly' or 'auto'")
            return None
        try:
            comms = self.rt.nccl_comms([dev.gpu for dev in self.devices])
        except Exception as e:  # noqa: BLE001
            if mode == "nccl":
                raise
            warnings.warn(f"NCCL init failed ({type(e).__name__}: {e}); using the copy-and-add all-reduce",
                          stacklevel=3)
            return None
        if comms is None and mode == "nccl":
            raise ConfigError("allreduce='nccl' but NCCL is not available (pip install nvidia-nccl-cu12/13)")
        return comms

    @property
    def allreduce_strategy(self) -> str:
        if self.n == 1:
            return "none"
        return "nccl" if self.comms else "butterfly"

    # ---------------------------------------------------------------- leaf data
    def _store(self, d: int, host: np.ndarray):
        gpu = self.devices[d].gpu
        with self.rt.device(gpu):
            arr = self.rt.upload(host)
        self.rt.device_synchronize(gpu)
        return arr

    def upload(self, t: Tensor, full: np.ndarray, plan: Plan) -> None:
        """Store a leaf's float value (f32 on the device), split as the plan says."""
        from metatp.backends.slicing import device_slices

        parts = device_slices(np.ascontiguousarray(full, dtype=np.float32), t, plan.of(t), self.n)
        for d in range(self.n):
            part = np.ascontiguousarray(parts[d], dtype=np.float32)
            self.leaf[d][t] = self._store(d, part.reshape(_np_shape(plan.of(t).local[d].ne)))

    def upload_raw(self, t: Tensor, raw: np.ndarray, ggml_type, plan: Plan) -> None:
        """Store a weight from its GGUF bytes (uint8 rows, `Model.raw_bytes`): kept encoded
        when only matmul/get_rows kernels read it, else dequantized once to f32 here."""
        gtype = GGMLType(ggml_type)
        wname = _weight_type_name(gtype)
        if wname is None or not quant_only_weight(t, plan):
            self.upload(t, _dequantize_host(raw, gtype, t.ne), plan)
            return
        parts = split_raw(raw, t, gtype, plan.of(t), self.n)
        for d in range(self.n):
            loc = plan.of(t).local[d]
            nb = _raw_nb(gtype, loc.ne)
            self.leaf[d][t] = RawWeight(self._store(d, parts[d]), wname, tuple(loc.ne), nb)

    def store_weight(self, t: Tensor, source: WeightSource, plan: Plan) -> None:
        """GPU kernels read the GGUF encoding: keep it (see `upload_raw`)."""
        self.upload_raw(t, source.raw, source.ggml_type, plan)

    def weight_bytes(self, t: Tensor, local_ne: tuple[int, ...], plan: Plan) -> int:
        """Bytes kept for a weight slice: its GGUF encoding when kernels read it raw, else f32."""
        n = int(np.prod(local_ne))
        if (t.flags & Flag.WEIGHT) and _weight_type_name(t.type) and quant_only_weight(t, plan):
            return int(np.prod(_local_raw_shape(t.type, local_ne)))
        return n * 4

    def kv_itemsize(self, t: Tensor) -> int:
        """Bytes per element of the KV cache as stored (an F32 cache is kept as kv_dtype, f16 by default)."""
        return np.dtype(self._leaf_dtype(t)).itemsize

    def workspace_bytes(self, plan: Plan) -> list[int]:
        """Per device: device memory beyond weights, KV and the plan's arena: the scratch buffers
        (f16 copies of the largest GEMM weight and input, attention split workspace, sized for this
        plan and for a one-token step, all-reduce wire and receive buffers) and the input block
        beyond the input tensors plan_memory already counts (kv_len words, 64-byte padding)."""
        layout, block = _input_layout(plan.graph)
        inputs = sum(t.nelements * np.dtype(_STORAGE[t.type]).itemsize for t in layout if isinstance(t, Tensor))
        leads = {dev.gpu: dev.index for dev in reversed(self.devices)}
        out = []
        with self.rt.kernels():
            for d, dev in enumerate(self.devices):
                with self.rt.device(dev.gpu):
                    need = self._scratch_needs(plan, d, one_token_too=True)
                total = sum(max(n, 1) * np.dtype(dt).itemsize for n, dt in need.values())
                if leads[dev.gpu] == d:
                    total += max(0, block - inputs)
                out.append(int(total))
        return out

    def _scratch_needs(self, plan: Plan, d: int, one_token_too: bool = False) -> dict[str, tuple[int, Any]]:
        """Scratch buffer -> (elements, dtype) device d needs to run `plan` (`one_token_too`: and a
        one-token step at the same KV length, whose attention splits the KV more)."""
        graph = plan.graph
        need: dict[str, tuple[int, Any]] = {}

        def want(key: str, n: int, dtype) -> None:
            if n > need.get(key, (0, None))[0]:
                need[key] = (n, dtype)
        mdt = np.float16 if self.matmul_dtype == "f16" else np.float32
        gemm = self.rt.gemm_available()
        for node in graph.nodes:
            if not plan.of(node).compute[d]:
                continue
            if node.op is Op.FLASH_ATTN_EXT:
                q, k = plan.of(node.src[0]).local[d], plan.of(node.src[1]).local[d]
                D, T, H, n_kv, Hkv = q.ne[0], q.ne[1], q.ne[2], k.ne[1], k.ne[2]
                for tok in {T, 1} if one_token_too else {T}:
                    if tok <= ck.ATTN_DECODE_MAX_TOKENS and Hkv and H % Hkv == 0:
                        splits, _ = ck.decode_splits(Hkv, H, tok, n_kv)
                        if splits > 1:
                            want("attn", ck.attn_workspace_floats(H, D, tok, splits), np.float32)
            elif node.op is Op.MUL_MAT and gemm:
                w = node.src[0]
                tokens = _matmul_tokens(node)
                if w.flags & Flag.WEIGHT and w.ne[2] == 1 and w.ne[3] == 1 and tokens > ck.MATVEC_MAX_TOKENS:
                    lw = plan.of(w).local[d]
                    want(f"gemm_w_{mdt.__name__}", lw.ne[0] * lw.ne[1], mdt)
                    want(f"gemm_x_{mdt.__name__}", lw.ne[0] * tokens, mdt)
        if self.n > 1:
            for sub in plan.subgraphs:
                if sub.reduction is not None:
                    n_el = graph.nodes[sub.reduction.node].nelements
                    want("recv_f32", n_el, np.float32)
                    if wire_dtype(self.n, n_el, self.wire, self.wire_thresholds) == "bf16":
                        want("wire", n_el, np.uint16)
                        want("recv_bf16", n_el, np.uint16)
        return need

    def has(self, t: Tensor) -> bool:
        return t in self.leaf[0]

    def allocate_leaf(self, t: Tensor, plan: Plan) -> None:
        """Zero-filled per-device buffers for a persistent leaf (the KV cache)."""
        for d in range(self.n):
            shape = _np_shape(plan.of(t).local[d].ne)
            with self.rt.device(self.devices[d].gpu):
                self.leaf[d][t] = self.rt.zeros(shape, self._leaf_dtype(t))
            self.rt.device_synchronize(self.devices[d].gpu)

    def _leaf_dtype(self, t: Tensor):
        if t.flags & Flag.KV_CACHE and t.type in (GGMLType.F32, GGMLType.F16):
            return _KV_STORAGE[self.kv_dtype] if t.type == GGMLType.F32 else np.float16
        try:
            return _STORAGE[t.type]
        except KeyError:
            raise UnsupportedOpError(f"cupy backend: leaf {t.name!r} of type {t.type.name} has no storage") from None

    def memory_budget(self) -> tuple[int | None, bool]:
        """(bytes available, shared by all devices?): free memory of the GPU(s), counting the
        blocks CuPy's pool keeps cached (free to us, but not to cudaMemGetInfo)."""
        try:
            gpus = sorted({dev.gpu for dev in self.devices})
            free = [self.rt.mem_info(g)[0] + self.rt.pool_free_bytes(g) for g in gpus]
        except Exception:  # noqa: BLE001
            return None, False
        if self.distinct_gpus:
            return min(free), False
        return sum(free), True

    def allocated_bytes(self) -> list[int]:
        out = []
        for d in range(self.n):
            n = sum(int(a.nbytes) for a in self.leaf[d].values())
            n += max((ex.buffer_bytes[d] for ex in self._executables.values()), default=0)
            out.append(n)
        return out

    def reset_kv(self) -> None:
        for d, dev in enumerate(self.devices):
            with dev.ctx:
                for t, a in self.leaf[d].items():
                    if t.flags & Flag.KV_CACHE and a.nbytes:
                        self.rt.memset(ck.device_ptr(a), int(a.nbytes), dev.stream)
        self.synchronize()

    def synchronize(self) -> None:
        for dev in self.devices:
            self.rt.synchronize(dev.stream)

    # ---------------------------------------------------------------- plans
    def prepare(self, plan: Plan) -> CupyExecutable:
        ex = self._executables.get(id(plan))
        if ex is None or ex.plan is not plan:
            ex = CupyExecutable(self, plan)
            self._executables[id(plan)] = ex
        return ex

    def release(self, plan: Plan) -> None:
        ex = self._executables.get(id(plan))
        if ex is not None and ex.plan is plan:
            self.synchronize()
            del self._executables[id(plan)]


def _matmul_tokens(mm: Tensor) -> int:
    """Columns (tokens) of a MUL_MAT's activation operand."""
    return mm.src[1].ne[1] * mm.src[1].ne[2] * mm.src[1].ne[3]


def _input_layout(graph) -> tuple[dict[Any, tuple[int, tuple, Any]], int]:
    """The per-GPU input block: every INPUT leaf (64-byte aligned) plus an int32 "attended
    length" per attention mask; key -> (offset, numpy shape, dtype), and the block's bytes."""
    inputs = [t for t in graph.leaves if t.flags & Flag.INPUT]
    masks = {n.src[3] for n in graph.nodes
             if n.op is Op.FLASH_ATTN_EXT and len(n.src) > 3 and n.src[3] is not None
             and n.src[3].flags & Flag.INPUT}
    layout: dict[Any, tuple[int, tuple, Any]] = {}
    off = 0
    for t in inputs:
        dtype = _STORAGE.get(t.type)
        if dtype is None:
            raise UnsupportedOpError(f"cupy backend: input {t.name!r} of type {t.type.name}")
        layout[t] = (off, _np_shape(t.ne), dtype)
        off += -(-t.nelements * np.dtype(dtype).itemsize // 64) * 64
    for m in sorted(masks, key=lambda t: t.id):
        layout[("kv_len", m)] = (off, (1,), np.int32)
        off += 64
    return layout, max(off, 64)


def _raw_nb(t: GGMLType, ne) -> tuple[int, int, int, int]:
    rb = _local_raw_shape(t, ne)[-1]
    return (type_size(t), rb, rb * ne[1], rb * ne[1] * ne[2])


# =============================================================== the executable
class _HostStep:
    """Work that is not a pre-recorded kernel launch (cuBLAS, cupy ops): runs eagerly and
    keeps a plan out of CUDA-graph capture."""

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self.fn = fn
        self.what = what

    def __call__(self) -> None:
        self.fn()


def _graph_itemsize(t: Tensor) -> int:
    try:
        return np.dtype(_STORAGE[t.type]).itemsize
    except KeyError:
        raise UnsupportedOpError(f"cupy backend: tensor {t.name!r} of type {t.type.name} "
                                 "cannot be an activation or a view") from None


@dataclass
class _Reduction:
    index: int                 # subgraph index
    node: Tensor
    bufs: list                 # per device: flat f32 view of the node
    active: list[bool]
    wire: str                  # "f32" / "bf16"
    n_elements: int
    ops: list = field(default_factory=list)        # butterfly: [(device, [steps])]
    nccl: list = field(default_factory=list)       # NCCL: [(device, pre), group, (device, post)]


@dataclass
class _Fusion:
    """Nodes run as one launch at `at`'s position (see CupyExecutable's fusion notes)."""

    kind: str                                  # names the _fused_<kind> handler
    at: Tensor
    absorbed: tuple[Tensor, ...]
    keep: tuple[Tensor, ...] = ()              # inputs read after their last unfused reader
    detach: tuple[Tensor, ...] = ()            # outputs written before their own node
    parts: dict = field(default_factory=dict)


class CupyExecutable:
    """A plan bound to device buffers: per subgraph, per device, a list of launches."""

    def __init__(self, backend: CupyBackend, plan: Plan) -> None:
        if plan.n_devices != backend.n:
            raise ValueError(f"plan is for {plan.n_devices} devices, backend has {backend.n}")
        self.backend = backend
        self.plan = plan
        self.rt = backend.rt
        self.devices = backend.devices
        self.n = backend.n
        graph = plan.graph
        self.arrays: list[dict[Tensor, Any]] = [{} for _ in range(self.n)]
        self.buffer_bytes = [0] * self.n
        self._arena: dict[int, Any] = {}
        self._scratch: list[dict[str, Any]] = [{} for _ in range(self.n)]
        self._retired: list = []          # outgrown scratch buffers: frozen launches may point at them
        self._sub_of = {graph.nodes[i]: k for k, sub in enumerate(plan.subgraphs)
                        for i in range(sub.start, sub.end + 1)}
        self._readers = graph.consumers()
        self._reduced = {graph.nodes[s.reduction.node] for s in plan.subgraphs if s.reduction is not None}
        self._leads = self._lead_devices()
        with self.rt.kernels():
            self._bind_inputs()
            self._bind_leaves()
            self.fusions = self._find_fusions()
            keep, detach = self._fusion_keep_alive(), self._detached()
            for d in range(self.n):
                self._bind_nodes(d, keep, detach)
                with self.rt.device(self.devices[d].gpu):
                    self._presize(d)
            self.steps = self._build_steps()
            self.reductions = self._build_reductions()
        self.capturable = all(not isinstance(s, _HostStep)
                              for per_dev in self.steps for steps in per_dev for s in steps)
        for gpu in self._leads:
            self.rt.device_synchronize(gpu)       # allocations and zero-fills are done
        self._graph = None
        self.graph_mode: str | None = None      # "whole" / "segments" once captured
        self._capturing = False
        self.runs = 0

    # ---------------------------------------------------------------- binding buffers
    def _lead_devices(self) -> dict[int, int]:
        """GPU -> the first logical device on it (its stream copies inputs and joins the rest)."""
        leads: dict[int, int] = {}
        for dev in self.devices:
            leads.setdefault(dev.gpu, dev.index)
        return leads

    def _bind_inputs(self) -> None:
        """One input block per GPU (every INPUT leaf, plus an int32 'attended length' per
        attention mask), filled from a pinned host mirror by one copy per step."""
        graph = self.plan.graph
        inputs = [t for t in graph.leaves if t.flags & Flag.INPUT]
        layout, self._in_bytes = _input_layout(graph)
        self._in_layout = layout
        self._host_in = self.rt.pinned(self._in_bytes)
        self._host_views = {key: np.ndarray(shape, dtype, buffer=self._host_in, offset=o)
                            for key, (o, shape, dtype) in layout.items()}
        for key, v in self._host_views.items():
            v[...] = 0 if not isinstance(key, tuple) else 1 << 30
        self._dev_in: dict[int, Any] = {}
        self._dev_views: dict[int, dict[Any, Any]] = {}
        for gpu, d in self._leads.items():
            with self.rt.device(gpu):
                block = self.rt.zeros((self._in_bytes,), np.uint8)
                self._dev_in[gpu] = block
                self._dev_views[gpu] = {
                    key: self.rt.view(block, o, shape, _contig_strides(shape, dtype), dtype)
                    for key, (o, shape, dtype) in layout.items()}
        for d, dev in enumerate(self.devices):
            for t in inputs:
                self.arrays[d][t] = self._dev_views[dev.gpu][t]
        self._inputs_pending = False

    def kv_len_view(self, d: int, mask: Tensor):
        return self._dev_views[self.devices[d].gpu].get(("kv_len", mask))

    def _bind_leaves(self) -> None:
        backend, plan = self.backend, self.plan
        for t in plan.graph.leaves:
            if t.flags & Flag.INPUT:
                continue
            if t.flags & Flag.KV_CACHE and not backend.has(t):
                backend.allocate_leaf(t, plan)
            if not backend.has(t):
                raise UnsupportedOpError(f"cupy backend: leaf {t.name!r} has no data (upload it first)")
            for d in range(self.n):
                self.arrays[d][t] = backend.leaf[d][t]

    def _bind_nodes(self, d: int, keep: set[Tensor], detach: set[Tensor]) -> None:
        """Owners get arena slots (dead buffers reused, except `keep`), or memory of their own
        (`detach`); views map onto their owner's memory."""
        plan, rt = self.plan, self.rt
        arrays = self.arrays[d]
        offsets, size = assign_offsets(plan, d, _graph_itemsize, keep=keep)
        with rt.device(self.devices[d].gpu):
            arena = rt.empty((max(size, 64),), np.uint8)
        self._arena[d] = arena
        self.buffer_bytes[d] = int(arena.nbytes)
        for node in plan.graph.nodes:
            loc = plan.of(node).local[d]
            if node.view_src is None:
                dtype = _STORAGE.get(node.type)
                if dtype is None:
                    raise UnsupportedOpError(f"cupy backend: node {node.name!r} of type {node.type.name}")
                shape = _np_shape(loc.ne)
                if node in detach:
                    with rt.device(self.devices[d].gpu):
                        arrays[node] = rt.empty(shape, dtype)
                    self.buffer_bytes[d] += int(arrays[node].nbytes)
                else:
                    arrays[node] = rt.view(arena, offsets[node], shape, _contig_strides(shape, dtype), dtype)
            else:
                arrays[node] = self._view(d, node, loc)

    def _view(self, d: int, t: Tensor, loc: Local):
        """The device view of `t`: the plan's local shape/strides/offset, rescaled from the
        graph's element size to the storage's (an F32 KV cache is stored as f16)."""
        root = self.arrays[d][t.view_src]
        if isinstance(root, RawWeight):
            raise UnsupportedOpError(f"cupy backend: view {t.name!r} of the quantized weight "
                                     f"{t.view_src.name!r} is not supported")
        gsz = _graph_itemsize(t)
        ssz = root.dtype.itemsize
        shape = _np_shape(loc.ne)
        for x in (loc.offs, *loc.nb):
            if x % gsz:
                raise UnsupportedOpError(f"cupy backend: view {t.name!r} is not element-aligned")
        strides = tuple(loc.nb[i] // gsz * ssz for i in (3, 2, 1, 0))
        return self.rt.view(root, loc.offs // gsz * ssz, shape, strides, root.dtype)

    def _scratch_buffer(self, d: int, key: str, n: int, dtype):
        """A per-device scratch array of at least n elements (shared by every node that needs
        it: work on one stream runs in order). Sized up front by `_presize`; an outgrown
        buffer is kept alive, as recorded steps may hold its address."""
        cur = self._scratch[d].get(key)
        if cur is None or cur.size < n or cur.dtype != np.dtype(dtype):
            if cur is not None:
                self._retired.append(cur)
            with self.rt.device(self.devices[d].gpu):
                cur = self.rt.empty((max(n, 1),), dtype)
            self._scratch[d][key] = cur
            self.buffer_bytes[d] += int(cur.nbytes)
        return cur

    def _presize(self, d: int) -> None:
        """Allocate every scratch buffer of device d at its largest size before recording."""
        for key, (n, dtype) in self.backend._scratch_needs(self.plan, d).items():
            self._scratch_buffer(d, key, n, dtype)

    # ---------------------------------------------------------------- fusions
    # A fusion runs several nodes as one launch at the position of one of them (`at`); the
    # others get no launch (`absorbed`). Two memory rules keep the arena allocator's view
    # (computed from the unfused graph) true: an input read later than its last unfused
    # reader is kept alive to the end (`keep`, decode-sized tensors only), and an output
    # written earlier than its own node gets memory of its own (`detach`).
    def _sole_reader(self, t: Tensor, consumer: Tensor) -> bool:
        """`t` feeds only `consumer`, in the same subgraph, with the same devices computing it,
        and nothing needs its own buffer (not an output, not reduced, not a partial value)."""
        return self._readers.get(t) == [consumer] and self._fusable(t, consumer)

    def _fusable(self, t: Tensor, other: Tensor) -> bool:
        """`t` may be computed inside a launch placed at `other`'s position."""
        plan = self.plan
        tp, op = plan.of(t), plan.of(other)
        return (not (t.flags & Flag.OUTPUT) and t.op is not Op.NONE and t not in self._reduced
                and self._sub_of.get(t) == self._sub_of.get(other)
                and not tp.state.is_partial and list(tp.compute) == list(op.compute)
                and not (tp.zero_fill and any(tp.zero_fill)))

    def _uses_after(self, t: Tensor, index: int) -> bool:
        """Every reader of `t` (through views) comes after graph position `index`."""
        idx = self.plan.graph.index
        todo, seen = [t], set()
        while todo:
            cur = todo.pop()
            for r in self._readers.get(cur, []):
                if r in seen:
                    continue
                seen.add(r)
                if OPS[r.op].is_view and r.op not in (Op.CPY, Op.SET_ROWS):
                    todo.append(r)
                elif idx[r] <= index:
                    return False
        return True

    def _find_fusions(self) -> dict[Tensor, "_Fusion"]:
        """Fusions by the node whose position runs them, found in priority order."""
        self._fusion_list: list[_Fusion] = []
        taken: set[Tensor] = set()
        finders = (self._glu_fusion, self._add_fusion, self._multi_fusions, self._norm_fusion,
                   self._rope_pair_fusion, self._set_rows_pair_fusion)
        for find in finders:
            for node in self.plan.graph.nodes:
                for f in find(node, taken) or ():
                    members = (f.at, *f.absorbed)
                    if any(m in taken for m in members):
                        continue
                    taken.update(members)
                    self._fusion_list.append(f)
        return {f.at: f for f in self._fusion_list}

    def _fusion_keep_alive(self) -> set[Tensor]:
        return {t.view_src or t for f in self._fusion_list for t in f.keep}

    def _detached(self) -> set[Tensor]:
        return {t for f in self._fusion_list for t in f.detach}

    def _norm_of(self, x: Tensor, readers: set[Tensor]) -> tuple[Tensor, Tensor] | None:
        """(MUL node, RMS_NORM node) when x = RMS_NORM(x0) * w (w a weight row) and exactly
        `readers` read x: the norm can be folded into their matvec prologue."""
        if x.op is not Op.MUL or set(self._readers.get(x, [])) != readers:
            return None
        rms, w = x.src[0], x.src[1]
        if rms.op is not Op.RMS_NORM or not (w.flags & Flag.WEIGHT) or w.ne != (rms.ne[0], 1, 1, 1):
            return None
        if rms.ne[1] * rms.ne[2] * rms.ne[3] != 1 or not self._sole_reader(rms, x):
            return None
        if any(isinstance(self.arrays[d][w], RawWeight) for d in range(self.n)):
            return None
        if not all(self._fusable(x, r) for r in readers):
            return None
        return x, rms

    def _matmul_tokens(self, mm: Tensor) -> int:
        return _matmul_tokens(mm)

    def _is_matvec(self, mm: Tensor) -> bool:
        if mm.op is not Op.MUL_MAT:
            return False
        w = mm.src[0]
        return (bool(w.flags & Flag.WEIGHT) and w.view_src is None
                and w.ne[2] == 1 and w.ne[3] == 1
                and self._matmul_tokens(mm) <= ck.MATVEC_MAX_TOKENS)

    def _same_weight_layout(self, weights: Sequence[Tensor]) -> bool:
        for d in range(self.n):
            ops_ = [self._weight_operand(d, w) for w in weights]
            ne0 = {self.plan.of(w).local[d].ne[0] for w in weights}
            if len({o[1] for o in ops_}) != 1 or len(ne0) != 1:
                return False
        return True

    def _glu_fusion(self, node: Tensor, taken) -> list:
        """GLU(MUL_MAT(Wg, x), MUL_MAT(Wu, x)) for one token -> one matvec_glu launch at the
        GLU (with x's RMS norm folded in when only gate and up read it)."""
        if node.op is not Op.GLU or len(node.src) != 2 or node.src[1] is None:
            return []
        gate, up = node.src
        if not (self._is_matvec(gate) and self._is_matvec(up)) or self._matmul_tokens(gate) != 1:
            return []
        if gate.src[1] is not up.src[1] or gate is up or gate.src[0].ne != up.src[0].ne:
            return []
        if not (self._sole_reader(gate, node) and self._sole_reader(up, node)):
            return []
        if not self._same_weight_layout([gate.src[0], up.src[0]]):
            return []
        x = gate.src[1]
        norm = self._norm_of(x, {gate, up}) if self._group_rows([gate]) <= NORM_FOLD_MAX_ROWS else None
        if norm is not None:
            return [_Fusion("matvec_glu", node, (gate, up, *norm), keep=(norm[1].src[0],),
                            parts={"gate": gate, "up": up, "norm": norm})]
        return [_Fusion("matvec_glu", node, (gate, up), keep=(x,), parts={"gate": gate, "up": up})]

    def _add_fusion(self, node: Tensor, taken) -> list:
        """ADD(mm, other) / ADD(other, mm) with other a residual of mm's shape or a bias row:
        the add rides in the matvec epilogue."""
        if node.op is not Op.ADD:
            return []
        for i in (0, 1):
            mm, other = node.src[i], node.src[1 - i]
            if mm is other or mm in taken or not self._is_matvec(mm) or not self._sole_reader(mm, node):
                continue
            if other.type == GGMLType.F32 and (other.ne == mm.ne or other.ne == (mm.ne[0], 1, 1, 1)):
                if not any(isinstance(self.arrays[d].get(other), RawWeight) for d in range(self.n)):
                    return [_Fusion("matvec_add", node, (mm,), keep=(mm.src[1],), parts={"mm": mm, "other": other})]
        return []

    def _multi_fusions(self, node: Tensor, taken) -> list:
        """The one-token MUL_MATs reading the same x (q, k, v) in groups of up to three, run at
        the first one's position (later ones' outputs detached); x's RMS norm folded in when
        only they read it. A lone matvec is fused only to fold a norm in (the lm head)."""
        idx = self.plan.graph.index
        readers = sorted((r for r in self._readers.get(node, []) if r.op is Op.MUL_MAT and r.src[1] is node
                          and r not in taken and self._is_matvec(r) and self._matmul_tokens(r) == 1),
                         key=lambda r: idx[r])
        if not readers:
            return []
        readers = readers[:1] + [r for r in readers[1:] if self._fusable(r, readers[0])]
        if not self._same_weight_layout([r.src[0] for r in readers]):
            return []
        norm = self._norm_of(node, set(readers)) if len(readers) <= 3 else None
        if norm is not None and self._group_rows(readers) > NORM_FOLD_MAX_ROWS:
            norm = None
        groups = [readers[i:i + 3] for i in range(0, len(readers), 3)]
        out = []
        for g in groups:
            if len(g) == 1 and norm is None:
                continue
            if any(not self._uses_after(m, idx[g[0]]) for m in g[1:]):
                continue
            absorbed = tuple(g[1:]) + (tuple(norm) if norm is not None else ())
            keep = (norm[1].src[0],) if norm is not None else ()
            out.append(_Fusion("matvec_multi", g[0], absorbed, keep=keep, detach=tuple(g[1:]),
                               parts={"members": tuple(g), "norm": norm}))
        return out

    def _group_rows(self, mms: Sequence[Tensor]) -> int:
        """Output rows of a group of matvecs on the busiest device."""
        return max(sum(self.plan.of(mm.src[0]).local[d].ne[1] for mm in mms) for d in range(self.n))

    def _norm_fusion(self, node: Tensor, taken) -> list:
        """MUL(RMS_NORM(x) or NORM(x), w) with w a weight row [ne0] (as the numpy backend fuses);
        x is kept alive when nothing reads it after the MUL."""
        if node.op is not Op.MUL:
            return []
        norm_node, w = node.src[0], node.src[1]
        if norm_node.op not in (Op.RMS_NORM, Op.NORM) or not (w.flags & Flag.WEIGHT):
            return []
        if w.ne != (norm_node.ne[0], 1, 1, 1) or not self._sole_reader(norm_node, node):
            return []
        if any(isinstance(self.arrays[d][w], RawWeight) for d in range(self.n)):
            return []
        x = norm_node.src[0]
        x_root = x.view_src or x
        keep = ()
        if x_root.op is not Op.NONE and not self._uses_after(x_root, self.plan.graph.index[node]):
            keep = (x_root,)
            if norm_node.ne[1] * norm_node.ne[2] * norm_node.ne[3] > ck.MATVEC_MAX_TOKENS:
                return []          # keeping a prefill-sized tensor alive costs more than the launch
        return [_Fusion("norm", node, (norm_node,), keep=keep, parts={"norm": norm_node})]

    def _later_partners(self, node: Tensor, taken):
        """Later nodes of the same op reading the same src[1] (positions / row indices) as `node`."""
        idx = self.plan.graph.index
        for other in self._readers.get(node.src[1], []):
            if other is not node and other.op is node.op and other not in taken and idx[other] > idx[node] \
                    and other.src[1] is node.src[1]:
                yield other

    def _rope_pair_fusion(self, node: Tensor, taken) -> list:
        """Two ROPEs with the same positions and parameters (Q and K of a layer) -> one launch at
        the later one."""
        if node.op is not Op.ROPE or node in taken:
            return []
        idx = self.plan.graph.index
        for other in self._later_partners(node, taken):
            if other.params != node.params or other.src[2:] != node.src[2:] or node.ne[0] != other.ne[0]:
                continue
            if node.ne[2] != other.ne[2] or node.ne[3] != 1 or other.ne[3] != 1:
                continue
            if not self._fusable(node, other) or not self._uses_after(node, idx[other]):
                continue
            if node.ne[2] > ck.MATVEC_MAX_TOKENS:
                continue
            return [_Fusion("rope_pair", other, (node,), keep=(node.src[0],), parts={"first": node})]
        return []

    def _set_rows_pair_fusion(self, node: Tensor, taken) -> list:
        """Two SET_ROWS with the same row indices into caches of one storage type (K and V of a
        layer) -> one launch at the later one."""
        if node.op is not Op.SET_ROWS or node in taken:
            return []
        for other in self._later_partners(node, taken):
            if node.src[0].ne[1] > ck.MATVEC_MAX_TOKENS or node.type != other.type:
                continue
            if list(self.plan.of(node).compute) != list(self.plan.of(other).compute):
                continue
            if self._sub_of.get(node) != self._sub_of.get(other) or not self._uses_after(node, self.plan.graph.index[other]):
                continue
            if any(node.view_src is r or other.view_src is r for r in (node.src[0], other.src[0])):
                continue
            return [_Fusion("set_rows_pair", other, (node,), keep=(node.src[0],), parts={"first": node})]
        return []

    # ---------------------------------------------------------------- steps
    def _build_steps(self) -> list[list[list]]:
        """[subgraph][device] -> frozen launches / host steps, in graph order."""
        plan, graph = self.plan, self.plan.graph
        absorbed = {t for f in self.fusions.values() for t in f.absorbed}
        steps = []
        for sub in plan.subgraphs:
            per_dev = []
            for d, dev in enumerate(self.devices):
                out: list = []
                with self.rt.device(dev.gpu):
                    for i in range(sub.start, sub.end + 1):
                        node = graph.nodes[i]
                        if OPS[node.op].is_view and node.op not in (Op.CPY, Op.SET_ROWS):
                            continue
                        tp = plan.of(node)
                        if not tp.compute[d]:
                            if tp.zero_fill is not None and tp.zero_fill[d]:
                                out.append(self._zero_fill_step(d, node))
                            continue
                        if node in absorbed:
                            continue
                        out.extend(self._node_steps(d, node))
                per_dev.append(out)
            steps.append(per_dev)
        return steps

    def _zero_fill_step(self, d: int, node: Tensor):
        a = self.arrays[d][node]
        ptr, nbytes, stream = ck.device_ptr(a), int(a.nbytes), self.devices[d].stream
        return _Memset(self.rt, ptr, nbytes, stream)

    def _record(self, fn, *args, **kw) -> list:
        with ck.recording() as launches:
            fn(*args, **kw)
        return [la.frozen() for la in launches]

    def _node_steps(self, d: int, node: Tensor) -> list:
        fused = self.fusions.get(node)
        if fused is not None:
            try:
                return getattr(self, f"_fused_{fused.kind}")(d, fused)
            except (ValueError, TypeError, UnsupportedOpError):
                return self._unfused_fallback(d, fused)
        return self._unfused_steps(d, node)

    def _unfused_fallback(self, d: int, f: "_Fusion") -> list:
        """A layout a fused kernel cannot take: its nodes run one by one here, in graph order
        (their outputs have buffers; their inputs are kept alive). A folded norm runs as the
        norm x weight kernel writing the MUL's buffer (the RMS_NORM buffer may be gone)."""
        idx = self.plan.graph.index
        nodes = sorted((f.at, *f.absorbed), key=lambda t: idx[t])
        steps: list = []
        for t in nodes:
            if t.op is Op.RMS_NORM and f.kind != "norm":
                continue
            if t.op is Op.MUL and t.src[0].op is Op.RMS_NORM and f.kind != "norm":
                steps += self._norm_times_weight(d, t, t.src[0])
                continue
            steps += self._unfused_steps(d, t)
        return steps

    def _unfused_steps(self, d: int, node: Tensor) -> list:
        try:
            handler = getattr(self, f"_op_{node.op.name.lower()}", None)
            if handler is None:
                raise UnsupportedOpError(f"cupy backend: no kernel for op {node.op.name} (node {node.name!r})")
            return handler(d, node)
        except (ValueError, TypeError) as e:
            raise UnsupportedOpError(f"cupy backend: {node.op.name} node {node.name!r} on device {d}: {e}") from e

    def _a(self, d: int, t: Tensor):
        return self.arrays[d][t] if t is not None else None

    # ---- op handlers: each returns the node's steps on device d
    def _op_get_rows(self, d: int, node: Tensor) -> list:
        src, ids = node.src
        a, out, idx = self._a(d, src), self._a(d, node), self._a(d, ids)
        if isinstance(a, RawWeight):
            return self._record(ck.get_rows, a.data, a.wtype, idx, out, ne0=a.ne[0],
                                src_row_bytes=a.nb[1], src_batch_bytes=(a.nb[2], a.nb[3]))
        if a.dtype != np.float32:
            raise UnsupportedOpError(f"cupy backend: GET_ROWS of a {a.dtype} tensor ({src.name!r})")
        st = a.strides                  # numpy order (ne3, ne2, ne1, ne0), bytes
        if src.ne[0] > 1 and st[3] != 4:
            raise UnsupportedOpError(f"cupy backend: GET_ROWS source {src.name!r} rows are not contiguous")
        return self._record(ck.get_rows, a, "f32", idx, out, ne0=src.ne[0], src_row_bytes=st[2],
                            src_batch_bytes=(st[1], st[0]))

    def _op_rms_norm(self, d: int, node: Tensor) -> list:
        return self._record(ck.rms_norm, self._a(d, node.src[0]), self._a(d, node), eps=node.params["eps"])

    def _op_norm(self, d: int, node: Tensor) -> list:
        return self._record(ck.norm, self._a(d, node.src[0]), self._a(d, node), eps=node.params["eps"])

    def _fused_norm(self, d: int, f: "_Fusion") -> list:
        return self._norm_times_weight(d, f.at, f.parts["norm"])

    def _norm_times_weight(self, d: int, node: Tensor, norm_node: Tensor) -> list:
        """MUL(RMS_NORM(x) or NORM(x), w) as one kernel writing the MUL's buffer."""
        fn = ck.rms_norm if norm_node.op is Op.RMS_NORM else ck.norm
        w = self._a(d, node.src[1]).reshape(-1)
        return self._record(fn, self._a(d, norm_node.src[0]), self._a(d, node), eps=norm_node.params["eps"],
                            weight=w)

    def _binary(self, op: str, d: int, node: Tensor) -> list:
        return self._record(ck.binary, op, self._a(d, node.src[0]), self._a(d, node.src[1]), self._a(d, node))

    def _op_add(self, d: int, node: Tensor) -> list:
        return self._binary("add", d, node)

    def _op_mul(self, d: int, node: Tensor) -> list:
        return self._binary("mul", d, node)

    def _op_div(self, d: int, node: Tensor) -> list:
        return self._binary("div", d, node)

    def _op_add_id(self, d: int, node: Tensor) -> list:
        a, b, ids = (self._a(d, s) for s in node.src)
        return self._record(ck.add_id, a[0], b[0, 0], ids[0, 0], self._a(d, node)[0])

    def _op_scale(self, d: int, node: Tensor) -> list:
        p = node.params
        return self._record(ck.scale, self._a(d, node.src[0]), self._a(d, node), p["s"], p["b"])

    def _op_unary(self, d: int, node: Tensor) -> list:
        op = {UnaryOp.SILU.value: "silu", UnaryOp.GELU_TANH.value: "gelu", UnaryOp.SIGMOID.value: "sigmoid",
              UnaryOp.SOFTPLUS.value: "softplus"}.get(node.params["unary"])
        if op is None:
            raise UnsupportedOpError(f"cupy backend: UNARY {node.params['unary']!r} has no kernel")
        return self._record(ck.unary, op, self._a(d, node.src[0]), self._a(d, node))

    def _op_glu(self, d: int, node: Tensor) -> list:
        fn = {GluOp.SWIGLU.value: ck.swiglu, GluOp.GEGLU_TANH.value: ck.geglu}.get(node.params["glu"])
        if fn is None:
            raise UnsupportedOpError(f"cupy backend: GLU {node.params['glu']!r} has no kernel")
        out = self._a(d, node)
        if len(node.src) == 2 and node.src[1] is not None:
            gate, up = self._a(d, node.src[0]), self._a(d, node.src[1])
        else:
            x = self._a(d, node.src[0])
            n = out.shape[-1]
            gate, up = (x[..., n:], x[..., :n]) if node.params.get("swapped") else (x[..., :n], x[..., n:])
        return self._record(fn, gate, up, out)

    def _op_soft_max(self, d: int, node: Tensor) -> list:
        mask = self._a(d, node.src[1]) if len(node.src) > 1 else None
        return self._record(ck.soft_max, self._a(d, node.src[0]), self._a(d, node), mask=mask,
                            scale=node.params["scale"])

    def _op_argsort_top_k(self, d: int, node: Tensor) -> list:
        return self._record(ck.top_k, self._a(d, node.src[0]), self._a(d, node), node.params["k"])

    def _op_sum_rows(self, d: int, node: Tensor) -> list:
        return self._record(ck.sum_rows, self._a(d, node.src[0]), self._a(d, node))

    def _op_cont(self, d: int, node: Tensor) -> list:
        return self._copy(d, self._a(d, node.src[0]), self._a(d, node))

    def _op_cpy(self, d: int, node: Tensor) -> list:
        return self._copy(d, self._a(d, node.src[0]), self._a(d, node))

    def _copy(self, d: int, src, dst) -> list:
        if tuple(src.shape) != tuple(dst.shape):
            if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size:
                raise UnsupportedOpError("cupy backend: copy between different shapes needs contiguous tensors")
            src, dst = src.reshape(-1), dst.reshape(-1)
        return self._record(ck.copy, src, dst)

    def _op_set_rows(self, d: int, node: Tensor, second=None) -> list:
        rows, ids, _ = node.src
        if rows.ne[2] != 1 or rows.ne[3] != 1 or ids.ne[1] != 1 or ids.ne[2] != 1:
            raise UnsupportedOpError(f"cupy backend: SET_ROWS {node.name!r} with batch dims is not supported")
        return self._record(ck.set_rows, self._a(d, rows)[0, 0], self._a(d, node)[0, 0], self._a(d, ids)[0, 0, 0],
                            second=second)

    def _op_rope(self, d: int, node: Tensor, second=None) -> list:
        x, pos = node.src[0], node.src[1]
        ff = node.src[2] if len(node.src) > 2 else None
        if x.ne[3] != 1:
            raise UnsupportedOpError(f"cupy backend: ROPE {node.name!r} with ne3 > 1")
        p = node.params
        xa, out = self._a(d, x)[0], self._a(d, node)[0]
        ffa = self._a(d, ff).reshape(-1) if ff is not None else None
        head_dim, n_head, n_tok = xa.shape[2], xa.shape[1], xa.shape[0]
        return self._record(ck.rope, xa, out, self._a(d, pos).reshape(-1), head_dim=head_dim, n_head=n_head,
                            n_tokens=n_tok, n_dims=p["n_dims"], freq_base=p["freq_base"],
                            freq_scale=p["freq_scale"], neox=p["mode"] == RopeMode.NEOX, freq_factors=ffa,
                            second=second)

    def _op_flash_attn_ext(self, d: int, node: Tensor) -> list:
        q, k, v = node.src[0], node.src[1], node.src[2]
        mask = node.src[3] if len(node.src) > 3 else None
        if len(node.src) > 4 and node.src[4] is not None:
            raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r} with attention sinks")
        qa, ka, va = self._a(d, q), self._a(d, k), self._a(d, v)
        loc = {t: self.plan.of(t).local[d] for t in (q, k, v)}
        D, T, H = loc[q].ne[0], loc[q].ne[1], loc[q].ne[2]
        n_kv, Hkv = loc[k].ne[1], loc[k].ne[2]
        if loc[v].ne[0] != D:
            raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r}: V head size differs from K's")
        qs = (loc[q].nb[2] // 4, loc[q].nb[1] // 4)
        gk, gv = _graph_itemsize(k), _graph_itemsize(v)
        ks = (loc[k].nb[2] // gk, loc[k].nb[1] // gk)
        vs = (loc[v].nb[2] // gv, loc[v].nb[1] // gv)
        ma = self._a(d, mask) if mask is not None else None
        kw = dict(n_head=H, n_head_kv=Hkv, head_dim=D, n_tokens=T, n_kv=n_kv, scale=node.params["scale"],
                  softcap=node.params.get("softcap", 0.0), causal=False, q_strides=qs, k_strides=ks,
                  v_strides=vs, mask=ma[0, 0] if ma is not None else None,
                  mask_stride=(self.plan.of(mask).local[d].nb[1] // 4) if mask is not None else None,
                  kv_len=self.kv_len_view(d, mask) if mask is not None else None)
        out = self._a(d, node)
        if T <= ck.ATTN_DECODE_MAX_TOKENS:
            n_splits, _ = ck.decode_splits(Hkv, H, T, n_kv)
            if n_splits > 1:
                kw["workspace"] = self._scratch_buffer(d, "attn", ck.attn_workspace_floats(H, D, T, n_splits),
                                                       np.float32)
            kw["n_splits"] = n_splits
        return self._record(ck.flash_attn, qa, ka, va, out, **kw)

    # ---- matmuls
    def _weight_operand(self, d: int, w: Tensor) -> tuple[Any, str, int, int]:
        """(data, weight type, row bytes, matrix bytes) of a weight for the matvec kernels."""
        a = self.arrays[d][w]
        if isinstance(a, RawWeight):
            return a.data, a.wtype, a.nb[1], a.nb[2]
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise UnsupportedOpError(f"cupy backend: weight {w.name!r} must be f32 or raw GGUF blocks")
        loc = self.plan.of(w).local[d]
        return a, "f32", loc.ne[0] * 4, loc.ne[0] * loc.ne[1] * 4

    def _rows(self, arr):
        """A 2-D (rows, ne0) view of an array whose leading dims collapse (else ValueError)."""
        ne0, n_rows, stride = ck._rows2d(arr)
        return self.rt.view(arr, 0, (n_rows, ne0), (stride * arr.dtype.itemsize, arr.dtype.itemsize),
                            arr.dtype) if arr.size else arr.reshape(n_rows, ne0)

    def _op_mul_mat(self, d: int, node: Tensor) -> list:
        w, x = node.src
        if not (w.flags & Flag.WEIGHT and w.view_src is None and w.ne[2] == 1 and w.ne[3] == 1):
            return self._matmul_general(d, node)
        data, wtype, row_bytes, _ = self._weight_operand(d, w)
        loc_w = self.plan.of(w).local[d]
        k, m = loc_w.ne[0], loc_w.ne[1]
        xr, yr = self._rows(self._a(d, x)), self._rows(self._a(d, node))
        n_tok = xr.shape[0]
        if n_tok <= ck.MATVEC_MAX_TOKENS or not self.rt.gemm_available():
            return self._record(ck.matvec, data, wtype, xr, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes)
        return self._gemm_steps(d, data, wtype, row_bytes, k, m, xr, yr)

    def _gemm_steps(self, d: int, data, wtype: str, row_bytes: int, k: int, m: int, xr, yr) -> list:
        """Prefill: dequantize the weight to f16 (or f32), convert x, one cuBLAS GEMM into y."""
        dt = np.float16 if self.backend.matmul_dtype == "f16" else np.float32
        n_tok = xr.shape[0]
        wbuf = self._scratch_buffer(d, f"gemm_w_{dt.__name__}", m * k, dt)
        xbuf = self._scratch_buffer(d, f"gemm_x_{dt.__name__}", n_tok * k, dt)
        w2 = wbuf[: m * k].reshape(m, k)
        x2 = xbuf[: n_tok * k].reshape(n_tok, k)
        steps = self._record(ck.dequantize, data, wtype, w2, ne0=k, n_rows=m, src_row_bytes=row_bytes)
        steps += self._record(ck.copy, xr, x2)
        ldy = yr.strides[0] // 4 if yr.shape[0] > 1 else m
        args = (m, n_tok, k, ck.device_ptr(w2), ck.device_ptr(x2), ck.device_ptr(yr), ldy,
                self.backend.matmul_dtype, self.devices[d].stream, self.devices[d].gpu)
        keep = (wbuf, xbuf, yr)
        steps.append(_HostStep(lambda keep=keep: self.rt.gemm(*args), "cuBLAS GEMM"))
        return steps

    def _matmul_general(self, d: int, node: Tensor) -> list:
        """MUL_MAT of two activations (or a batched weight): a cupy matmul, eager only."""
        a, b, out = self._a(d, node.src[0]), self._a(d, node.src[1]), self._a(d, node)
        if isinstance(a, RawWeight) or a.dtype != np.float32 or b.dtype != np.float32:
            raise UnsupportedOpError(f"cupy backend: MUL_MAT {node.name!r} of these operand types")
        r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
        rt = self.rt

        def run() -> None:
            bb = b.reshape(a.shape[0], r3, a.shape[1], r2, b.shape[2], b.shape[3])
            aa = a[:, None, :, None].swapaxes(-1, -2)
            out[...] = rt.matmul(bb, aa).reshape(out.shape)
        return [_HostStep(run, "batched matmul")]

    def _norm_args(self, d: int, norm) -> dict:
        """matvec keyword arguments folding MUL(RMS_NORM(x0), w) into the prologue."""
        if norm is None:
            return {}
        mul, rms = norm
        return {"norm_weight": self._a(d, mul.src[1]).reshape(-1), "eps": rms.params["eps"]}

    def _norm_input(self, d: int, x: Tensor, norm):
        return self._rows(self._a(d, norm[1].src[0] if norm is not None else x)).reshape(-1)

    def _fused_matvec_add(self, d: int, f: "_Fusion") -> list:
        node, mm, other = f.at, f.parts["mm"], f.parts["other"]
        data, wtype, row_bytes, _ = self._weight_operand(d, mm.src[0])
        loc_w = self.plan.of(mm.src[0]).local[d]
        xr, yr = self._rows(self._a(d, mm.src[1])), self._rows(self._a(d, node))
        oa = self._rows(self._a(d, other))
        broadcast = other.ne != mm.ne
        add_stride = 0 if broadcast else (oa.strides[0] // 4 if oa.shape[0] > 1 else loc_w.ne[1])
        return self._record(ck.matvec, data, wtype, xr, yr, ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                            w_row_bytes=row_bytes, add=oa, add_stride=add_stride)

    def _fused_matvec_glu(self, d: int, f: "_Fusion") -> list:
        node, gate, up, norm = f.at, f.parts["gate"], f.parts["up"], f.parts.get("norm")
        dg, wtype, row_bytes, _ = self._weight_operand(d, gate.src[0])
        du, _, _, _ = self._weight_operand(d, up.src[0])
        loc_w = self.plan.of(gate.src[0]).local[d]
        act = "swiglu" if node.params["glu"] == GluOp.SWIGLU.value else "geglu"
        return self._record(ck.matvec_glu, dg, du, wtype, self._norm_input(d, gate.src[1], norm),
                            self._a(d, node).reshape(-1), ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                            w_row_bytes=row_bytes, act=act, **self._norm_args(d, norm))

    def _fused_matvec_multi(self, d: int, f: "_Fusion") -> list:
        members, norm = f.parts["members"], f.parts["norm"]
        jobs, wtype, ne0 = [], None, None
        for mm in members:
            data, wtype, row_bytes, _ = self._weight_operand(d, mm.src[0])
            loc_w = self.plan.of(mm.src[0]).local[d]
            ne0 = loc_w.ne[0]
            jobs.append((data, self._a(d, mm).reshape(-1), loc_w.ne[1], row_bytes))
        return self._record(ck.matvec_multi, jobs, wtype, self._norm_input(d, members[0].src[1], norm),
                            ne0=ne0, **self._norm_args(d, norm))

    def _fused_rope_pair(self, d: int, f: "_Fusion") -> list:
        first, second = f.parts["first"], f.at
        x2 = self._a(d, second.src[0])[0]
        return self._op_rope(d, first, second=(x2, self._a(d, second)[0], x2.shape[1], None, None))

    def _fused_set_rows_pair(self, d: int, f: "_Fusion") -> list:
        first, second = f.parts["first"], f.at
        return self._op_set_rows(d, first, second=(self._a(d, second.src[0])[0, 0], self._a(d, second)[0, 0]))

    def _op_mul_mat_id(self, d: int, node: Tensor) -> list:
        w, x, ids = node.src
        data, wtype, row_bytes, expert_bytes = self._weight_operand(d, w)
        loc_w = self.plan.of(w).local[d]
        return self._record(ck.matvec_id, data, wtype, self._a(d, x)[0], self._a(d, node)[0],
                            self._a(d, ids)[0, 0], ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                            expert_bytes=expert_bytes, w_row_bytes=row_bytes)

    # ---------------------------------------------------------------- all-reduce
    def _build_reductions(self) -> dict[int, _Reduction]:
        out: dict[int, _Reduction] = {}
        if self.n == 1:
            return out
        graph = self.plan.graph
        for k, sub in enumerate(self.plan.subgraphs):
            red = sub.reduction
            if red is None:
                continue
            node = graph.nodes[red.node]
            if node.type != GGMLType.F32:
                raise UnsupportedOpError(f"cupy backend: all-reduce of a {node.type.name} tensor ({node.name!r})")
            bufs = []
            for d in range(self.n):
                a = self.arrays[d][node]
                if not a.flags.c_contiguous:
                    raise UnsupportedOpError(f"cupy backend: reduced tensor {node.name!r} is not contiguous")
                bufs.append(a.reshape(-1))
            active = list(red.active) if red.active is not None else list(self.plan.of(node).compute)
            n_el = int(bufs[0].size)
            wire = wire_dtype(self.n, n_el, self.backend.wire, self.backend.wire_thresholds)
            r = _Reduction(k, node, bufs, active, wire, n_el)
            r.ops = self._butterfly_ops(r)
            if self.backend.comms:
                r.nccl = self._nccl_ops(r)
            out[k] = r
        return out

    def _wire_buffers(self, r: _Reduction) -> tuple[list, list]:
        """(value each device sends, scratch each device receives into) for a reduction."""
        send, recv = [], []
        for d in range(self.n):
            if r.wire == "bf16":
                send.append(self._scratch_buffer(d, "wire", r.n_elements, np.uint16)[: r.n_elements])
                recv.append(self._scratch_buffer(d, "recv_bf16", r.n_elements, np.uint16)[: r.n_elements])
            else:
                send.append(r.bufs[d])
                recv.append(self._scratch_buffer(d, "recv_f32", r.n_elements, np.float32)[: r.n_elements])
        return send, recv

    def _prologue(self, r: _Reduction, d: int, send) -> list:
        """Zero an inactive device's value (a fill: its buffer may hold garbage) and put the
        value into the wire format."""
        steps: list = []
        dev = self.devices[d]
        if not r.active[d]:
            steps.append(_Memset(self.rt, ck.device_ptr(r.bufs[d]), r.n_elements * 4, dev.stream))
        if r.wire == "bf16":
            steps += self._record(ck.f32_to_bf16, r.bufs[d], send[d])
        return steps

    def _epilogue(self, r: _Reduction, d: int, send) -> list:
        return self._record(ck.bf16_to_f32, send[d], r.bufs[d]) if r.wire == "bf16" else []

    def _butterfly_ops(self, r: _Reduction) -> list[tuple[int, list]]:
        """The butterfly as device ops [(device, steps)], ordered so that a device reads its
        partner's value only after the partner recorded it ("ready"), and changes its own
        value only after every reader finished ("read_done")."""
        rt, devs = self.rt, self.devices
        send, recv = self._wire_buffers(r)
        nbytes = r.n_elements * np.dtype(send[0].dtype).itemsize
        ops: list[tuple[int, list]] = []
        for d, dev in enumerate(devs):
            with rt.device(dev.gpu):
                ops.append((d, self._prologue(r, d, send) + [_Record(rt, dev.stream, dev.ready)]))
        for rnd in butterfly_schedule(self.n):
            for t in rnd:
                dst, src = devs[t.dst], devs[t.src]
                target = recv[t.dst] if t.op == "add" else send[t.dst]
                ops.append((t.dst, [_Wait(rt, dst.stream, src.ready),
                                    _Memcpy(rt, ck.device_ptr(target), ck.device_ptr(send[t.src]), nbytes,
                                            dst.stream),
                                    _Record(rt, dst.stream, dst.read_done)]))
            for t in rnd:
                ops.append((t.src, [_Wait(rt, devs[t.src].stream, devs[t.dst].read_done)]))
            for t in rnd:
                dev = devs[t.dst]
                steps: list = []
                if t.op == "add":
                    with rt.device(dev.gpu):
                        steps += self._record(ck.add_inplace, send[t.dst], recv[t.dst])
                steps.append(_Record(rt, dev.stream, dev.ready))
                ops.append((t.dst, steps))
        for d, dev in enumerate(devs):
            with rt.device(dev.gpu):
                ops.append((d, self._epilogue(r, d, send)))
        return ops

    def _nccl_ops(self, r: _Reduction) -> list:
        send, _ = self._wire_buffers(r)
        pre, post = [], []
        for d, dev in enumerate(self.devices):
            with self.rt.device(dev.gpu):
                pre.append((d, self._prologue(r, d, send)))
                post.append((d, self._epilogue(r, d, send)))
        calls = [(self.backend.comms[d], ck.device_ptr(send[d]), r.n_elements, r.wire, dev.stream)
                 for d, dev in enumerate(self.devices)]
        return pre + [(None, calls)] + post

    def _run_ops(self, ops) -> None:
        for d, steps in ops:
            if not steps:
                continue
            with self.devices[d].ctx:
                for s in steps:
                    s()

    def _allreduce(self, k: int) -> None:
        r = self.reductions.get(k)
        if r is None:
            return
        backend = self.backend
        if r.nccl and backend.comms:
            try:
                for d, item in r.nccl:
                    if d is None:
                        self.rt.nccl_allreduce(item)
                    elif item:
                        with self.devices[d].ctx:
                            for s in item:
                                s()
                return
            except Exception as e:  # noqa: BLE001 - per-call fallback to the butterfly
                if self._capturing:       # inside a whole-step capture: abort it (segments are next)
                    raise
                backend.nccl_failures += 1
                if backend.nccl_failures >= 3:
                    warnings.warn(f"NCCL failed {backend.nccl_failures} times ({e}); using the copy-and-add "
                                  "all-reduce from now on", stacklevel=2)
                    backend.comms = None
                # the prologue may have run: bufs are zero-filled/converted again by the butterfly
        self._run_ops(r.ops)

    # ---------------------------------------------------------------- running
    def set_input(self, t: Tensor, value: np.ndarray) -> None:
        """Write a per-step input into the pinned host block (copied to the GPUs by run)."""
        if self._inputs_pending:
            for gpu, d in self._leads.items():
                self.rt.host_wait(self.devices[d].inputs_copied)
            self._inputs_pending = False
        view = self._host_views.get(t)
        if view is None:
            raise KeyError(f"{t.name!r} is not an input of this plan")
        np.copyto(view, np.asarray(value).reshape(view.shape), casting="unsafe")
        kv = self._host_views.get(("kv_len", t))
        if kv is not None:
            kv[0] = _attended_length(view)

    def _copy_inputs(self) -> None:
        for gpu, d in self._leads.items():
            dev = self.devices[d]
            with dev.ctx:
                self.rt.memcpy_h2d(ck.device_ptr(self._dev_in[gpu]), self._host_in, self._in_bytes, dev.stream)
                self.rt.record(dev.stream, dev.inputs_copied)
        self._inputs_pending = True

    def _fork(self) -> None:
        """Devices sharing a GPU with its lead wait for the lead's input copy."""
        for dev in self.devices:
            lead = self.devices[self._leads[dev.gpu]]
            if lead is not dev:
                self.rt.record(lead.stream, lead.fork)
                self.rt.wait(dev.stream, lead.fork)

    def _join(self) -> None:
        """The lead of each GPU waits for the other devices on it (end of the step)."""
        for dev in self.devices:
            lead = self.devices[self._leads[dev.gpu]]
            if lead is not dev:
                self.rt.record(dev.stream, dev.done)
                self.rt.wait(lead.stream, dev.done)

    def _run_subgraph(self, k: int) -> None:
        for d, dev in enumerate(self.devices):
            steps = self.steps[k][d]
            if steps:
                with dev.ctx:
                    for s in steps:
                        s()

    def _body(self) -> None:
        self._fork()
        for k in range(len(self.plan.subgraphs)):
            self._run_subgraph(k)
            if self.n > 1:
                self._allreduce(k)
        self._join()

    def run(self, inputs: dict[Tensor, np.ndarray] | None = None) -> None:
        """One step: inputs to the devices, then the graph (replayed when captured)."""
        for t, v in (inputs or {}).items():
            self.set_input(t, v)
        self._copy_inputs()
        if self._graph is None and self._should_capture():
            self._capture()
        if self._graph is not None:
            self._replay()
        else:
            self._body()
        self.runs += 1

    def _should_capture(self) -> bool:
        return self.backend.cuda_graphs and self.capturable and self.runs >= 1

    def _single_gpu(self) -> bool:
        return len(self._leads) == 1

    def _primary_and_others(self) -> tuple[_Device, list[_Device]]:
        """The lead device of the first GPU (whose stream captures and launches a whole-step
        graph) and the lead devices of the other GPUs."""
        leads = [self.devices[d] for d in self._leads.values()]
        return leads[0], leads[1:]

    def _capture(self) -> None:
        """Capture the step as one graph on the first GPU's lead stream: every device of every
        GPU joins it through events (virtual devices, the butterfly and NCCL calls included).
        On several GPUs, when that fails or `multi_gpu_graphs="segments"`, per (subgraph,
        device) segments with the collectives eager between them; when that fails too, eager."""
        backend = self.backend
        if self._single_gpu() or backend.multi_gpu_graphs == "whole":
            try:
                self._graph, self.graph_mode = self._capture_whole(), "whole"
                return
            except Exception as e:  # noqa: BLE001 - a failed capture leaves the graph mode below
                self._graph = None
                if self._single_gpu():
                    warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly",
                                  stacklevel=3)
                    backend.cuda_graphs = False
                    return
                warnings.warn(f"capturing one CUDA graph across {len(self._leads)} GPUs failed "
                              f"({type(e).__name__}: {e}); using per-subgraph graph segments", stacklevel=3)
                backend.multi_gpu_graphs = "segments"
        try:
            self._graph, self.graph_mode = self._capture_segments(), "segments"
        except Exception as e:  # noqa: BLE001 - a failed capture leaves eager mode
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly", stacklevel=3)
            backend.cuda_graphs = False
            self._graph = None

    def _capture_whole(self):
        rt = self.rt
        primary, others = self._primary_and_others()
        with primary.ctx:
            rt.begin_capture(primary.stream)
            self._capturing = True
            try:
                rt.record(primary.stream, primary.step_fork)
                for o in others:                      # the other GPUs join the capture
                    with o.ctx:
                        rt.wait(o.stream, primary.step_fork)
                self._body()
                for o in others:                      # ... and are joined back before it ends
                    with o.ctx:
                        rt.record(o.stream, o.step_done)
                    rt.wait(primary.stream, o.step_done)
            finally:
                self._capturing = False
                graph = rt.end_capture(primary.stream)
        return graph

    def _capture_segments(self) -> dict:
        rt = self.rt
        segs = {}
        for k in range(len(self.plan.subgraphs)):
            for d, dev in enumerate(self.devices):
                if not self.steps[k][d]:
                    continue
                with dev.ctx:
                    rt.begin_capture(dev.stream)
                    try:
                        for s in self.steps[k][d]:
                            s()
                    finally:
                        segs[(k, d)] = rt.end_capture(dev.stream)
        return segs

    def _replay(self) -> None:
        rt = self.rt
        if self.graph_mode == "whole":
            primary, others = self._primary_and_others()
            with primary.ctx:
                for o in others:                      # the other GPUs' input copies come first
                    rt.wait(primary.stream, o.inputs_copied)
                rt.launch_graph(self._graph, primary.stream)
                if others:                            # their next input copy waits for this step
                    rt.record(primary.stream, primary.step_done)
            for o in others:
                with o.ctx:
                    rt.wait(o.stream, primary.step_done)
            return
        self._fork()
        for k in range(len(self.plan.subgraphs)):
            for d, dev in enumerate(self.devices):
                g = self._graph.get((k, d))
                if g is not None:
                    with dev.ctx:
                        rt.launch_graph(g, dev.stream)
            if self.n > 1:
                self._allreduce(k)
        self._join()

    def synchronize(self) -> None:
        self.backend.synchronize()

    def read(self, t: Tensor) -> np.ndarray:
        """The full value of `t` (gathered from slices; a PARTIAL value is summed)."""
        self.synchronize()
        parts = []
        for d, dev in enumerate(self.devices):
            a = self.arrays[d][t]
            if isinstance(a, RawWeight):
                raise UnsupportedOpError(f"cupy backend: reading the quantized weight {t.name!r}")
            with self.rt.device(dev.gpu):
                h = self.rt.download(a)
            parts.append(_to_float(h, a.dtype, t))
        if self.n == 1:
            return parts[0].reshape(tuple(reversed(t.ne)))
        from metatp.backends.slicing import gather_array

        return gather_array(parts, t, self.plan.of(t))


def _to_float(h: np.ndarray, dtype, t: Tensor) -> np.ndarray:
    """Host copy in the graph's type (an f16/bf16-stored F32 tensor comes back as f32)."""
    if np.dtype(dtype) == np.uint16:
        return (h.astype(np.uint32) << 16).view(np.float32)
    if t.type == GGMLType.F32 and h.dtype != np.float32:
        return h.astype(np.float32)
    return h


def _contig_strides(shape, dtype) -> tuple[int, ...]:
    isz = np.dtype(dtype).itemsize
    out, acc = [], isz
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def _attended_length(mask: np.ndarray) -> int:
    """1 + the last KV column some query can see (0 if none): the kernels skip the rest."""
    m = mask.reshape(-1, mask.shape[-1])
    cols = np.flatnonzero((m > -np.inf).any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 0


# ---- device ops (small callables so a step list is data)
class _Memset:
    def __init__(self, rt, ptr: int, nbytes: int, stream) -> None:
        self.rt, self.ptr, self.nbytes, self.stream = rt, ptr, nbytes, stream

    def __call__(self) -> None:
        if self.nbytes:
            self.rt.memset(self.ptr, self.nbytes, self.stream)


class _Memcpy:
    def __init__(self, rt, dst: int, src: int, nbytes: int, stream) -> None:
        self.rt, self.dst, self.src, self.nbytes, self.stream = rt, dst, src, nbytes, stream

    def __call__(self) -> None:
        if self.nbytes:
            self.rt.memcpy(self.dst, self.src, self.nbytes, self.stream)


class _Record:
    def __init__(self, rt, stream, event) -> None:
        self.rt, self.stream, self.event = rt, stream, event

    def __call__(self) -> None:
        self.rt.record(self.stream, self.event)


class _Wait:
    def __init__(self, rt, stream, event) -> None:
        self.rt, self.stream, self.event = rt, stream, event

    def __call__(self) -> None:
        self.rt.wait(self.stream, self.event)
