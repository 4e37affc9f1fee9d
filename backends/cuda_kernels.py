"""Loader and launch helpers for metatp's CUDA kernels (``cuda/*.cu``).

The kernels are plain CUDA C with ``extern "C"`` entry points; every family (one ``.cu``
file) becomes one ``cupy.RawModule`` compiled by NVRTC from source, once per device, and
cached. The Python functions below take arrays plus Python ints/floats, convert the
scalars to ``np.int32`` / ``np.float32`` (a Python float given to a ``float`` parameter
would be passed as a double), pick grid/block, and launch on the current stream of the
current device.

Two things make these helpers usable by a backend that prepares a plan once and replays it:

* ``recording()``: inside it, ``launch`` does not launch but appends a :class:`Launch`
  (kernel, grid, block, typed args) to a list. ``Launch.frozen()`` replaces arrays by raw
  pointers, so replaying costs one RawKernel call. A captured CUDA graph replays the same
  arguments, so every per-step value (positions, KV length) is read from device memory.
* ``use_emulator()``: the same sources compiled as host C++ (one fiber per CUDA thread,
  ``__syncthreads`` and warp shuffles emulated), launched on numpy arrays. It needs only
  g++ and lets every kernel be checked against numpy on a machine without a GPU. It checks
  what a real launch would refuse too: block/grid limits, shared memory, and the C type of
  every argument (``np.int32`` / ``np.float32`` / pointer).

Importing this module needs neither CuPy nor a GPU; CuPy is imported on first use.

Conventions (ggml): a weight has ``ne = [in, out]``, stored as ``out`` rows of ``in``
elements (each row a sequence of quant blocks). An array holding a ggml tensor with
``ne = [a, b, c, d]`` has shape ``(d, c, b, a)``. f16 tensors are ``float16`` arrays,
bf16 tensors are ``uint16`` arrays holding the bit patterns. Strides passed to kernels
are in elements unless a name says ``bytes``.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = [
    "FAMILIES", "WEIGHT_TYPES", "MATVEC_MAX_TOKENS", "Launch",
    "gpu_available", "gpu_probe", "kernel_sources", "module_source",
    "expected_entry_points", "get_kernel", "launch", "recording", "use_emulator",
    "compile_all", "device_ptr",
    "dequantize", "matvec", "matvec_multi", "matvec_glu", "matvec_id", "rms_norm", "norm", "sum_rows", "rope",
    "set_rows", "flash_attn_decode", "flash_attn_prefill", "flash_attn", "binary", "add", "sub",
    "mul", "div", "add_inplace", "add_id", "unary", "scale", "fill", "silu", "gelu", "sigmoid",
    "softplus", "swiglu", "geglu", "soft_max", "argmax", "top_k", "get_rows", "copy",
    "f32_to_bf16", "bf16_to_f32",
]

#: One CUDA source (and one RawModule) per op family.
FAMILIES = ("dequant", "matvec", "norm", "rope", "kv", "attn", "elementwise")

#: ggml weight types the kernels read: name -> (elements per block, bytes per block).
WEIGHT_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
#: elements per chunk (one thread's unit of work) per weight type, as in quant.cuh
_CHUNK_ELEMS = {"f32": 1, "f16": 1, "bf16": 1, "q8_0": 8, "q4_0": 8, "q4_1": 8,
                "q4_k": 8, "q5_k": 8, "q6_k": 8}

#: matvec handles up to this many tokens per launch (llama.cpp's MMVQ_MAX_BATCH_SIZE).
MATVEC_MAX_TOKENS = 8
_MATVEC_NT = (1, 2, 4, 8)
_ATTN_NG = (1, 2, 4, 8)
_KV_TYPES = ("f16", "bf16", "f32")
_CPY_PAIRS = (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"),
              ("f32", "bf16"), ("bf16", "f32"))
_UNARY_OPS = ("scale", "silu", "gelu", "sigmoid", "softplus")
_GLU_ACTS = ("swiglu", "geglu")
_TOPK_MAX = 256

#: Options handed to NVRTC (CuPy adds -arch of the device, -ftz=true and its -std).
COMPILE_OPTIONS: tuple[str, ...] = ()

_BLOCK_1D = 256
_MAX_GRID_1D = 65535 * 8  # grid-stride kernels: more blocks than this buy nothing


# --------------------------------------------------------------------------- sources
def _cuda_dir():
    """The folder holding the .cu/.cuh files (package data ``metatp.cuda``), as a
    ``Path`` or an ``importlib.resources`` Traversable."""
    try:
        import importlib.resources as resources

        d = resources.files("metatp.cuda")  # a MultiplexedPath for a namespace package
        if d.joinpath("quant.cuh").is_file():
            return d
    except Exception:  # noqa: BLE001 - not importable (setuptools editable mode), ...
        pass
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "cuda", here / "cuda"):
        if (cand / "quant.cuh").is_file():
            return cand
    raise FileNotFoundError("metatp CUDA sources not found (package data metatp.cuda)")


_sources_cache: dict[str, str] | None = None


def kernel_sources() -> dict[str, str]:
    """All CUDA source files by file name (``"matvec.cu"``, ``"quant.cuh"``, ...)."""
    global _sources_cache
    if _sources_cache is None:
        d = _cuda_dir()
        out: dict[str, str] = {}
        for p in sorted(d.iterdir(), key=lambda p: p.name):
            if p.name.endswith((".cu", ".cuh")) and p.is_file():
                out[p.name] = p.read_text(encoding="utf-8")
        _sources_cache = out
    return dict(_sources_cache)


_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def module_source(family: str) -> str:
    """Source of one family with local ``#include "x.cuh"`` lines pasted in.

    NVRTC gets the text only (no include path), so local headers are inlined here.
    """
    srcs = kernel_sources()
    name = f"{family}.cu"
    if name not in srcs:
        raise KeyError(f"no CUDA source {name!r}; have {sorted(srcs)}")

    def expand(text: str, seen: tuple[str, ...]) -> str:
        def repl(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc not in srcs:
                raise FileNotFoundError(f"{family}.cu includes missing {inc!r}")
            if inc in seen:
                return ""
            return f"// ---- begin {inc}\n{expand(srcs[inc], seen + (inc,))}\n// ---- end {inc}"

        return _INCLUDE_RE.sub(repl, text)

    return expand(srcs[name], (name,))


def expected_entry_points() -> dict[str, list[str]]:
    """Every extern "C" kernel name this module launches, per family."""
    wt = list(WEIGHT_TYPES)
    return {
        "dequant": [f"dequant_{t}_{o}" for t in wt for o in ("f32", "f16")],
        "matvec": [f"matvec_{t}_t{n}" for t in wt for n in _MATVEC_NT]
        + [f"matvec_multi_{t}" for t in wt]
        + [f"matvec_{a}_{t}" for t in wt for a in _GLU_ACTS]
        + [f"matvec_id_{t}" for t in wt],
        "norm": ["rms_norm_f32", "norm_f32", "sum_rows_f32"],
        "rope": ["rope_norm_f32", "rope_neox_f32"],
        "kv": [f"set_rows_f32_{t}" for t in _KV_TYPES],
        "attn": [f"attn_decode_{t}_g{g}" for t in _KV_TYPES for g in _ATTN_NG]
        + ["attn_merge_f32"]
        + [f"attn_prefill_{t}" for t in _KV_TYPES],
        "elementwise": [f"binary_{op}_f32" for op in ("add", "sub", "mul", "div")]
        + ["add_inplace_f32", "add_inplace_f32_bf16", "add_inplace_bf16", "fill_f32"]
        + [f"unary_{op}_f32" for op in _UNARY_OPS]
        + ["swiglu_f32", "geglu_f32", "soft_max_f32", "argmax_f32"]
        + [f"get_rows_{t}" for t in wt]
        + ["add_id_f32", "top_k_f32"]
        + [f"cpy_{a}_{b}" for a, b in _CPY_PAIRS]
        + ["f32_to_bf16", "bf16_to_f32"],
    }


def _family_of(name: str) -> str:
    for fam, names in expected_entry_points().items():
        if name in names:
            return fam
    raise KeyError(f"no kernel named {name!r}")


# --------------------------------------------------------------------------- engines
#: A kernel that needs NVRTC, the CUDA headers CuPy adds to every compile, the driver and a
#: device: what `gpu_available` compiles and runs once, so "auto" never picks a broken GPU.
_PROBE_SOURCE = 'extern "C" __global__ void metatp_probe(int* p) { if (p) *p = 7; }'

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
        cupy.RawKernel(_PROBE_SOURCE, "metatp_probe")((1,), (1,), (out,))
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


class _CupyEngine:
    """Kernels compiled by NVRTC through cupy.RawModule, arrays are cupy arrays."""

    name = "cupy"

    def __init__(self) -> None:
        self._modules: dict[tuple[str, int], Any] = {}
        self._sms: dict[int, int] = {}

    @staticmethod
    def cupy():
        import cupy  # noqa: PLC0415 - lazy on purpose

        return cupy

    def device_id(self) -> int:
        return int(self.cupy().cuda.runtime.getDevice())

    def module(self, family: str, dev: int):
        key = (family, dev)
        mod = self._modules.get(key)
        if mod is None:
            mod = self.cupy().RawModule(code=module_source(family), options=COMPILE_OPTIONS)
            self._modules[key] = mod
        return mod

    def empty(self, shape, dtype):
        return self.cupy().empty(shape, dtype=dtype)

    def sm_count(self) -> int:
        dev = self.device_id()
        n = self._sms.get(dev)
        if n is None:
            try:
                n = int(self.cupy().cuda.Device(dev).attributes["MultiProcessorCount"])
            except Exception:  # noqa: BLE001
                n = 80
            self._sms[dev] = n
        return n


_CUPY = _CupyEngine()
_engines: list[Any] = []          # use_emulator() pushes here; empty: CuPy
_lock = threading.RLock()
_functions: dict[tuple[Any, str, str, int], Any] = {}   # (engine, family, name, device)
_smem_set: dict[tuple[Any, str, str, int], int] = {}


def _engine():
    return _engines[-1] if _engines else _CUPY


def __getattr__(name: str):
    """The emulator lives in its own module (tests only); keep its names importable from here."""
    if name in ("Emulator", "emulator_available", "emulator_source"):
        from metatp.backends import cuda_emulator

        return getattr(cuda_emulator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def use_emulator(emulator=None) -> Iterator:
    """Run every kernel of this module on the CPU emulator (numpy arrays) inside the block."""
    from metatp.backends.cuda_emulator import Emulator

    emu = emulator or Emulator()
    with _lock:
        _engines.append(emu)
    try:
        yield emu
    finally:
        with _lock:
            _engines.remove(emu)


def get_kernel(family: str, name: str):
    """The kernel ``name`` of ``family`` for the current device (cached)."""
    eng = _engine()
    dev = eng.device_id()
    key = (eng, family, name, dev)
    k = _functions.get(key)
    if k is None:
        with _lock:
            k = _functions.get(key)
            if k is None:
                k = eng.module(family, dev).get_function(name)
                _functions[key] = k
    return k


def device_ptr(a) -> int:
    """The device address of an array's first element (cupy) or its host address (numpy)."""
    if a is None:
        return 0
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:
        return int(ptr)
    if isinstance(a, np.ndarray):
        return int(a.ctypes.data)
    raise TypeError(f"not an array: {type(a).__name__}")


def _is_array(a) -> bool:
    return isinstance(a, np.ndarray) or hasattr(getattr(a, "data", None), "ptr")


@dataclass
class Launch:
    """One kernel launch, ready to be replayed: ``launch()`` with every argument fixed."""

    kernel: Any
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple
    shared_mem: int = 0
    keep: tuple = field(default=(), repr=False)   # arrays whose pointers `args` hold

    def __call__(self) -> None:
        self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem)

    def frozen(self) -> "Launch":
        """The same launch with arrays replaced by raw pointers (np.uint64): cheaper to replay.
        The arrays are kept alive by the Launch."""
        arrays = tuple(a for a in self.args if _is_array(a))
        args = tuple(np.uint64(device_ptr(a)) if (a is None or _is_array(a)) else a for a in self.args)
        return Launch(self.kernel, self.name, self.grid, self.block, args, self.shared_mem,
                      self.keep + arrays)


_recorder = threading.local()

#: An absent (optional) pointer argument: NULL, as 8 bytes (never ``None``, see ``launch``).
_NULL = np.uint64(0)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Collect launches instead of running them (nested recordings are independent)."""
    prev = getattr(_recorder, "launches", None)
    out: list[Launch] = []
    _recorder.launches = out
    try:
        yield out
    finally:
        _recorder.launches = prev


def launch(family: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch a kernel on the current stream (grid/block tuples, args already typed), or
    record it inside ``recording()``."""
    k = get_kernel(family, name)
    if shared_mem > 48 * 1024:
        key = (_engine(), family, name, _engine().device_id())
        if _smem_set.get(key, 0) < shared_mem:
            k.max_dynamic_shared_size_bytes = int(shared_mem)
            _smem_set[key] = int(shared_mem)
    # CuPy 13 passes a None argument as a pointer to garbage, not as NULL (fixed in 14.0):
    # every absent pointer goes to the kernel as an explicit 0.
    args = tuple(_NULL if a is None else a for a in args)
    item = Launch(k, name, tuple(int(g) for g in grid), tuple(int(b) for b in block), args,
                  int(shared_mem))
    rec = getattr(_recorder, "launches", None)
    if rec is not None:
        rec.append(item)
    else:
        item()


def compile_all(families=None) -> dict[str, float]:
    """Compile (and load) every family on the current device; seconds per family."""
    import time

    out = {}
    names = expected_entry_points()
    for fam in families or FAMILIES:
        t0 = time.perf_counter()
        for n in names[fam]:
            get_kernel(fam, n)
        out[fam] = time.perf_counter() - t0
    return out


def _sms() -> int:
    return _engine().sm_count()


def _empty(shape, dtype):
    return _engine().empty(shape, dtype)


# --------------------------------------------------------------------------- helpers
def _i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise OverflowError(f"{v} does not fit in int32")
    return np.int32(v)


def _i64(v) -> np.int64:
    v = int(v)
    if not -(2**63) <= v < 2**63:
        raise OverflowError(f"{v} does not fit in int64")
    return np.int64(v)


def _f32(v) -> np.float32:
    return np.float32(v)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid1d(total: int, block: int = _BLOCK_1D) -> tuple[int]:
    return (max(1, min(_cdiv(int(total), block), _MAX_GRID_1D)),)


def _wtype(qtype) -> str:
    """Normalise a weight type: 'Q4_0', 'q4_0', GGMLQuantizationType.Q4_0, ... -> 'q4_0'."""
    name = getattr(qtype, "name", qtype)
    name = str(name).lower()
    if name not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {qtype!r}; supported: {sorted(WEIGHT_TYPES)}")
    return name


def _act_type(a) -> str:
    """Storage type of an activation / cache array: 'f32', 'f16' or 'bf16' (uint16 bits)."""
    name = np.dtype(a.dtype).name
    if name == "float32":
        return "f32"
    if name == "float16":
        return "f16"
    if name in ("uint16", "bfloat16"):
        return "bf16"
    raise TypeError(f"unsupported dtype {name} (want float32, float16 or uint16/bfloat16 for bf16)")


def _estrides(a) -> tuple[int, ...]:
    """Element strides of an array (numpy order)."""
    isz = a.dtype.itemsize
    out = []
    for s in a.strides:
        if s % isz:
            raise ValueError(f"stride {s} is not a multiple of the item size {isz}")
        out.append(s // isz)
    return tuple(out)


def _rows2d(a, ne0: int | None = None, n_rows: int | None = None,
            row_stride: int | None = None) -> tuple[int, int, int]:
    """(ne0, n_rows, row_stride) of an array seen as rows of contiguous elements.

    The innermost dim is the row; all leading dims must collapse into one evenly
    spaced row index (size-1 dims are ignored). Explicit arguments win.
    """
    shape = tuple(a.shape)
    if not shape:
        raise ValueError("expected an array with at least one dimension")
    st = _estrides(a)
    if shape[-1] > 1 and st[-1] != 1:
        raise ValueError("the innermost dimension must be contiguous")
    lead = [(n, s) for n, s in zip(shape[:-1], st[:-1]) if n != 1]
    if ne0 is None:
        ne0 = shape[-1]
    if n_rows is None:
        n_rows = math.prod(n for n, _ in lead) if lead else 1
    if row_stride is None:
        if not lead:
            row_stride = ne0
        else:
            for (_, s0), (n1, s1) in zip(lead[:-1], lead[1:]):
                if s0 != s1 * n1:
                    raise ValueError("leading dimensions do not collapse into evenly spaced rows")
            row_stride = lead[-1][1]
    return int(ne0), int(n_rows), int(row_stride)


def _as4(shape, strides) -> tuple[list[int], list[int]]:
    """numpy-order shape/strides (<= 4 dims) -> ggml ne[0..3], s[0..3]."""
    if len(shape) > 4:
        raise ValueError("at most 4 dimensions")
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    s = list(reversed(strides)) + [0] * (4 - len(strides))
    for i in range(4):
        if ne[i] == 1:
            s[i] = 0
    return ne, s


def _nd(a) -> tuple[list[int], list[int]]:
    """ggml (ne[0..3], element strides[0..3]) of an array."""
    return _as4(a.shape, _estrides(a))


def _check_f32(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype != np.float32:
            raise TypeError(f"expected float32, got {a.dtype}")


def _check_i32(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype != np.int32:
            raise TypeError(f"expected int32 indices, got {a.dtype}")


def _tail(a, rows: int, row_stride: int):
    """View of ``a`` starting ``rows`` rows (of row_stride elements) in (no copy)."""
    if rows == 0:
        return a
    if a.ndim == 2:
        if a.shape[0] > 1 and _estrides(a)[0] != row_stride:
            raise ValueError("token stride differs from the array's row stride")
        return a[rows:]
    if a.ndim == 1:
        return a[rows * row_stride:]
    raise ValueError("expected a 1-D or 2-D array")


def _row_block(ne0: int, cap: int = 1024) -> int:
    return max(32, min(cap, _cdiv(max(1, ne0 // 4), 32) * 32))


# --------------------------------------------------------------------------- dequant
def dequantize(src, qtype, dst, *, ne0: int, n_rows: int, src_row_bytes: int | None = None,
               dst_row_stride: int | None = None) -> None:
    """Rows of a ggml weight -> f32 (``dst`` float32) or f16 (``dst`` float16).

    ``src``: the raw bytes (any dtype; only the pointer is used), row r at
    ``r * src_row_bytes``. ``dst`` row r at ``r * dst_row_stride`` elements.
    """
    t = _wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    out = _act_type(dst)
    if out not in ("f32", "f16"):
        raise TypeError("dequantize writes float32 or float16")
    if src_row_bytes is None:
        src_row_bytes = ne0 // qk * nbytes
    if dst_row_stride is None:
        dst_row_stride = ne0
    units = ne0 // qk * (qk // _CHUNK_ELEMS[t]) * n_rows
    if units == 0:
        return
    launch("dequant", f"dequant_{t}_{out}", _grid1d(units), (_BLOCK_1D,),
           (src, dst, _i32(ne0), _i32(n_rows), _i32(src_row_bytes), _i32(dst_row_stride)))


# --------------------------------------------------------------------------- matvec
def _matvec_block(units: int) -> tuple[int, int]:
    if units >= 512:
        return 256, 1
    if units >= 128:
        return 128, 2
    if units >= 64:
        return 64, 4
    return 32, 8


def _check_block_type(qtype, ne0: int) -> tuple[str, int, int]:
    t = _wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    return t, qk, nbytes


def matvec(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None,
           w_row_bytes: int | None = None, x_stride: int | None = None,
           y_stride: int | None = None, add=None, add_stride: int | None = None) -> None:
    """``y[t, r] = sum_i W[r, i] * x[t, i] (+ add[t, r])`` for a few tokens (decode; any
    count works, launched 8 tokens at a time).

    ``w``: raw weight bytes, row r at ``r * w_row_bytes`` (default: packed rows of ne0).
    ``x``: float32 (n_tokens, ne0) or (ne0,); ``y``: float32 (n_tokens, n_rows) or (n_rows,).
    ``add``: optional float32 residual (same layout as y, stride ``add_stride``; 0 = one
    row broadcast over the tokens, e.g. a bias). Token strides (elements) default to the
    arrays' leading strides.
    """
    t, qk, nbytes = _check_block_type(qtype, ne0)
    _check_f32(x, y, add)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if x_stride is None:
        x_stride = _estrides(x)[0] if x.ndim == 2 else ne0
    if y_stride is None:
        y_stride = _estrides(y)[0] if y.ndim == 2 else n_rows
    if add is not None and add_stride is None:
        add_stride = _estrides(add)[0] if add.ndim == 2 and add.shape[0] > 1 else (
            0 if add.size == n_rows else n_rows)
    if add is None:
        add_stride = 0
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    x_small = x.shape[-1] < ne0 if x.ndim == 2 else x.size < (n_tokens - 1) * x_stride + ne0
    y_small = (y.shape[-1] < n_rows if y.ndim == 2
               else y.size < (n_tokens - 1) * y_stride + n_rows)
    if x_small or y_small:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, "
                         f"n_rows={n_rows}, n_tokens={n_tokens}")
    if n_rows == 0 or n_tokens == 0:
        return
    units = ne0 // qk * (qk // _CHUNK_ELEMS[t])
    bx, by = _matvec_block(units)
    grid = (_cdiv(n_rows, by),)
    for t0 in range(0, n_tokens, MATVEC_MAX_TOKENS):
        nt = min(MATVEC_MAX_TOKENS, n_tokens - t0)
        nt_k = next(n for n in _MATVEC_NT if n >= nt)
        xa = _tail(x, t0, x_stride)
        ya = _tail(y, t0, y_stride)
        aa = None if add is None else (add if add_stride == 0 else _tail(add, t0, add_stride))
        launch("matvec", f"matvec_{t}_t{nt_k}", grid, (bx, by),
               (w, xa, ya, _i32(ne0), _i32(n_rows), _i32(w_row_bytes), _i32(nt),
                _i32(x_stride), _i32(y_stride), aa, _i32(add_stride)))


def _norm_args(x, ne0: int, norm_weight, eps: float | None) -> tuple:
    """(norm_w, eps, flag) kernel arguments: RMS-normalise x first when eps is given."""
    _check_f32(norm_weight)
    if norm_weight is not None and norm_weight.size != ne0:
        raise ValueError(f"norm weight has {norm_weight.size} elements for ne0={ne0}")
    if eps is None:
        return None, _f32(0.0), _i32(0)
    return norm_weight, _f32(eps), _i32(1)


def matvec_multi(jobs, qtype, x, *, ne0: int, norm_weight=None, eps: float | None = None) -> None:
    """One token, up to three weights sharing x: ``y_j = W_j @ x'`` in one launch (q, k, v).

    jobs: (w, y, n_rows, row_bytes) per weight (raw bytes, f32 output of n_rows). With
    ``eps`` given, x' = rms_norm(x, eps) * norm_weight (norm_weight None: no weight), so
    the RMS_NORM before the projections needs no kernel of its own."""
    if not 1 <= len(jobs) <= 3:
        raise ValueError(f"matvec_multi takes 1 to 3 weights, got {len(jobs)}")
    t, qk, nbytes = _check_block_type(qtype, ne0)
    _check_f32(x)
    if x.size < ne0:
        raise ValueError(f"x {x.shape} too small for ne0={ne0}")
    for _, y, n_rows, _ in jobs:
        _check_f32(y)
        if y.size < n_rows:
            raise ValueError(f"y {y.shape} too small for {n_rows} rows")
    jobs = list(jobs) + [(None, None, 0, 0)] * (3 - len(jobs))
    bx, by = _matvec_block(ne0 // qk * (qk // _CHUNK_ELEMS[t]))
    n_blocks = sum(_cdiv(j[2], by) for j in jobs)
    if n_blocks == 0:
        return
    nw, e, flag = _norm_args(x, ne0, norm_weight, eps)
    launch("matvec", f"matvec_multi_{t}", (n_blocks,), (bx, by),
           (*(j[0] for j in jobs), *(j[1] for j in jobs), *(_i32(j[2]) for j in jobs),
            *(_i32(j[3]) for j in jobs), x, _i32(ne0), nw, e, flag))


def matvec_glu(w_gate, w_up, qtype, x, y, *, ne0: int, n_rows: int,
               w_row_bytes: int | None = None, act: str = "swiglu", norm_weight=None,
               eps: float | None = None) -> None:
    """One token: ``y[r] = act(Wg[r] . x') * (Wu[r] . x')`` (gate/up projections + GLU fused).

    act: "swiglu" (silu) or "geglu" (gelu-tanh). Both weights share type and row layout.
    x' as in matvec_multi (the FFN's RMS norm folded in when eps is given)."""
    if act not in _GLU_ACTS:
        raise ValueError(f"act must be one of {_GLU_ACTS}, got {act!r}")
    t, qk, nbytes = _check_block_type(qtype, ne0)
    _check_f32(x, y)
    if x.size < ne0 or y.size < n_rows:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, n_rows={n_rows}")
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows == 0:
        return
    nw, e, flag = _norm_args(x, ne0, norm_weight, eps)
    bx, by = _matvec_block(ne0 // qk * (qk // _CHUNK_ELEMS[t]))
    launch("matvec", f"matvec_{act}_{t}", (_cdiv(n_rows, by),), (bx, by),
           (w_gate, w_up, x, y, _i32(ne0), _i32(n_rows), _i32(w_row_bytes), nw, e, flag))


def matvec_id(w, qtype, x, y, ids, *, ne0: int, n_rows: int, expert_bytes: int,
              w_row_bytes: int | None = None) -> None:
    """ggml MUL_MAT_ID: ``y[t, u] = W[ids[t, u]] @ x[t, u % n_b]``.

    ``w``: experts' raw bytes, expert e at ``e * expert_bytes``; ``x`` float32
    (n_tokens, n_b, ne0); ``y`` float32 (n_tokens, n_used, n_rows); ``ids`` int32
    (n_tokens, n_used). Strides come from the arrays (rows contiguous)."""
    t, qk, nbytes = _check_block_type(qtype, ne0)
    _check_f32(x, y)
    _check_i32(ids)
    if x.ndim != 3 or y.ndim != 3 or ids.ndim != 2:
        raise ValueError("matvec_id wants x (T, n_b, ne0), y (T, n_used, n_rows), ids (T, n_used)")
    n_tok, n_b, _ = x.shape
    n_used = ids.shape[1]
    if y.shape != (n_tok, n_used, n_rows) or ids.shape[0] != n_tok or x.shape[2] != ne0:
        raise ValueError(f"shapes do not match: x {x.shape}, y {y.shape}, ids {ids.shape}")
    xs, ys, is_ = _estrides(x), _estrides(y), _estrides(ids)
    if (ne0 > 1 and xs[2] != 1) or (n_rows > 1 and ys[2] != 1):
        raise ValueError("rows of x and y must be contiguous")
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows * n_used * n_tok == 0:
        return
    bx, by = _matvec_block(ne0 // qk * (qk // _CHUNK_ELEMS[t]))
    launch("matvec", f"matvec_id_{t}", (_cdiv(n_rows, by), n_used, n_tok), (bx, by),
           (w, x, y, ids, _i32(ne0), _i32(n_rows), _i32(w_row_bytes), _i32(expert_bytes),
            _i32(n_b), _i32(xs[1]), _i32(xs[0]), _i32(ys[1]), _i32(ys[0]), _i32(is_[1]),
            _i32(is_[0])))


# --------------------------------------------------------------------------- row reductions
def _rows_nd(x, y) -> tuple[list[int], list[int], list[int]]:
    ne, xs = _nd(x)
    yne, ys = _nd(y)
    if ne[1:] != yne[1:]:
        raise ValueError(f"row dims differ: {x.shape} vs {y.shape}")
    if (ne[0] > 1 and xs[0] != 1) or (yne[0] > 1 and ys[0] != 1):
        raise ValueError("rows must be contiguous")
    return ne, xs, ys


def _norm(name: str, x, y, eps: float, weight) -> None:
    _check_f32(x, y, weight)
    ne, xs, ys = _rows_nd(x, y)
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    if weight is not None and weight.size != ne[0]:
        raise ValueError(f"weight has {weight.size} elements for rows of {ne[0]}")
    n_rows = ne[1] * ne[2] * ne[3]
    if n_rows == 0 or ne[0] == 0:
        return
    launch("norm", name, (n_rows,), (_row_block(ne[0]),),
           (x, weight, y, _i32(ne[0]), _i32(ne[1]), _i32(ne[2]), _i32(n_rows), _i32(xs[1]),
            _i32(xs[2]), _i32(xs[3]), _i32(ys[1]), _i32(ys[2]), _i32(ys[3]), _f32(eps)))


def rms_norm(x, y, *, eps: float, weight=None) -> None:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` per row (rows: any strided <= 4-D view;
    weight None: no multiply; y may be x)."""
    _norm("rms_norm_f32", x, y, eps, weight)


def norm(x, y, *, eps: float, weight=None) -> None:
    """Layer norm without bias: ``y = (x - mean) / sqrt(var + eps) * weight`` per row."""
    _norm("norm_f32", x, y, eps, weight)


def sum_rows(x, y) -> None:
    """``y[..., 0] = x.sum(-1)`` (ggml SUM_ROWS: y has the shape of x with ne0 = 1)."""
    _check_f32(x, y)
    ne, xs = _nd(x)
    yne, ys = _nd(y)
    if yne[0] != 1 or yne[1:] != ne[1:] or (ne[0] > 1 and xs[0] != 1):
        raise ValueError(f"sum_rows: x {x.shape} -> y {y.shape} does not fit")
    n_rows = ne[1] * ne[2] * ne[3]
    if n_rows:
        launch("norm", "sum_rows_f32", (n_rows,), (_row_block(ne[0]),),
               (x, y, _i32(ne[0]), _i32(ne[1]), _i32(ne[2]), _i32(n_rows), _i32(xs[1]),
                _i32(xs[2]), _i32(xs[3]), _i32(ys[1]), _i32(ys[2]), _i32(ys[3])))


# --------------------------------------------------------------------------- rope
def _head_strides(a, head_dim: int, n_head: int, given) -> tuple[int, int]:
    """(head stride, token/row stride) in elements of a [tokens, heads, head_dim] tensor."""
    if given is not None:
        return int(given[0]), int(given[1])
    st = _estrides(a)
    if a.ndim >= 1 and a.shape[-1] > 1 and st[-1] != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if a.ndim == 3:
        return st[1], st[0]
    if a.ndim == 2:
        return head_dim, st[0]
    return head_dim, head_dim * n_head


def rope(x, y, pos, *, head_dim: int, n_head: int, n_tokens: int, n_dims: int,
         freq_base: float, freq_scale: float = 1.0, neox: bool = False, freq_factors=None,
         attn_factor: float = 1.0, x_strides=None, y_strides=None, second=None) -> None:
    """RoPE on f32 ``x`` [n_tokens, n_head, head_dim] (numpy order) into ``y`` (may be x).

    ``pos``: int32 [n_tokens] in device memory (read by the kernel: a captured graph
    replays with new positions). ``x_strides``/``y_strides``: (head stride, token stride)
    in elements; default from 3-D arrays, else contiguous. ``neox``: rotate halves.
    ``second``: optional (x2, y2, n_head2, x2_strides, y2_strides), rotated in the same
    launch with the same positions (Q and K of a layer).
    """
    _check_f32(x, y, freq_factors)
    _check_i32(pos)
    if head_dim % 2 or n_dims % 2 or n_dims > head_dim:
        raise ValueError("head_dim and n_dims must be even and n_dims <= head_dim")
    xs1, xs2 = _head_strides(x, head_dim, n_head, x_strides)
    ys1, ys2 = _head_strides(y, head_dim, n_head, y_strides)
    x2 = y2 = None
    n_head2, x2s, y2s = 0, (0, 0), (0, 0)
    if second is not None:
        x2, y2, n_head2, x2_strides, y2_strides = second
        _check_f32(x2, y2)
        x2s = _head_strides(x2, head_dim, n_head2, x2_strides)
        y2s = _head_strides(y2, head_dim, n_head2, y2_strides)
    total = head_dim // 2 * (n_head + n_head2) * n_tokens
    if total == 0:
        return
    launch("rope", "rope_neox_f32" if neox else "rope_norm_f32", _grid1d(total), (_BLOCK_1D,),
           (x, y, x2, y2, pos, freq_factors, _i32(head_dim), _i32(n_head), _i32(n_head2),
            _i32(n_tokens), _i32(n_dims), _i32(xs1), _i32(xs2), _i32(ys1), _i32(ys2),
            _i32(x2s[0]), _i32(x2s[1]), _i32(y2s[0]), _i32(y2s[1]), _f32(freq_base),
            _f32(freq_scale), _f32(attn_factor)))


# --------------------------------------------------------------------------- kv
def set_rows(src, dst, idx, *, ne0: int | None = None, n_rows: int | None = None,
             src_row_stride: int | None = None, dst_row_stride: int | None = None,
             second=None) -> None:
    """``dst[idx[r], :ne0] = src[r, :ne0]`` converting f32 to dst's type (f16/bf16/f32).
    ``idx`` is read from device memory (a captured graph writes new rows each replay).
    ``second``: optional (src2, dst2) stored with the same indices in the same launch
    (the K and V rows of a layer; dst2 of dst's type)."""
    _check_f32(src)
    _check_i32(idx)
    ne0, n_src_rows, src_row_stride = _rows2d(src, ne0, None, src_row_stride)
    if n_rows is None:
        n_rows = int(idx.size)
    if n_rows > idx.size or (src.ndim > 1 and n_rows > n_src_rows):
        raise ValueError(f"n_rows={n_rows} exceeds idx ({idx.size}) or src rows ({n_src_rows})")
    if dst_row_stride is None:
        dst_row_stride = _rows2d(dst)[2] if dst.ndim > 1 else ne0
    out = _act_type(dst)
    src2 = dst2 = None
    ne0_2, s2, d2 = 0, 0, 0
    if second is not None:
        src2, dst2 = second
        _check_f32(src2)
        if _act_type(dst2) != out:
            raise TypeError("both destinations must have the same type")
        ne0_2, rows2, s2 = _rows2d(src2)
        d2 = _rows2d(dst2)[2] if dst2.ndim > 1 else ne0_2
        if src2.ndim > 1 and rows2 < n_rows:
            raise ValueError(f"second source has {rows2} rows, need {n_rows}")
    if n_rows == 0 or ne0 + ne0_2 == 0:
        return
    launch("kv", f"set_rows_f32_{out}", _grid1d((ne0 + ne0_2) * n_rows), (_BLOCK_1D,),
           (src, dst, idx, _i32(ne0), _i32(n_rows), _i32(src_row_stride),
            _i32(dst_row_stride), src2, dst2, _i32(ne0_2), _i32(s2), _i32(d2)))


# --------------------------------------------------------------------------- attention
def _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv, head_dim, n_tokens, n_kv,
                 q_strides, k_strides, v_strides, mask_stride, causal, causal_offset):
    _check_f32(q, out, mask)
    _check_i32(kv_len)
    kvt = _act_type(k)
    if _act_type(v) != kvt:
        raise TypeError("k and v must have the same type")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_head_kv={n_head_kv}")
    if head_dim > 256:
        raise ValueError("head_dim > 256 is not supported")
    qs = _head_strides(q, head_dim, n_head, q_strides)
    ks = _head_strides(k, head_dim, n_head_kv, k_strides)
    vs = _head_strides(v, head_dim, n_head_kv, v_strides)
    if mask is not None and mask_stride is None:
        mask_stride = _estrides(mask)[0] if mask.ndim == 2 else n_kv
    if mask_stride is None:
        mask_stride = 0
    if causal_offset is None:
        causal_offset = n_kv - n_tokens
    return kvt, qs, ks, vs, int(mask_stride), 1 if causal else 0, int(causal_offset)


def attn_workspace_floats(n_head: int, head_dim: int, n_tokens: int, n_splits: int) -> int:
    """Floats of scratch that flash_attn_decode needs for n_splits > 1."""
    return n_tokens * n_head * n_splits * (head_dim + 2)


def choose_splits(n_head_kv: int, n_head: int, n_tokens: int, n_kv: int) -> int:
    """Split-KV count: about two waves of blocks, chunks of at least 64 keys."""
    g = n_head // n_head_kv
    ng = next(n for n in _ATTN_NG if n >= min(g, 8))
    base = n_head_kv * _cdiv(g, ng) * n_tokens
    want = _cdiv(2 * _sms(), max(1, base))
    return max(1, min(want, _cdiv(max(n_kv, 1), 64)))


def decode_splits(n_head_kv: int, n_head: int, n_tokens: int, n_kv: int,
                  n_splits: int | None = None) -> tuple[int, int]:
    """(n_splits, chunk) flash_attn_decode will use (chunk = keys per split)."""
    if n_splits is None:
        n_splits = choose_splits(n_head_kv, n_head, n_tokens, n_kv)
    n_splits = max(1, int(n_splits))
    chunk = max(1, _cdiv(max(n_kv, 1), n_splits))
    return max(1, _cdiv(max(n_kv, 1), chunk)), chunk


def flash_attn_decode(q, k, v, out, *, n_head: int, n_head_kv: int, head_dim: int,
                      n_tokens: int, n_kv: int, scale: float, mask=None, softcap: float = 0.0,
                      causal: bool = True, causal_offset: int | None = None,
                      n_splits: int | None = None, workspace=None, q_strides=None,
                      k_strides=None, v_strides=None, mask_stride: int | None = None,
                      kv_len=None) -> None:
    """Split-KV flash attention for a few query tokens (decode).

    ``q``: f32 [n_tokens, n_head, head_dim]; ``k``/``v``: cache [n_ctx, n_head_kv, head_dim]
    (float16, uint16 = bf16, or float32), first ``n_kv`` rows used; ``out``: f32
    [n_tokens, n_head, head_dim] contiguous. ``mask``: optional f32 [n_tokens, n_kv]
    (additive). ``causal``: key j visible to token t iff j <= t + causal_offset (default
    n_kv - n_tokens). ``kv_len``: optional int32 device scalar; keys at or beyond it are
    skipped. ``workspace``: f32 scratch of ``attn_workspace_floats`` (allocated when None
    and n_splits > 1). Strides: (head, row) in elements.
    """
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset)
    if n_tokens == 0:
        return
    g = n_head // n_head_kv
    ng = next(n for n in _ATTN_NG if n >= min(g, 8))
    n_qgroup = _cdiv(g, ng)
    n_splits, chunk = decode_splits(n_head_kv, n_head, n_tokens, n_kv, n_splits)
    nth = max(64, _cdiv(head_dim, 32) * 32)
    smem = 4 * (ng * head_dim + ng * nth + 3 * ng)
    if n_splits > 1:
        need = attn_workspace_floats(n_head, head_dim, n_tokens, n_splits)
        if workspace is None:
            workspace = _empty((need,), np.float32)
        elif workspace.size < need:
            raise ValueError(f"workspace has {workspace.size} floats, need {need}")
        _check_f32(workspace)
    launch("attn", f"attn_decode_{kvt}_g{ng}", (n_splits, n_head_kv * n_qgroup, n_tokens),
           (nth,),
           (q, k, v, mask, kv_len, out, workspace if n_splits > 1 else None, _i32(head_dim),
            _i32(n_head), _i32(n_head_kv), _i32(n_tokens), _i32(n_kv), _i32(qs[0]),
            _i32(qs[1]), _i32(ks[0]), _i32(ks[1]), _i32(vs[0]), _i32(vs[1]), _i32(ms),
            _i32(chunk), _f32(scale), _f32(softcap), _i32(c), _i32(co)),
           shared_mem=smem)
    if n_splits > 1:
        launch("attn", "attn_merge_f32", (n_head, n_tokens), (max(32, _cdiv(head_dim, 32) * 32),),
               (workspace, out, _i32(head_dim), _i32(n_head), _i32(n_tokens), _i32(n_splits)))


def flash_attn_prefill(q, k, v, out, *, n_head: int, n_head_kv: int, head_dim: int,
                       n_tokens: int, n_kv: int, scale: float, mask=None, softcap: float = 0.0,
                       causal: bool = True, causal_offset: int | None = None, q_strides=None,
                       k_strides=None, v_strides=None, mask_stride: int | None = None,
                       kv_len=None) -> None:
    """Flash attention tiled over queries (prefill); same arguments as flash_attn_decode."""
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset)
    if n_tokens == 0:
        return
    g = n_head // n_head_kv
    smem = 4 * (16 * head_dim + 32 * (head_dim + 1) + 16 * 32 + 48)
    launch("attn", f"attn_prefill_{kvt}", (_cdiv(n_tokens * g, 16), n_head_kv), (128,),
           (q, k, v, mask, kv_len, out, _i32(head_dim), _i32(n_head), _i32(n_head_kv),
            _i32(n_tokens), _i32(n_kv), _i32(qs[0]), _i32(qs[1]), _i32(ks[0]), _i32(ks[1]),
            _i32(vs[0]), _i32(vs[1]), _i32(ms), _f32(scale), _f32(softcap), _i32(c),
            _i32(co)),
           shared_mem=smem)


#: flash_attn uses the split-KV decode kernel up to this many query tokens.
ATTN_DECODE_MAX_TOKENS = 4


def flash_attn(q, k, v, out, **kw) -> None:
    """Decode kernel for n_tokens <= 4, prefill kernel otherwise."""
    if kw["n_tokens"] <= ATTN_DECODE_MAX_TOKENS:
        flash_attn_decode(q, k, v, out, **kw)
    else:
        kw.pop("n_splits", None)
        kw.pop("workspace", None)
        flash_attn_prefill(q, k, v, out, **kw)


# --------------------------------------------------------------------------- elementwise
def binary(op: str, a, b, out) -> None:
    """``out = a (op) b`` with ggml broadcasting of b (op: add, sub, mul, div), f32, <= 4-D.

    ``b`` is aligned to ``a`` from the innermost dim; each of its dims must be 1 or divide
    a's. Arbitrary strides for a, b and out (out may alias a).
    """
    if op not in ("add", "sub", "mul", "div"):
        raise ValueError(f"unknown binary op {op!r}")
    _check_f32(a, b, out)
    if tuple(out.shape) != tuple(a.shape):
        raise ValueError(f"out shape {out.shape} != a shape {a.shape}")
    ne, as_ = _nd(a)
    bne, bs = _nd(b)
    _, ys = _nd(out)
    for i in range(4):
        if bne[i] == 0 or ne[i] % bne[i]:
            raise ValueError(f"cannot broadcast b {b.shape} onto a {a.shape}")
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total == 0:
        return
    launch("elementwise", f"binary_{op}_f32", _grid1d(total), (_BLOCK_1D,),
           (a, b, out, *map(_i32, ne), *map(_i32, as_), *map(_i32, bne), *map(_i32, bs),
            *map(_i32, ys)))


def add(a, b, out) -> None:
    binary("add", a, b, out)


def sub(a, b, out) -> None:
    binary("sub", a, b, out)


def mul(a, b, out) -> None:
    binary("mul", a, b, out)


def div(a, b, out) -> None:
    binary("div", a, b, out)


def _check_contig(*arrays) -> None:
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")


def add_inplace(y, x) -> None:
    """``y += x`` (contiguous, same size). y f32 with x f32 or bf16 (uint16); or both bf16."""
    _check_contig(x, y)
    if x.size != y.size:
        raise ValueError("size mismatch")
    ty, tx = _act_type(y), _act_type(x)
    name = {("f32", "f32"): "add_inplace_f32", ("f32", "bf16"): "add_inplace_f32_bf16",
            ("bf16", "bf16"): "add_inplace_bf16"}.get((ty, tx))
    if name is None:
        raise TypeError(f"add_inplace: unsupported types y={ty} x={tx}")
    if y.size:
        launch("elementwise", name, _grid1d(y.size), (_BLOCK_1D,), (y, x, _i32(y.size)))


def unary(op: str, x, out, p0: float = 0.0, p1: float = 0.0) -> None:
    """``out = f(x)`` element-wise over strided <= 4-D f32 views (out may be x).

    op: scale (x*p0 + p1), silu, gelu (tanh approximation), sigmoid, softplus."""
    if op not in _UNARY_OPS:
        raise ValueError(f"unknown unary op {op!r}; have {_UNARY_OPS}")
    _check_f32(x, out)
    if tuple(x.shape) != tuple(out.shape):
        raise ValueError(f"shape mismatch {x.shape} vs {out.shape}")
    ne, xs = _nd(x)
    _, ys = _nd(out)
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total:
        launch("elementwise", f"unary_{op}_f32", _grid1d(total), (_BLOCK_1D,),
               (x, out, *map(_i32, ne), *map(_i32, xs), *map(_i32, ys), _f32(p0), _f32(p1)))


def scale(x, out, s: float, b: float = 0.0) -> None:
    """``out = x * s + b`` (out may be x)."""
    unary("scale", x, out, s, b)


def silu(x, out) -> None:
    unary("silu", x, out)


def gelu(x, out) -> None:
    unary("gelu", x, out)


def sigmoid(x, out) -> None:
    unary("sigmoid", x, out)


def softplus(x, out) -> None:
    unary("softplus", x, out)


def fill(y, value: float = 0.0) -> None:
    """Fill a contiguous f32 array."""
    _check_f32(y)
    _check_contig(y)
    if y.size:
        launch("elementwise", "fill_f32", _grid1d(y.size), (_BLOCK_1D,),
               (y, _i32(y.size), _f32(value)))


def _glu(name: str, gate, up, out) -> None:
    _check_f32(gate, up, out)
    ne0, n_rows, gs = _rows2d(gate)
    une0, un_rows, us = _rows2d(up)
    one0, on_rows, ys = _rows2d(out)
    if (une0, un_rows) != (ne0, n_rows) or (one0, on_rows) != (ne0, n_rows):
        raise ValueError("gate, up and out must have the same shape")
    if ne0 * n_rows:
        launch("elementwise", name, _grid1d(ne0 * n_rows), (_BLOCK_1D,),
               (gate, up, out, _i32(ne0), _i32(n_rows), _i32(gs), _i32(us), _i32(ys)))


def swiglu(gate, up, out) -> None:
    """``out = silu(gate) * up`` per row.

    Views of one fused tensor work: ``swiglu(x[:, :n], x[:, n:], out)``.
    """
    _glu("swiglu_f32", gate, up, out)


def geglu(gate, up, out) -> None:
    """``out = gelu_tanh(gate) * up`` per row."""
    _glu("geglu_f32", gate, up, out)


def soft_max(x, out, *, mask=None, scale: float = 1.0) -> None:
    """Row softmax of ``x * scale + mask[r % mask_rows]``; x/out (rows, ne0), mask (mask_rows, ne0)."""
    _check_f32(x, out, mask)
    ne0, n_rows, xs = _rows2d(x)
    _, _, ys = _rows2d(out)
    if mask is not None:
        mne0, mrows, ms = _rows2d(mask)
        if mne0 != ne0:
            raise ValueError("mask row length differs from x")
    else:
        mrows, ms = 1, 0
    if n_rows:
        launch("elementwise", "soft_max_f32", (n_rows,), (_row_block(ne0),),
               (x, mask, out, _i32(ne0), _i32(n_rows), _i32(xs), _i32(ms), _i32(ys),
                _i32(mrows), _f32(scale)))


def argmax(x, out) -> None:
    """``out[r] = argmax(x[r])`` (first index on ties); x f32 (rows, ne0), out int32 (rows,)."""
    _check_f32(x)
    _check_i32(out)
    ne0, n_rows, xs = _rows2d(x)
    if n_rows:
        launch("elementwise", "argmax_f32", (n_rows,), (_row_block(ne0),),
               (x, out, _i32(ne0), _i32(n_rows), _i32(xs)))


def top_k(x, out, k: int) -> None:
    """``out[r] = argsort(-x[r], stable)[:k]`` (int32); x f32 (rows, ne0), out (rows, k)."""
    _check_f32(x)
    _check_i32(out)
    ne0, n_rows, xs = _rows2d(x)
    kk, o_rows, ys = _rows2d(out)
    if not 0 < k <= min(ne0, _TOPK_MAX) or kk != k or o_rows != n_rows:
        raise ValueError(f"top_k: k={k} with x {x.shape}, out {out.shape} (k <= {_TOPK_MAX})")
    if n_rows:
        launch("elementwise", "top_k_f32", (n_rows,), (_row_block(ne0, 256),),
               (x, out, _i32(ne0), _i32(n_rows), _i32(k), _i32(xs), _i32(ys)))


def get_rows(src, qtype, idx, out, *, ne0: int, src_row_bytes: int | None = None,
             src_batch_bytes: tuple[int, int] = (0, 0)) -> None:
    """ggml GET_ROWS: ``out[i3, i2, i1] = dequant(src row idx[i3, i2, i1] of batch (i2, i3))``.

    ``src``: raw rows of a weight (any dtype, only the pointer is used) or an f32 array;
    ``src_row_bytes`` / ``src_batch_bytes`` (bytes per i2, i3 step) describe its layout.
    ``idx``: int32 (n,) or numpy order (ne3, ne2, n); ``out``: f32 (n, ne0) or (ne3, ne2, n, ne0).
    """
    t, qk, nbytes = _check_block_type(qtype, ne0)
    _check_f32(out)
    _check_i32(idx)
    if src_row_bytes is None:
        src_row_bytes = ne0 // qk * nbytes
    ine, is_ = _nd(idx)
    one, os_ = _nd(out)
    if one[0] != ne0 or one[1:] != ine[:3] or ine[3] != 1 or (ne0 > 1 and os_[0] != 1):
        raise ValueError(f"get_rows: idx {idx.shape} and out {out.shape} do not fit ne0={ne0}")
    n_idx, ne2, ne3 = ine[0], ine[1], ine[2]
    # 64-bit batch strides: a whole 2-D weight can exceed 2 GiB (a 128k x 8192 f16 embedding);
    # a stride over a dimension of size 1 is never used and goes as 0.
    sb2 = int(src_batch_bytes[0]) if ne2 > 1 else 0
    sb3 = int(src_batch_bytes[1]) if ne3 > 1 else 0
    units = ne0 // qk * (qk // _CHUNK_ELEMS[t]) * n_idx * ne2 * ne3
    if units:
        launch("elementwise", f"get_rows_{t}", _grid1d(units), (_BLOCK_1D,),
               (src, idx, out, _i32(ne0), _i32(n_idx), _i32(ne2), _i32(ne3),
                _i32(src_row_bytes), _i64(sb2), _i64(sb3),
                _i32(is_[0]), _i32(is_[1]), _i32(is_[2]), _i32(os_[1]), _i32(os_[2]),
                _i32(os_[3])))


def add_id(a, b, ids, out) -> None:
    """ggml ADD_ID: ``out[t, u] = a[t, u] + b[ids[t, u]]``; a/out f32 (T, n_used, ne0),
    b f32 (n_expert, ne0), ids int32 (T, n_used)."""
    _check_f32(a, b, out)
    _check_i32(ids)
    if a.ndim != 3 or b.ndim != 2 or ids.ndim != 2 or tuple(out.shape) != tuple(a.shape):
        raise ValueError(f"add_id: a {a.shape}, b {b.shape}, ids {ids.shape}, out {out.shape}")
    n_tok, n_used, ne0 = a.shape
    as_, bs, is_, ys = _estrides(a), _estrides(b), _estrides(ids), _estrides(out)
    if ne0 > 1 and (as_[2] != 1 or bs[1] != 1 or ys[2] != 1):
        raise ValueError("add_id: rows must be contiguous")
    if a.size:
        launch("elementwise", "add_id_f32", _grid1d(a.size), (_BLOCK_1D,),
               (a, b, ids, out, _i32(ne0), _i32(n_used), _i32(n_tok), _i32(as_[1]),
                _i32(as_[0]), _i32(bs[0]), _i32(is_[1]), _i32(is_[0]), _i32(ys[1]),
                _i32(ys[0])))


def copy(src, dst) -> None:
    """Strided <= 4-D copy ``dst[...] = src[...]`` with conversion between f32/f16/bf16(uint16)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shape mismatch {src.shape} vs {dst.shape}")
    ts, td = _act_type(src), _act_type(dst)
    if (ts, td) not in _CPY_PAIRS:
        raise TypeError(f"copy {ts} -> {td} is not supported")
    ne, ss = _nd(src)
    _, ds = _nd(dst)
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total:
        launch("elementwise", f"cpy_{ts}_{td}", _grid1d(total), (_BLOCK_1D,),
               (src, dst, *map(_i32, ne), *map(_i32, ss), *map(_i32, ds)))


def f32_to_bf16(x, out) -> None:
    """Contiguous f32 -> bf16 bits (uint16), round to nearest even (ggml)."""
    _check_f32(x)
    _check_contig(x, out)
    if _act_type(out) != "bf16":
        raise TypeError("out must be uint16 (bf16 bits)")
    if x.size:
        launch("elementwise", "f32_to_bf16", _grid1d(x.size), (_BLOCK_1D,),
               (x, out, _i32(x.size)))


def bf16_to_f32(x, out) -> None:
    """Contiguous bf16 bits (uint16) -> f32."""
    _check_f32(out)
    _check_contig(x, out)
    if _act_type(x) != "bf16":
        raise TypeError("x must be uint16 (bf16 bits)")
    if x.size:
        launch("elementwise", "bf16_to_f32", _grid1d(x.size), (_BLOCK_1D,),
               (x, out, _i32(x.size)))
