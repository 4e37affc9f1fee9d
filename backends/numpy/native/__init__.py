"""The numpy backend's compiled kernels (`csrc/cpu_kernels.c`) for few-token steps (decode).

numpy has no BLAS for int8 or f16, so the only way it can read a weight in a decode step is as
float32 — 4 bytes a weight, which makes decode bound by memory bandwidth. `qmatmul` reads the
weights as 8- or 4-bit codes with a float32 scale/offset per block (see `affine_quant`) and keeps
activations float32. `rope` and `attention` replace a dozen small numpy calls each (their fixed
cost, not their arithmetic, is what a one-token step pays). The library is built on first use
with the machine's C compiler (-O3 -march=native, OpenMP when available) and cached; where that
is impossible (no compiler, METATP_CPU_KERNELS=0) `available()` is False and the backend keeps
its numpy path, which is also the reference every kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import warnings
from importlib import resources
from typing import Callable

import numpy as np

from metatp.backends.numpy.codes import AffineWeight
from metatp.backends.host_build import build_shared_library, host_cache_dir
from metatp.ir.tensor import GGMLType, row_bytes

__all__ = ["available", "default_threads", "kernel_info", "isa", "prepare_qmatmul", "qmatmul", "prepare_rope",
           "q8_kind", "prepare_q8_matmul", "q8_matmul", "q8_quantize", "q8_isums", "Q8_0", "Q8_1", "Q8_K",
           "prepare_attention", "prepare_glu", "prepare_allreduce", "is_qmatmul", "group_qmatmul",
           "prepare_dequant_matmul", "prepare_set_rows", "DEQUANT_CHUNK", "batchable", "batch", "ATTN_CHUNK",
           "MAX_ROWS", "KV_TYPES", "kv_quantize", "kv_dequantize"]

# The decode attention cuts the KV length into chunks at absolute multiples of ATTN_CHUNK cells
# (ATTN_CHUNK in cpu_kernels.c): a query row's result depends only on its visible cells and their
# positions modulo ATTN_CHUNK, so a sequence whose first cell is a multiple of it gets the same
# bits alone or batched with others (the engine places sequences so).
ATTN_CHUNK = 128

# The most rows (tokens of one step) the few-token kernels are used for: a step of 64 sequences'
# decode tokens; longer prompt chunks go to float32 BLAS (faster there, but its sums depend on the
# batch shape). numpy_kernels dispatches on it.
MAX_ROWS = 64

# KV-cache types the kernels store and read, as GGML type ids (f32, f16, q4_0, q4_1, q5_0, q5_1,
# q8_0, bf16): T_* in cpu_kernels.c.
KV_TYPES = (0, 1, 2, 3, 6, 7, 8, 30)

_FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-w"),
    ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=gnu11", "-w"),   # no OpenMP runtime
    ("-O3", "-fPIC", "-shared", "-std=gnu11", "-w"),                        # compiler without -march=native
)
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _struct(name: str, fields: str) -> type[ctypes.Structure]:
    """A ctypes mirror of one argument struct in cpu_kernels.c ("name:type ..."; i=int64,
    f=float, p=pointer), fields in the C order."""
    kinds = {"i": _I64, "f": _F32, "p": _PTR}
    return type(name, (ctypes.Structure,), {"_fields_": [(f.split(":")[0], kinds[f.split(":")[1]])
                                                         for f in fields.split()]})


_ARGS = {
    "metatp_qmatmul": _struct("QMatmulGroup", "n:i items:p nthreads:i"),
    "metatp_rope": _struct("RopeArgs", "T:i H:i D:i n_dims:i neox:i x:p x_st:i x_sh:i out:p o_st:i o_sh:i cs:p"),
    "metatp_attention": _struct("AttentionArgs", "T:i H:i Hkv:i D:i Dv:i n_kv:i q:p q_sh:i q_st:i k:p k_sh:i "
                                                 "k_sj:i k_type:i v:p v_sh:i v_sj:i v_type:i mask:p m_st:i scale:f "
                                                 "softcap:f sinks:p out:p o_st:i o_sh:i scratch:p max_chunks:i "
                                                 "nthreads:i"),
    "metatp_glu": _struct("GluArgs", "T:i n:i act:i a:p a_st:i b:p b_st:i out:p o_st:i"),
    "metatp_rms_norm": _struct("RmsNormArgs", "T:i n:i x:p x_st:i w:p out:p o_st:i eps:f"),
    "metatp_add": _struct("AddArgs", "T:i n:i a:p a_st:i b:p b_st:i out:p o_st:i"),
    "metatp_allreduce": _struct("AllreduceArgs", "n:i count:i bufs:p active:p"),
    "metatp_set_rows": _struct("SetRowsArgs", "T:i n:i src:p src_st:i dst:p dst_st:i dst_rows:i ids:p type:i"),
    "metatp_kv_convert": _struct("KvConvertArgs", "type:i rows:i n:i x:p q:p out:p"),
    "metatp_q8_matmul": _struct("Q8MatmulGroup", "n:i items:p nthreads:i"),
    "metatp_q8_quantize": _struct("Q8QuantArgs", "kind:i ntok:i k:i x:p ldx:i q:p d:p s:p isum:p"),
    "metatp_q8_isums": _struct("Q8IsumArgs", "w:p xq:p out:p"),
    "metatp_round_half": _struct("HalfArgs", "n:i x:p out:p"),
    "metatp_batch": _struct("BatchArgs", "n:i fns:p args:p failed:i"),
    "metatp_dequant": _struct("DequantArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p out:p ldo:i "
                                             "nthreads:i group:i half_scales:i"),
}


_QMatmulArgs = _struct("QMatmulArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p x:p ldx:i ntok:i y:p "
                                      "ldy:i")
_Q8MatmulArgs = _struct("Q8MatmulArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p x:p ldx:i ntok:i y:p "
                                        "ldy:i kind:i group:i half_scales:i")


class _Call:
    """One prepared kernel call: the argument struct is built once; calling costs one ctypes
    call with one pointer. Holds the arrays whose addresses the struct contains."""

    def __init__(self, name: str, keep: tuple, **fields) -> None:
        lib = _library()[0]
        if lib is None:
            raise RuntimeError(f"CPU kernels unavailable: {kernel_info()}")
        self.name = name
        self.args = _ARGS[name](**fields)
        self.keep = keep
        self._fn = functools.partial(getattr(lib, name), ctypes.addressof(self.args))
        self.entry = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value    # for batches

    def __call__(self) -> None:
        rc = self._fn()
        if rc:
            raise RuntimeError(f"{self.name} rejected its arguments (code {rc})")


def _cpu_signature() -> str:
    """Part of the cache key: a library built with -march=native runs only on a like CPU."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    sig += line
    except OSError:
        pass
    return sig


def build_library(flags: tuple[str, ...], cc: str | None = None) -> ctypes.CDLL:
    """Build (or take from the cache) `csrc/cpu_kernels.c` with these compiler flags and load it.
    Raises RuntimeError/OSError when that fails. (Tests also build other ISA paths with it.)"""

    cc = cc or os.environ.get("CC", "cc")
    source = resources.files("metatp.backends").joinpath("csrc/cpu_kernels.c").read_text(encoding="utf-8")
    path = build_shared_library("cpu_kernels", source, ".c", cc, flags,
                                host_cache_dir("METATP_KERNEL_CACHE", "metatp-kernels"), _cpu_signature(),
                                libs=("-lm",))
    lib = ctypes.CDLL(str(path))
    for name in _ARGS:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p]
    lib.metatp_isa.restype = ctypes.c_char_p
    lib.metatp_isa.argtypes = []
    lib.metatp_attn_chunk.restype = ctypes.c_int
    lib.metatp_attn_chunk.argtypes = []
    if lib.metatp_attn_chunk() != ATTN_CHUNK:
        raise RuntimeError(f"cpu_kernels.c has ATTN_CHUNK {lib.metatp_attn_chunk()}, cpu_kernels.py {ATTN_CHUNK}")
    return lib


def library_isa(lib: ctypes.CDLL) -> str:
    """Which integer dot-product path a build compiled: avx512-vnni, avx-vnni, avx2 or portable."""
    return lib.metatp_isa().decode()


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, a line saying which build or why none)."""
    if os.environ.get("METATP_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "off (METATP_CPU_KERNELS=0)"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None, f"off (no C compiler {cc!r} on PATH)"
    errors = []
    for flags in _FLAG_SETS:
        try:
            lib = build_library(flags, cc)
        except (RuntimeError, OSError) as e:
            errors.append(str(e).splitlines()[0])
            continue
        shown = " ".join(f for f in flags if f.startswith(("-march", "-fopenmp")))
        info = f"cpu_kernels ({cc} {shown}; q8 {library_isa(lib)})".replace(" ;", ";")
        return lib, info + ("" if "-fopenmp" in flags else ", single-threaded")
    warnings.warn("metatp: the CPU kernels could not be built; decode uses numpy and float32 BLAS "
                  f"(slower): {errors[-1] if errors else 'unknown error'}", RuntimeWarning, stacklevel=2)
    return None, "off (build failed)"


def available() -> bool:
    """True when the compiled kernel can be used on this machine."""
    return _library()[0] is not None


def kernel_info() -> str:
    """One line for reports: which build is in use, or why none."""
    return _library()[1]


def isa() -> str | None:
    """The integer dot-product path of the build in use (None without one)."""
    lib = _library()[0]
    return None if lib is None else library_isa(lib)


# What MPI launchers tell each process about the ranks sharing its machine (MPICH/hydra, Open MPI,
# MVAPICH): read without importing mpi4py.
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def _local_ranks() -> int:
    for var in _LOCAL_SIZE_VARS:
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


def default_threads() -> int:
    """Threads for the kernel: METATP_NUM_THREADS, else OMP/OPENBLAS_NUM_THREADS, else the CPUs
    this process may use (the same count numpy's BLAS takes) shared among the MPI ranks on this
    machine (N ranks of 2 threads each on 2 cores would spin against each other)."""
    for var in ("METATP_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        cpus = max(1, os.cpu_count() or 1)
    return max(1, cpus // _local_ranks())


def _code_format(aw: AffineWeight) -> dict:
    """The struct fields that say how codes are stored (bits 16: bias 1 means bfloat16)."""
    return {"bits": aw.bits, "bias": int(aw.bf16) if aw.bits == 16 else aw.bias}


def _half_scales(aw: AffineWeight) -> int:
    """1 when the weight keeps its scales (and offsets) as IEEE halves (row-group layout only)."""
    return int(aw.scale.dtype == np.float16)


def _check(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray) -> None:
    rows, k = aw.rows, aw.k
    if x2.ndim != 2 or x2.shape[1] != k or x2.dtype != np.float32 or (k > 1 and x2.strides[1] != 4):
        raise ValueError(f"qmatmul: x must be float32 (n, {k}) with contiguous rows, got {x2.dtype} {x2.shape}")
    if y2.shape != (x2.shape[0], rows) or y2.dtype != np.float32 or (rows > 1 and y2.strides[1] != 4):
        raise ValueError(f"qmatmul: out must be float32 ({x2.shape[0]}, {rows}) with contiguous rows, got "
                         f"{y2.dtype} {y2.shape}")
    if not (aw.q.flags.c_contiguous and aw.scale.flags.c_contiguous
            and (aw.offset is None or aw.offset.flags.c_contiguous)):
        raise ValueError("qmatmul: weight arrays must be C-contiguous")


def prepare_qmatmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, nthreads: int | None = None
                    ) -> Callable[[], None]:
    """A closure computing y2 = x2 @ dequantize(aw).T in place, for these fixed arrays (their
    addresses are taken once, so a call costs one ctypes call). x2: (n, K), y2: (n, rows)."""
    _check(aw, x2, y2)
    if aw.group != 1:
        raise ValueError("qmatmul: the float kernel reads row-major codes; this weight is in the row-group layout "
                         "(only the integer kernel, prepare_q8_matmul, reads that)")
    if x2.shape[0] == 0 or aw.rows == 0:
        return lambda: None
    rows, k = aw.rows, aw.k
    item = _QMatmulArgs(rows=rows, k=k, block=aw.block, **_code_format(aw), q=aw.q.ctypes.data,
                        scale=aw.scale.ctypes.data,
                        offset=None if aw.offset is None else aw.offset.ctypes.data, x=x2.ctypes.data,
                        ldx=x2.strides[0] // 4, ntok=x2.shape[0], y=y2.ctypes.data, ldy=y2.strides[0] // 4)
    return _qmatmul_group([(item, (aw, x2, y2))], nthreads or default_threads())


def _qmatmul_group(items: list, nthreads: int) -> "_Call":
    ptrs = (ctypes.c_void_p * len(items))(*[ctypes.addressof(it) for it, _ in items])
    call = _Call("metatp_qmatmul", (items, ptrs), n=len(items), items=ctypes.addressof(ptrs), nthreads=nthreads)
    call.items = items
    return call


_MATMULS = ("metatp_qmatmul", "metatp_q8_matmul")


def is_qmatmul(f) -> bool:
    """Is `f` a closure made by `prepare_qmatmul` or `prepare_q8_matmul` (so `group_qmatmul`
    can merge it)?"""
    return isinstance(f, _Call) and f.name in _MATMULS


def group_qmatmul(calls: list) -> Callable[[], None]:
    """One call doing the work of several `prepare_qmatmul` (or several `prepare_q8_matmul`)
    closures (independent products): one parallel region instead of one each. Results are
    bit-identical to calling them in turn."""
    items = [it for c in calls for it in c.items]
    if len(calls) == 1 or len(items) > _MAX_GROUP_ITEMS or len({c.name for c in calls}) > 1:
        return calls[0] if len(calls) == 1 else _run_in_turn(calls)
    if calls[0].name == "metatp_q8_matmul":
        return _q8_group(items, int(calls[0].args.nthreads))
    return _qmatmul_group(items, int(calls[0].args.nthreads))


_MAX_GROUP_ITEMS = 64      # MAX_ITEMS in cpu_kernels.c


def batchable(f) -> bool:
    """Can `f` join a `batch`: a prepared kernel call, or a closure around one that says so with
    `.kernel` (the call) and `.prepare` (Python work to do first, or None)."""
    return isinstance(f, _Call) or isinstance(getattr(f, "kernel", None), _Call)


def batch(closures: list) -> Callable[[], None]:
    """One closure doing the work of several `batchable` ones, in their order: first every
    `.prepare` (they only read inputs and set arguments: per-step tables, the visible cache
    length), then all the kernels in one ctypes call. Bit-identical to calling them in turn."""
    if len(closures) == 1:
        return closures[0]
    closures = list(closures)        # the caller may reuse its list
    calls = [f if isinstance(f, _Call) else f.kernel for f in closures]
    prepares = []       # in order, each once: closures may share one (a per-step table, a visible length)
    for f in closures:
        prep = None if isinstance(f, _Call) else getattr(f, "prepare", None)
        if prep is not None and not any(prep == p for p in prepares):     # == : bound methods of one object
            prepares.append(prep)
    fns = (ctypes.c_void_p * len(calls))(*[c.entry for c in calls])
    args = (ctypes.c_void_p * len(calls))(*[ctypes.addressof(c.args) for c in calls])
    call = _Call("metatp_batch", (calls, fns, args), n=len(calls), fns=ctypes.addressof(fns),
                 args=ctypes.addressof(args), failed=0)
    fn = call._fn

    def run() -> None:
        for prep in prepares:
            prep()
        if fn():
            closures[int(call.args.failed)]()      # the failing one again, for its own error
            raise RuntimeError(f"{calls[int(call.args.failed)].name} failed inside a batch")
    run.keep = (call, closures)
    return run


def _run_in_turn(calls: list) -> Callable[[], None]:
    def run() -> None:
        for c in calls:
            c()
    return run


def qmatmul(x: np.ndarray, aw: AffineWeight, out: np.ndarray | None = None, nthreads: int | None = None
            ) -> np.ndarray:
    """x (n, K) float32 @ dequantize(aw).T -> (n, rows): the one-off form of `prepare_qmatmul`."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, aw.k)
    y2 = np.empty((x2.shape[0], aw.rows), dtype=np.float32) if out is None else out
    prepare_qmatmul(aw, x2, y2, nthreads)()
    return y2


# ------------------------------------------------------------------ Q8 activations (numerics="llamacpp")
Q8_0, Q8_1, Q8_K = 0, 1, 2       # how activations are rounded: llama.cpp's vec_dot_type of the weight
_Q8_KIND_OF_TYPE = {"Q4_0": Q8_0, "Q5_0": Q8_0, "Q8_0": Q8_0, "Q4_1": Q8_1, "Q5_1": Q8_1,
                    "Q2_K": Q8_K, "Q3_K": Q8_K, "Q4_K": Q8_K, "Q5_K": Q8_K, "Q6_K": Q8_K}


def q8_kind(aw: AffineWeight) -> int | None:
    """How llama.cpp's CPU backend rounds the activations multiplied with this weight (Q8_0, Q8_1
    or Q8_K blocks), or None where the integer kernel does not take it (half-float codes, a
    K-quant whose rows are not whole 256-blocks, codes of unknown origin)."""
    if aw.bits == 16 or aw.ggml_type is None:
        return None
    kind = _Q8_KIND_OF_TYPE.get(aw.ggml_type.name)
    if kind is None or aw.k % (256 if kind == Q8_K else 32):
        return None
    return kind


def _q8_group(items: list, nthreads: int) -> "_Call":
    ptrs = (ctypes.c_void_p * len(items))(*[ctypes.addressof(it) for it, _ in items])
    call = _Call("metatp_q8_matmul", (items, ptrs), n=len(items), items=ctypes.addressof(ptrs), nthreads=nthreads)
    call.items = items
    return call


def _q8_item(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, kind: int) -> ctypes.Structure:
    return _Q8MatmulArgs(rows=aw.rows, k=aw.k, block=aw.block, bits=aw.bits, bias=aw.bias, q=aw.q.ctypes.data,
                         scale=aw.scale.ctypes.data, offset=None if aw.offset is None else aw.offset.ctypes.data,
                         x=x2.ctypes.data, ldx=x2.strides[0] // 4, ntok=x2.shape[0], y=y2.ctypes.data,
                         ldy=y2.strides[0] // 4, kind=kind, group=aw.group, half_scales=_half_scales(aw))


def prepare_q8_matmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, nthreads: int | None = None,
                      kind: int | None = None) -> Callable[[], None]:
    """A closure computing y2 = x2 @ W.T the way llama.cpp's CPU backend does: each row of x2
    rounded to Q8 blocks (`kind`, default `q8_kind(aw)`), integer dot products with the codes,
    float scales after. x2: (n, K), y2: (n, rows) float32, rows contiguous."""
    _check(aw, x2, y2)
    kind = q8_kind(aw) if kind is None else kind
    if kind not in (Q8_0, Q8_1, Q8_K) or aw.bits == 16 or (aw.block == 16 and kind != Q8_K):
        raise ValueError(f"q8 matmul: weight (bits {aw.bits}, block {aw.block}, {aw.ggml_type}) with kind {kind}")
    if aw.k % (256 if kind == Q8_K else 32):
        raise ValueError(f"q8 matmul: K={aw.k} is not a whole number of activation blocks")
    if x2.shape[0] == 0 or aw.rows == 0:
        return lambda: None
    return _q8_group([(_q8_item(aw, x2, y2, kind), (aw, x2, y2))], nthreads or default_threads())


def q8_matmul(x: np.ndarray, aw: AffineWeight, kind: int | None = None, nthreads: int | None = None) -> np.ndarray:
    """The one-off form of `prepare_q8_matmul`: x (n, K) -> (n, rows)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, aw.k)
    y2 = np.empty((x2.shape[0], aw.rows), dtype=np.float32)
    prepare_q8_matmul(aw, x2, y2, nthreads, kind)()
    return y2


def q8_quantize(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """x (n, K) float32 rounded as the kernel rounds it: (codes int8 (n, K), scales float32
    (n, K/32) or (n, K/256) for Q8_K, Q8_1's s (n, K/32) or None, int32 sums of 16 codes)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x2.shape
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // 256 if kind == Q8_K else k // 32), np.float32)
    s = np.empty((n, k // 32), np.float32) if kind == Q8_1 else None
    isum = np.empty((n, k // 16), np.int32)
    _Call("metatp_q8_quantize", (x2, q, d, s, isum), kind=kind, ntok=n, k=k, x=x2.ctypes.data, ldx=k,
          q=q.ctypes.data, d=d.ctypes.data, s=None if s is None else s.ctypes.data, isum=isum.ctypes.data)()
    return q, d, s, isum


def round_half(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half -> float32 as the kernels round Q8 scales (for the tests)."""
    x1 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(x1)
    _Call("metatp_round_half", (x1, out), n=x1.size, x=x1.ctypes.data, out=out.ctypes.data)()
    return out.reshape(np.shape(x))


def q8_isums(aw: AffineWeight, xq: np.ndarray) -> np.ndarray:
    """The kernel's exact integer sums (n, rows, K/16) of weight codes times activation codes
    `xq` (n, K) int8 over each 16 elements (what the float scales then multiply); over each 32,
    (n, rows, K/32), for a weight in the row-group layout (its kernel sums whole blocks)."""
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    n, k = xq.shape
    out = np.empty((n, aw.rows, k // (32 if aw.group > 1 else 16)), np.int32)
    x_dummy = np.zeros((n, k), np.float32)
    item = _q8_item(aw, x_dummy, np.empty((n, aw.rows), np.float32), Q8_0)
    _Call("metatp_q8_isums", (item, xq, out, aw, x_dummy), w=ctypes.addressof(item), xq=xq.ctypes.data,
          out=out.ctypes.data)()
    return out


def _elems(a: np.ndarray, axis: int) -> int:
    """Stride of `axis` in float32 elements."""
    return a.strides[axis] // 4


def rope_usable(x3: np.ndarray, o3: np.ndarray) -> bool:
    """Can `prepare_rope` take these (T, H, D) float32 views (last dim contiguous)?"""
    return (available() and x3.dtype == np.float32 and o3.dtype == np.float32 and x3.ndim == 3
            and x3.shape == o3.shape and x3.strides[2] == 4 and o3.strides[2] == 4)


def prepare_rope(x3: np.ndarray, o3: np.ndarray, n_dims: int, neox: bool, cos_sin: np.ndarray) -> Callable[[], None]:
    """out = rope(x) for (T, H, D) views; cos_sin (2, T, n_dims/2) float32 holds the step's
    tables (refilled in place each step, so its address stays valid)."""
    T, H, D = x3.shape
    if not rope_usable(x3, o3) or cos_sin.shape != (2, T, n_dims // 2) or not cos_sin.flags.c_contiguous:
        raise ValueError(f"rope kernel: unsupported views x {x3.shape} {x3.strides}, tables {cos_sin.shape}")
    return _Call("metatp_rope", (x3, o3, cos_sin), T=T, H=H, D=D, n_dims=n_dims, neox=int(bool(neox)),
                 x=x3.ctypes.data, x_st=_elems(x3, 0), x_sh=_elems(x3, 1), out=o3.ctypes.data,
                 o_st=_elems(o3, 0), o_sh=_elems(o3, 1), cs=cos_sin.ctypes.data)


def kv_row_bytes(kv_type: int, n: int) -> int | None:
    """Bytes of a cache row of n values of a KV type, or None for a type or length the kernels
    do not take (quantized rows are whole blocks of 32)."""

    if int(kv_type) not in KV_TYPES:
        return None
    try:
        return row_bytes(GGMLType(int(kv_type)), n)
    except ValueError:
        return None


def _kv_view_ok(a: np.ndarray, kv_type: int, n: int) -> bool:
    """Is `a` (heads, rows, last) a cache view the attention kernel reads: float32 for f32, half
    for f16, bytes for the rest, each row `n` values of the type with contiguous last dim."""
    rb = kv_row_bytes(kv_type, n)
    want = {0: np.float32, 1: np.float16}.get(int(kv_type), np.uint8)
    return (rb is not None and a.ndim == 3 and a.dtype == want and a.shape[2] * a.itemsize == rb
            and (a.shape[2] <= 1 or a.strides[2] == a.itemsize))


def attention_usable(q: np.ndarray, k: np.ndarray, v: np.ndarray, out3: np.ndarray, k_type: int = 0,
                     v_type: int = 0) -> bool:
    """q (H, T, D) and out (T, H, Dv) float32 with contiguous last dims; k/v (Hkv, n_kv, .) cache
    views of types k_type/v_type (GGML type ids of `KV_TYPES`; see `_kv_view_ok`)."""
    if not (available() and all(a.dtype == np.float32 and a.ndim == 3 and a.strides[2] == 4 for a in (q, out3))):
        return False
    H, T, D = q.shape
    Dv = out3.shape[2]
    return (_kv_view_ok(k, k_type, D) and _kv_view_ok(v, v_type, Dv) and k.shape[0] > 0 and H % k.shape[0] == 0
            and k.shape[:2] == v.shape[:2] and out3.shape == (T, H, Dv))


_ATTN_KV_BLOCK = 64     # KV_BLOCK in cpu_kernels.c


def prepare_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                      softcap: float, sinks: np.ndarray | None, out3: np.ndarray, nthreads: int | None = None,
                      k_type: int = 0, v_type: int = 0) -> Callable[[int], None]:
    """A closure `run(n_kv)`: out3 = softmax(q k[:, :n_kv]^T * scale (+ softcap, mask, sinks)) v[:, :n_kv],
    the same as `numpy_kernels.attention_reference` on the dequantized cache (which the tests hold
    it to) up to float rounding: K/V read once per KV head, online softmax, threads sharing
    (KV head, chunk of ATTN_CHUNK cells) units. k/v are cache views of types k_type/v_type."""
    if not attention_usable(q, k, v, out3, k_type, v_type):
        raise ValueError("attention kernel: unsupported views")
    H, T, D = q.shape
    Hkv, n_max = v.shape[:2]
    Dv = out3.shape[2]
    if mask is not None and (mask.dtype != np.float32 or mask.strides[1] != 4 or mask.shape[1] < n_max):
        raise ValueError("attention kernel: unsupported mask view")
    sinks_c = None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
    threads = nthreads or default_threads()
    # per (KV head, chunk): (m, l, output) for each of its query rows; per thread a block of scores
    max_chunks = max(1, -(-n_max // ATTN_CHUNK))
    G = (H // Hkv) * T
    scratch = np.empty(Hkv * max_chunks * G * (Dv + 2) + threads * G * _ATTN_KV_BLOCK, dtype=np.float32)
    call = _Call("metatp_attention", (q, k, v, mask, sinks_c, out3, scratch), T=T, H=H, Hkv=Hkv, D=D, Dv=Dv,
                 n_kv=n_max, q=q.ctypes.data, q_sh=_elems(q, 0), q_st=_elems(q, 1), k=k.ctypes.data,
                 k_sh=k.strides[0], k_sj=k.strides[1], k_type=int(k_type), v=v.ctypes.data, v_sh=v.strides[0],
                 v_sj=v.strides[1], v_type=int(v_type), mask=None if mask is None else mask.ctypes.data,
                 m_st=0 if mask is None else _elems(mask, 0), scale=float(scale), softcap=float(softcap or 0.0),
                 sinks=None if sinks_c is None else sinks_c.ctypes.data, out=out3.ctypes.data,
                 o_st=_elems(out3, 0), o_sh=_elems(out3, 1), scratch=scratch.ctypes.data, max_chunks=max_chunks,
                 nthreads=threads)
    args = call.args

    def run(n_kv: int) -> None:
        args.n_kv = min(int(n_kv), n_max)
        call()

    def set_n_kv(n_kv: int) -> None:
        args.n_kv = min(int(n_kv), n_max)
    run.keep = run.call = call
    run.set_n_kv = set_n_kv
    return run


def kv_quantize(x: np.ndarray, kv_type: int) -> np.ndarray:
    """Rows x (rows, n) float32 -> cache rows (rows, row bytes) uint8 of a 16-bit or quantized
    KV type, as the compiled KV write rounds them (the tests hold it to gguf.quants)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x2.shape
    rb = kv_row_bytes(kv_type, n)
    if rb is None or int(kv_type) == 0:
        raise ValueError(f"kv_quantize: type {kv_type} with rows of {n}")
    q = np.zeros((rows, rb), np.uint8)
    _Call("metatp_kv_convert", (x2, q), type=int(kv_type), rows=rows, n=n, x=x2.ctypes.data, q=q.ctypes.data,
          out=None)()
    return q


def kv_dequantize(q: np.ndarray, kv_type: int, n: int) -> np.ndarray:
    """Cache rows (rows, row bytes) uint8 -> float32 (rows, n), as the attention kernel reads them."""
    q2 = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1, kv_row_bytes(kv_type, n) or 1)
    out = np.empty((q2.shape[0], n), np.float32)
    _Call("metatp_kv_convert", (q2, out), type=int(kv_type), rows=q2.shape[0], n=n, x=None, q=q2.ctypes.data,
          out=out.ctypes.data)()
    return out


GLU_ACTS = {"silu": 0, "gelu_tanh": 1}


def _row_views_ok(*arrs: np.ndarray) -> bool:
    """float32 (T, n) row views of one shape with contiguous rows: what the row kernels take."""
    return all(x.dtype == np.float32 and x.ndim == 2 and x.shape == arrs[0].shape and x.strides[1] == 4
               for x in arrs)


def prepare_glu(a2: np.ndarray, b2: np.ndarray, o2: np.ndarray, act: str) -> Callable[[], None] | None:
    """out = act(a) * b over (T, n) row views with contiguous rows; None when the views or the
    activation are not ones the kernel takes (the caller keeps numpy)."""
    if not available() or act not in GLU_ACTS or not _row_views_ok(a2, b2, o2):
        return None
    return _Call("metatp_glu", (a2, b2, o2), T=a2.shape[0], n=a2.shape[1], act=GLU_ACTS[act], a=a2.ctypes.data,
                 a_st=_elems(a2, 0), b=b2.ctypes.data, b_st=_elems(b2, 0), out=o2.ctypes.data, o_st=_elems(o2, 0))


def prepare_rms_norm(x2: np.ndarray, w: np.ndarray | None, o2: np.ndarray, eps: float) -> Callable[[], None] | None:
    """out = rms_norm(x) [* w] over (T, n) row views with contiguous rows, rounded as
    `numpy_kernels.rms_norm_mul`; None when the views are not ones the kernel takes."""
    if not available() or not _row_views_ok(x2, o2) or x2.shape[1] == 0:
        return None
    if w is not None and (w.dtype != np.float32 or w.size != x2.shape[1] or not w.flags.c_contiguous):
        return None
    return _Call("metatp_rms_norm", (x2, w, o2), T=x2.shape[0], n=x2.shape[1], x=x2.ctypes.data, x_st=_elems(x2, 0),
                 w=None if w is None else w.ctypes.data, out=o2.ctypes.data, o_st=_elems(o2, 0), eps=eps)


def prepare_add(a2: np.ndarray, b2: np.ndarray, o2: np.ndarray) -> Callable[[], None] | None:
    """out = a + b over (T, n) row views with contiguous rows; None when the kernel does not take them."""
    if not available() or not _row_views_ok(a2, b2, o2):
        return None
    return _Call("metatp_add", (a2, b2, o2), T=a2.shape[0], n=a2.shape[1], a=a2.ctypes.data, a_st=_elems(a2, 0),
                 b=b2.ctypes.data, b_st=_elems(b2, 0), out=o2.ctypes.data, o_st=_elems(o2, 0))


def prepare_allreduce(bufs: list[np.ndarray], active: list[bool]) -> Callable[[], None] | None:
    """The butterfly of `collectives.schedule.butterfly_schedule`, compiled (the same bits: it
    sums only the lower half of each doubling round, and a + b == b + a), over these float32
    C-contiguous buffers; None when they are not such buffers. `collectives.host.HOST_KERNELS`
    registers it for mode "butterfly"."""
    if (not available() or len(bufs) != len(active)
            or any(b.dtype != np.float32 or not b.flags.c_contiguous or b.size != bufs[0].size for b in bufs)):
        return None
    ptrs = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
    flags = np.array([1 if a else 0 for a in active], dtype=np.uint8)
    return _Call("metatp_allreduce", (bufs, ptrs, flags), n=len(bufs), count=bufs[0].size,
                 bufs=ctypes.addressof(ptrs), active=flags.ctypes.data)


# Long prompts multiply with BLAS on float32 weights made from the codes a slab of rows at a time
# (8 MiB per device: a slab stays in the last-level cache between the dequantize and the GEMM),
# so a weight kept as int8 codes needs no float32 copy.
DEQUANT_CHUNK = 1 << 21       # float32 elements of the per-device slab


def prepare_dequant_matmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, slab: np.ndarray,
                           nthreads: int | None = None) -> Callable[[], None]:
    """y2 = x2 @ dequantize(aw).T with BLAS, dequantizing `slab.size // K` rows at a time into
    `slab` (bit-identical to gguf's dequantized values). x2 (n, K), y2 (n, rows) float32."""
    rows, k = aw.rows, aw.k
    if x2.shape[-1] != k or y2.shape != (x2.shape[0], rows) or slab.dtype != np.float32:
        raise ValueError(f"dequant matmul: x {x2.shape}, out {y2.shape} do not fit weight {aw.q.shape}")
    step = max(1, min(rows, slab.size // k))
    if aw.group > 1:
        step = max(aw.group, step - step % aw.group)    # whole row groups a slab
    if step * k > slab.size:
        raise ValueError(f"dequant matmul: a row of {k} does not fit the {slab.size}-element slab")
    calls = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = slab[: (r1 - r0) * k].reshape(r1 - r0, k)
        deq = _Call("metatp_dequant", (aw, slab), rows=r1 - r0, k=k, block=aw.block, **_code_format(aw),
                    q=aw.q[r0:r1].ctypes.data, scale=aw.scale[r0:r1].ctypes.data,
                    offset=None if aw.offset is None else aw.offset[r0:r1].ctypes.data, out=w.ctypes.data,
                    ldo=k, nthreads=1, group=aw.group, half_scales=_half_scales(aw))
        calls.append((deq, w.T, y2[:, r0:r1]))

    def run() -> None:
        for deq, wt, out in calls:
            deq()
            np.matmul(x2, wt, out=out)
    run.keep = (calls, x2, y2)
    return run


def dequantize(aw: AffineWeight, nthreads: int | None = None) -> np.ndarray:
    """The float32 weight (rows, K) from its codes, with the compiled kernel (tests compare it
    with `affine_quant.dequantize_affine`)."""
    rows, k = aw.rows, aw.k
    out = np.empty((rows, k), np.float32)
    if rows:
        _Call("metatp_dequant", (aw, out), rows=rows, k=k, block=aw.block, **_code_format(aw),
              q=aw.q.ctypes.data,
              scale=aw.scale.ctypes.data, offset=None if aw.offset is None else aw.offset.ctypes.data,
              out=out.ctypes.data, ldo=k, nthreads=nthreads or default_threads(), group=aw.group,
              half_scales=_half_scales(aw))()
    return out


def prepare_set_rows(rows2: np.ndarray, ids1: np.ndarray, dst2: np.ndarray, dst_type: int = 0
                     ) -> Callable[[], None] | None:
    """dst2[ids1] = rows2 (float32 rows of n, int32 ids) as one compiled call, stored as the KV
    type `dst_type` (dst2: float32 / float16 rows of n, or byte rows of a bf16 or quantized type,
    rounded as gguf.quants rounds); None when the arrays are not ones it takes (the caller keeps
    numpy)."""
    n = rows2.shape[1] if rows2.ndim == 2 else -1
    if (not available() or rows2.ndim != 2 or dst2.ndim != 2 or rows2.dtype != np.float32
            or not _kv_view_ok(dst2[None], dst_type, n) or ids1.dtype != np.int32 or ids1.ndim != 1
            or ids1.shape[0] != rows2.shape[0] or not ids1.flags.c_contiguous or rows2.strides[1] != 4):
        return None
    call = _Call("metatp_set_rows", (rows2, ids1, dst2), T=rows2.shape[0], n=n, src=rows2.ctypes.data,
                 src_st=_elems(rows2, 0), dst=dst2.ctypes.data, dst_st=dst2.strides[0], dst_rows=dst2.shape[0],
                 ids=ids1.ctypes.data, type=int(dst_type))

    def run() -> None:
        try:
            call()
        except RuntimeError:
            raise IndexError(f"set_rows: a row id is outside 0..{dst2.shape[0] - 1}: {ids1.tolist()}") from None
    run.keep = run.kernel = call
    run.prepare = None
    return run
