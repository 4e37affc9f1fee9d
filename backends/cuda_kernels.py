"""Loader and launch helpers for metatp's CUDA kernels (``cuda/*.cu``).

The kernels are plain CUDA C with ``extern "C"`` entry points; every family (one ``.cu``
file) becomes one ``cupy.RawModule`` compiled by NVRTC from source, once per device, and
cached. The Python functions below take CuPy arrays plus Python ints/floats, convert the
scalars to ``np.int32`` / ``np.float32`` (a Python float given to a ``float`` parameter
would be passed as a double), pick grid/block, and launch on the current stream of the
current device.

Importing this module needs neither CuPy nor a GPU; CuPy is imported on first use.

Conventions (ggml): a weight has ``ne = [in, out]``, stored as ``out`` rows of ``in``
elements (each row a sequence of quant blocks). In CuPy a ggml tensor with
``ne = [a, b, c, d]`` is an array of shape ``(d, c, b, a)``. f16 tensors are
``float16`` arrays, bf16 tensors are ``uint16`` arrays holding the bit patterns.
Strides passed to kernels are in elements unless a name says ``bytes``.
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FAMILIES",
    "WEIGHT_TYPES",
    "gpu_available",
    "kernel_sources",
    "module_source",
    "expected_entry_points",
    "get_kernel",
    "launch",
    "compile_all",
    "dequantize",
    "matvec",
    "rms_norm",
    "rope",
    "set_rows",
    "flash_attn_decode",
    "flash_attn_prefill",
    "flash_attn",
    "binary",
    "add",
    "sub",
    "mul",
    "div",
    "add_inplace",
    "scale",
    "fill",
    "silu",
    "gelu",
    "swiglu",
    "geglu",
    "soft_max",
    "argmax",
    "get_rows",
    "copy",
    "f32_to_bf16",
    "bf16_to_f32",
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

_MATVEC_NT = (1, 2, 4, 8)
_ATTN_NG = (1, 2, 4, 8)
_KV_TYPES = ("f16", "bf16", "f32")
_CPY_PAIRS = (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"),
              ("f32", "bf16"), ("bf16", "f32"))

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
        "matvec": [f"matvec_{t}_t{n}" for t in wt for n in _MATVEC_NT],
        "norm": ["rms_norm_f32"],
        "rope": ["rope_norm_f32", "rope_neox_f32"],
        "kv": [f"set_rows_f32_{t}" for t in _KV_TYPES],
        "attn": [f"attn_decode_{t}_g{g}" for t in _KV_TYPES for g in _ATTN_NG]
        + ["attn_merge_f32"]
        + [f"attn_prefill_{t}" for t in _KV_TYPES],
        "elementwise": [f"binary_{op}_f32" for op in ("add", "sub", "mul", "div")]
        + ["add_inplace_f32", "add_inplace_f32_bf16", "add_inplace_bf16", "scale_f32",
           "fill_f32", "silu_f32", "gelu_f32", "swiglu_f32", "geglu_f32", "soft_max_f32",
           "argmax_f32"]
        + [f"get_rows_{t}" for t in wt]
        + [f"cpy_{a}_{b}" for a, b in _CPY_PAIRS]
        + ["f32_to_bf16", "bf16_to_f32"],
    }


# --------------------------------------------------------------------------- cupy
def _cupy():
    import cupy  # noqa: PLC0415 - lazy on purpose

    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA install
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, str, int], Any] = {}
_sm_count: dict[int, int] = {}
_smem_set: dict[tuple[str, str, int], int] = {}


def _device_id() -> int:
    return int(_cupy().cuda.runtime.getDevice())


def _module(family: str, dev: int):
    key = (family, dev)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                cp = _cupy()
                mod = cp.RawModule(code=module_source(family), options=COMPILE_OPTIONS)
                _modules[key] = mod
    return mod


def get_kernel(family: str, name: str):
    """The ``cupy.RawKernel`` ``name`` of ``family`` for the current device (cached)."""
    dev = _device_id()
    key = (family, name, dev)
    k = _functions.get(key)
    if k is None:
        k = _module(family, dev).get_function(name)
        _functions[key] = k
    return k


def launch(family: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch a kernel on the current stream (grid/block tuples, args already typed)."""
    k = get_kernel(family, name)
    if shared_mem > 48 * 1024:
        key = (family, name, _device_id())
        if _smem_set.get(key, 0) < shared_mem:
            k.max_dynamic_shared_size_bytes = int(shared_mem)
            _smem_set[key] = int(shared_mem)
    k(tuple(int(g) for g in grid), tuple(int(b) for b in block), tuple(args),
      shared_mem=int(shared_mem))


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
    dev = _device_id()
    n = _sm_count.get(dev)
    if n is None:
        cp = _cupy()
        try:
            n = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
        except Exception:  # noqa: BLE001
            n = 80
        _sm_count[dev] = n
    return n


# --------------------------------------------------------------------------- helpers
def _i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise OverflowError(f"{v} does not fit in int32")
    return np.int32(v)


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


def _check_f32(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype != np.float32:
            raise TypeError(f"expected float32, got {a.dtype}")


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


def matvec(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None,
           w_row_bytes: int | None = None, x_stride: int | None = None,
           y_stride: int | None = None) -> None:
    """``y[t, r] = sum_i W[r, i] * x[t, i]`` for a few tokens (decode; any count works,
    launched 8 tokens at a time).

    ``w``: raw weight bytes, row r at ``r * w_row_bytes`` (default: packed rows of ne0).
    ``x``: float32 (n_tokens, ne0) or (ne0,); ``y``: float32 (n_tokens, n_rows) or (n_rows,).
    Token strides (elements) default to the arrays' leading strides.
    """
    t = _wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    _check_f32(x, y)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if x_stride is None:
        x_stride = _estrides(x)[0] if x.ndim == 2 else ne0
    if y_stride is None:
        y_stride = _estrides(y)[0] if y.ndim == 2 else n_rows
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
    for t0 in range(0, n_tokens, 8):
        nt = min(8, n_tokens - t0)
        nt_k = next(n for n in _MATVEC_NT if n >= nt)
        xa = _tail(x, t0, x_stride)
        ya = _tail(y, t0, y_stride)
        launch("matvec", f"matvec_{t}_t{nt_k}", grid, (bx, by),
               (w, xa, ya, _i32(ne0), _i32(n_rows), _i32(w_row_bytes), _i32(nt),
                _i32(x_stride), _i32(y_stride)))


# --------------------------------------------------------------------------- norm
def _row_block(ne0: int, cap: int = 1024) -> int:
    return max(32, min(cap, _cdiv(max(1, ne0 // 4), 32) * 32))


def rms_norm(x, y, *, eps: float, weight=None, ne0: int | None = None,
             n_rows: int | None = None, x_row_stride: int | None = None,
             y_row_stride: int | None = None) -> None:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` per row of ne0 (weight None: no multiply)."""
    _check_f32(x, y, weight)
    ne0, n_rows, x_row_stride = _rows2d(x, ne0, n_rows, x_row_stride)
    if y_row_stride is None:
        y_row_stride = _rows2d(y, ne0, n_rows)[2]
    if n_rows == 0:
        return
    launch("norm", "rms_norm_f32", (n_rows,), (_row_block(ne0),),
           (x, weight, y, _i32(ne0), _i32(n_rows), _i32(x_row_stride), _i32(y_row_stride),
            _f32(eps)))


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
         attn_factor: float = 1.0, x_strides=None, y_strides=None) -> None:
    """RoPE on f32 ``x`` [n_tokens, n_head, head_dim] (numpy order) into ``y`` (may be x).

    ``pos``: int32 [n_tokens]. ``x_strides``/``y_strides``: (head stride, token stride) in
    elements; default from 3-D arrays, else contiguous. ``neox``: rotate halves.
    """
    _check_f32(x, y, freq_factors)
    if pos.dtype != np.int32:
        raise TypeError("pos must be int32")
    if head_dim % 2 or n_dims % 2 or n_dims > head_dim:
        raise ValueError("head_dim and n_dims must be even and n_dims <= head_dim")
    xs1, xs2 = _head_strides(x, head_dim, n_head, x_strides)
    ys1, ys2 = _head_strides(y, head_dim, n_head, y_strides)
    total = head_dim // 2 * n_head * n_tokens
    if total == 0:
        return
    launch("rope", "rope_neox_f32" if neox else "rope_norm_f32", _grid1d(total), (_BLOCK_1D,),
           (x, y, pos, freq_factors, _i32(head_dim), _i32(n_head), _i32(n_tokens),
            _i32(n_dims), _i32(xs1), _i32(xs2), _i32(ys1), _i32(ys2), _f32(freq_base),
            _f32(freq_scale), _f32(attn_factor)))


# --------------------------------------------------------------------------- kv
def set_rows(src, dst, idx, *, ne0: int | None = None, n_rows: int | None = None,
             src_row_stride: int | None = None, dst_row_stride: int | None = None) -> None:
    """``dst[idx[r], :ne0] = src[r, :ne0]`` converting f32 to dst's type (f16/bf16/f32)."""
    _check_f32(src)
    if idx.dtype != np.int32:
        raise TypeError("idx must be int32")
    ne0, n_src_rows, src_row_stride = _rows2d(src, ne0, None, src_row_stride)
    if n_rows is None:
        n_rows = int(idx.size)
    if n_rows > idx.size or (src.ndim > 1 and n_rows > n_src_rows):
        raise ValueError(f"n_rows={n_rows} exceeds idx ({idx.size}) or src rows ({n_src_rows})")
    if dst_row_stride is None:
        dst_row_stride = _rows2d(dst)[2] if dst.ndim > 1 else ne0
    out = _act_type(dst)
    if n_rows == 0 or ne0 == 0:
        return
    launch("kv", f"set_rows_f32_{out}", _grid1d(ne0 * n_rows), (_BLOCK_1D,),
           (src, dst, idx, _i32(ne0), _i32(n_rows), _i32(src_row_stride),
            _i32(dst_row_stride)))


# --------------------------------------------------------------------------- attention
def _kv_strides(a, head_dim: int, n_head_kv: int, given):
    return _head_strides(a, head_dim, n_head_kv, given)


def _attn_common(q, k, v, out, mask, n_head, n_head_kv, head_dim, n_tokens, n_kv,
                 q_strides, k_strides, v_strides, mask_stride, causal, causal_offset):
    _check_f32(q, out, mask)
    kvt = _act_type(k)
    if _act_type(v) != kvt:
        raise TypeError("k and v must have the same type")
    if n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_head_kv={n_head_kv}")
    if head_dim > 256:
        raise ValueError("head_dim > 256 is not supported")
    qs = _head_strides(q, head_dim, n_head, q_strides)
    ks = _kv_strides(k, head_dim, n_head_kv, k_strides)
    vs = _kv_strides(v, head_dim, n_head_kv, v_strides)
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


def flash_attn_decode(q, k, v, out, *, n_head: int, n_head_kv: int, head_dim: int,
                      n_tokens: int, n_kv: int, scale: float, mask=None, softcap: float = 0.0,
                      causal: bool = True, causal_offset: int | None = None,
                      n_splits: int | None = None, workspace=None, q_strides=None,
                      k_strides=None, v_strides=None, mask_stride: int | None = None) -> None:
    """Split-KV flash attention for a few query tokens (decode).

    ``q``: f32 [n_tokens, n_head, head_dim]; ``k``/``v``: cache [n_ctx, n_head_kv, head_dim]
    (float16, uint16 = bf16, or float32), first ``n_kv`` rows used; ``out``: f32
    [n_tokens, n_head, head_dim] contiguous. ``mask``: optional f32 [n_tokens, n_kv]
    (additive). ``causal``: key j visible to token t iff j <= t + causal_offset (default
    n_kv - n_tokens). ``workspace``: f32 scratch of ``attn_workspace_floats`` (allocated
    when None and n_splits > 1). Strides: (head, row) in elements.
    """
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset)
    if n_tokens == 0:
        return
    g = n_head // n_head_kv
    ng = next(n for n in _ATTN_NG if n >= min(g, 8))
    n_qgroup = _cdiv(g, ng)
    if n_splits is None:
        n_splits = choose_splits(n_head_kv, n_head, n_tokens, n_kv)
    n_splits = max(1, int(n_splits))
    chunk = max(1, _cdiv(max(n_kv, 1), n_splits))
    n_splits = max(1, _cdiv(max(n_kv, 1), chunk))
    nth = max(64, _cdiv(head_dim, 32) * 32)
    smem = 4 * (ng * head_dim + ng * nth + 3 * ng)
    if n_splits > 1:
        need = attn_workspace_floats(n_head, head_dim, n_tokens, n_splits)
        if workspace is None or workspace.size < need:
            if workspace is not None:
                raise ValueError(f"workspace has {workspace.size} floats, need {need}")
            workspace = _cupy().empty((need,), dtype=np.float32)
        _check_f32(workspace)
    launch("attn", f"attn_decode_{kvt}_g{ng}", (n_splits, n_head_kv * n_qgroup, n_tokens),
           (nth,),
           (q, k, v, mask, out, workspace if n_splits > 1 else None, _i32(head_dim),
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
                       k_strides=None, v_strides=None, mask_stride: int | None = None) -> None:
    """Flash attention tiled over queries (prefill); same arguments as flash_attn_decode."""
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset)
    if n_tokens == 0:
        return
    g = n_head // n_head_kv
    smem = 4 * (16 * head_dim + 32 * (head_dim + 1) + 16 * 32 + 48)
    launch("attn", f"attn_prefill_{kvt}", (_cdiv(n_tokens * g, 16), n_head_kv), (128,),
           (q, k, v, mask, out, _i32(head_dim), _i32(n_head), _i32(n_head_kv),
            _i32(n_tokens), _i32(n_kv), _i32(qs[0]), _i32(qs[1]), _i32(ks[0]), _i32(ks[1]),
            _i32(vs[0]), _i32(vs[1]), _i32(ms), _f32(scale), _f32(softcap), _i32(c),
            _i32(co)),
           shared_mem=smem)


def flash_attn(q, k, v, out, **kw) -> None:
    """Decode kernel for n_tokens <= 4, prefill kernel otherwise."""
    if kw["n_tokens"] <= 4:
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
    ne, as_ = _as4(a.shape, _estrides(a))
    bne, bs = _as4(b.shape, _estrides(b))
    _, ys = _as4(out.shape, _estrides(out))
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


def scale(x, out, s: float, b: float = 0.0) -> None:
    """``out = x * s + b`` (contiguous f32; out may be x)."""
    _check_f32(x, out)
    _check_contig(x, out)
    if x.size:
        launch("elementwise", "scale_f32", _grid1d(x.size), (_BLOCK_1D,),
               (x, out, _i32(x.size), _f32(s), _f32(b)))


def fill(y, value: float = 0.0) -> None:
    """Fill a contiguous f32 array."""
    _check_f32(y)
    _check_contig(y)
    if y.size:
        launch("elementwise", "fill_f32", _grid1d(y.size), (_BLOCK_1D,),
               (y, _i32(y.size), _f32(value)))


def _unary(name: str, x, out) -> None:
    _check_f32(x, out)
    _check_contig(x, out)
    if x.size:
        launch("elementwise", name, _grid1d(x.size), (_BLOCK_1D,), (x, out, _i32(x.size)))


def silu(x, out) -> None:
    _unary("silu_f32", x, out)


def gelu(x, out) -> None:
    _unary("gelu_f32", x, out)


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
    if out.dtype != np.int32:
        raise TypeError("out must be int32")
    ne0, n_rows, xs = _rows2d(x)
    if n_rows:
        launch("elementwise", "argmax_f32", (n_rows,), (_row_block(ne0),),
               (x, out, _i32(ne0), _i32(n_rows), _i32(xs)))


def get_rows(src, qtype, idx, out, *, ne0: int, src_row_bytes: int | None = None,
             dst_row_stride: int | None = None) -> None:
    """``out[r] = dequant(src row idx[r])``; out f32 (n_idx, ne0), idx int32."""
    t = _wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    _check_f32(out)
    if idx.dtype != np.int32:
        raise TypeError("idx must be int32")
    if src_row_bytes is None:
        src_row_bytes = ne0 // qk * nbytes
    if dst_row_stride is None:
        dst_row_stride = _rows2d(out)[2] if out.ndim > 1 else ne0
    n_idx = int(idx.size)
    units = ne0 // qk * (qk // _CHUNK_ELEMS[t]) * n_idx
    if units:
        launch("elementwise", f"get_rows_{t}", _grid1d(units), (_BLOCK_1D,),
               (src, idx, out, _i32(ne0), _i32(n_idx), _i32(src_row_bytes),
                _i32(dst_row_stride)))


def copy(src, dst) -> None:
    """Strided <= 4-D copy ``dst[...] = src[...]`` with conversion between f32/f16/bf16(uint16)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shape mismatch {src.shape} vs {dst.shape}")
    ts, td = _act_type(src), _act_type(dst)
    if (ts, td) not in _CPY_PAIRS:
        raise TypeError(f"copy {ts} -> {td} is not supported")
    ne, ss = _as4(src.shape, _estrides(src))
    _, ds = _as4(dst.shape, _estrides(dst))
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
