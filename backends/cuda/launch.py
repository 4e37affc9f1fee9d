"""Kernel sources, launch recording and the argument helpers every launcher uses.

The kernels are plain CUDA C with ``extern "C"`` entry points; every family (one ``.cu``
file) becomes one module compiled from source by the kernel engine in use (NVRTC through
CuPy on a GPU, `runtime.CupyRuntime`; host C++ on the CPU emulator of
`metatp.testing`). The engine is chosen by the caller, never by a global switch:
``with using(engine): ...`` makes every launcher inside the block use it (per thread).

A backend prepares a plan once and replays it, so launches can be *recorded*: inside
``recording()``, ``launch`` appends a :class:`Launch` (kernel, grid, block, typed args)
instead of running it, and ``Launch.frozen()`` swaps arrays for raw pointers. A captured
CUDA graph replays the same arguments, so per-step values (positions, KV length) are read
from device memory.

Programmatic dependent launch (the cupy backend's ``pdl`` option): an engine whose
``programmatic`` attribute is true launches every kernel that is *PDL-ready* with the programmatic
stream serialization attribute (`Launch.programmatic`; the engine's kernels take
``programmatic=True``), so it may start while the kernel before it still runs. A kernel is
PDL-ready when its body begins with ``mt_pdl_wait();`` (quant.cuh), read from the source
(`pdl_ready`): one that does not (a kernel added without it) is launched the ordinary way.

Scalars go to kernels as ``np.int32`` / ``np.int64`` / ``np.float32`` (a Python float given
to a ``float`` parameter would be passed as a double); an absent pointer as ``NULL`` (CuPy 13
passes ``None`` as a pointer to garbage).

Conventions (ggml): a weight has ``ne = [in, out]``, stored as ``out`` rows of ``in``
elements. An array holding a ggml tensor with ``ne = [a, b, c, d]`` has shape
``(d, c, b, a)``. f16 tensors are ``float16`` arrays, bf16 tensors ``uint16`` arrays holding
the bit patterns. Strides passed to kernels are in elements unless a name says ``bytes``.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

__all__ = [
    "FAMILIES", "MATVEC_MAX_TOKENS", "WEIGHT_TYPES", "KV_TYPES", "KV_QUANT_TYPES", "CACHE_TYPES", "CHUNK_ELEMS", "COMPILE_OPTIONS",
    "BLOCK_1D", "NULL", "KernelEngine", "cache_type_of",
    "kernel_sources", "module_source", "using", "current_engine", "get_kernel", "launch", "recording",
    "Launch", "pdl_ready", "device_ptr", "is_array", "empty", "sm_count",
    "i32", "i64", "f32", "cdiv", "grid1d", "wtype", "act_type", "estrides", "rows2d", "as4", "nd",
    "check_f32", "check_i32", "check_contig", "tail", "head_strides", "row_block", "check_block_type",
]

#: One CUDA source (and one module) per op family.
FAMILIES = ("dequant", "matvec", "qkv_rope", "mmq", "mmvq", "norm", "rope", "kv", "attn", "elementwise")

#: The few-token (decode-sized) path: the matvec kernels take up to this many tokens per launch
#: (llama.cpp's MMVQ_MAX_BATCH_SIZE; cuBLAS above), and fusions that keep an input alive or
#: pair two launches fire only up to it. Shared here so families need not import each other.
MATVEC_MAX_TOKENS = 8

#: ggml weight types the kernels read: name -> (elements per block, bytes per block).
WEIGHT_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
#: Float KV-cache storage types the cache kernels write and attention reads (an array's dtype says which).
KV_TYPES = ("f16", "bf16", "f32")
#: Quantized KV-cache types (uint8 blocks; the caller names the type): name -> (elements, bytes) per block.
KV_QUANT_TYPES: dict[str, tuple[int, int]] = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
                                              "q5_0": (32, 22), "q5_1": (32, 24)}
#: Every KV-cache type: K and V of one type each have their set_rows and attention entry points.
CACHE_TYPES = KV_TYPES + tuple(KV_QUANT_TYPES)
#: elements per chunk (one thread's unit of work) per weight type, as in quant.cuh
CHUNK_ELEMS = {"f32": 1, "f16": 1, "bf16": 1, "q8_0": 8, "q4_0": 8, "q4_1": 8, "q5_0": 8, "q5_1": 8,
                "q2_k": 8, "q3_k": 8, "q4_k": 8, "q5_k": 8, "q6_k": 8}

#: Options handed to NVRTC (CuPy adds -arch of the device, -ftz=true and its -std).
COMPILE_OPTIONS: tuple[str, ...] = ()

BLOCK_1D = 256
_MAX_GRID_1D = 65535 * 8  # grid-stride kernels: more blocks than this buy nothing

#: An absent (optional) pointer argument: NULL, as 8 bytes (never ``None``, see ``launch``).
NULL = np.uint64(0)


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
    for cand in (here.parent.parent / "cuda", here.parent / "cuda"):
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
    """Source of one family with local ``#include "x.cuh"`` lines pasted in (NVRTC gets the
    text only, no include path)."""
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


# --------------------------------------------------------------------------- engines
class KernelEngine(Protocol):
    """What launchers need from a device: compiled kernels, scratch arrays, the SM count."""

    def kernel(self, family: str, name: str) -> Any:
        """Kernel ``name`` of ``family`` on the current device (cached), called like a
        ``cupy.RawKernel``: ``k(grid, block, args, shared_mem=...)``."""

    def empty(self, shape, dtype) -> Any:
        ...

    def sm_count(self) -> int:
        ...


_scope = threading.local()


@contextlib.contextmanager
def using(engine: KernelEngine) -> Iterator[KernelEngine]:
    """Run every launcher inside the block on `engine` (this thread only; blocks nest)."""
    prev = getattr(_scope, "engine", None)
    _scope.engine = engine
    try:
        yield engine
    finally:
        _scope.engine = prev


def current_engine() -> KernelEngine:
    engine = getattr(_scope, "engine", None)
    if engine is None:
        raise RuntimeError("no kernel engine: launch kernels inside `with launch.using(runtime):` "
                           "(a backend's runtime.kernels() does this)")
    return engine


def get_kernel(family: str, name: str):
    """The kernel ``name`` of ``family`` for the current device of the current engine."""
    return current_engine().kernel(family, name)


def empty(shape, dtype):
    return current_engine().empty(shape, dtype)


def sm_count() -> int:
    return current_engine().sm_count()


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


def is_array(a) -> bool:
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
    programmatic: bool = False                    # with the programmatic stream serialization attribute

    def __call__(self) -> None:
        if self.programmatic:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem, programmatic=True)
        else:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem)

    def frozen(self) -> "Launch":
        """The same launch with arrays replaced by raw pointers (np.uint64): cheaper to replay.
        The arrays are kept alive by the Launch."""
        arrays = tuple(a for a in self.args if is_array(a))
        args = tuple(np.uint64(device_ptr(a)) if (a is None or is_array(a)) else a for a in self.args)
        return Launch(self.kernel, self.name, self.grid, self.block, args, self.shared_mem, self.keep + arrays,
                      self.programmatic)


_recorder = threading.local()


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
    record it inside ``recording()``; programmatically when the engine asks for it and the kernel
    is PDL-ready."""
    engine = current_engine()
    k = engine.kernel(family, name)
    if shared_mem > 48 * 1024 and k.max_dynamic_shared_size_bytes < shared_mem:
        k.max_dynamic_shared_size_bytes = int(shared_mem)
    # CuPy 13 passes a None argument as a pointer to garbage, not as NULL (fixed in 14.0):
    # every absent pointer goes to the kernel as an explicit 0.
    args = tuple(NULL if a is None else a for a in args)
    programmatic = bool(getattr(engine, "programmatic", False)) and pdl_ready(family, name)
    item = Launch(k, name, tuple(int(g) for g in grid), tuple(int(b) for b in block), args, int(shared_mem),
                  programmatic=programmatic)
    rec = getattr(_recorder, "launches", None)
    if rec is not None:
        rec.append(item)
    else:
        item()


# --------------------------------------------------------------------------- PDL-ready kernels
#: what a PDL-ready kernel's body begins with (quant.cuh): wait for the kernels before it
PDL_FIRST_STATEMENT = "mt_pdl_wait();"
_KERNEL_DEF_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?([\w#]+)\s*\(')
_DEFINE_RE = re.compile(r"[ \t]*#[ \t]*define[ \t]+\w+\(([^)]*)\)")
_COMMENTS_RE = re.compile(r"(?:\s+|//[^\n]*|/\*.*?\*/)*", re.DOTALL)
_pdl_cache: dict[str, tuple[list[re.Pattern[str]], list[re.Pattern[str]]]] = {}
_pdl_answers: dict[tuple[str, str], bool] = {}      # (family, kernel) -> pdl_ready


def _name_pattern(token: str, params: set[str]) -> re.Pattern[str]:
    """The entry-point names a kernel definition's name token makes: ``matvec_##name##_t##NT`` in
    a macro of parameters (name, W, NT) matches ``matvec_q4_0_t1``."""
    parts = token.split("##")
    return re.compile("".join(r"\w+" if p in params else re.escape(p) for p in parts))


def _body_start(text: str, open_paren: int) -> int:
    """Index just past the ``{`` that opens the body of the function whose parameter list opens at
    `open_paren`."""
    depth, i = 0, open_paren
    while True:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            break
    brace = text.index("{", i)
    if text[i:brace].strip():
        raise ValueError(f"unexpected text between a kernel's parameters and its body: {text[i:brace]!r}")
    return brace + 1


def kernel_definitions(source: str) -> list[tuple[re.Pattern[str], bool]]:
    """(names the definition makes, does its body begin with mt_pdl_wait()) for every
    ``extern "C" __global__`` definition of a CUDA source (macro definitions included)."""
    text = source.replace("\\\n", " ")          # a macro's continued lines as one logical line
    out = []
    for m in _KERNEL_DEF_RE.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        macro = _DEFINE_RE.match(text, line_start)
        params = {p.strip() for p in macro.group(1).split(",")} if macro else set()
        body = _body_start(text, m.end() - 1)
        first = _COMMENTS_RE.match(text, body).end()
        out.append((_name_pattern(m.group(1), params), text.startswith(PDL_FIRST_STATEMENT, first)))
    return out


def pdl_ready(family: str, name: str) -> bool:
    """May kernel `name` of `family` be launched programmatically: does every definition that can
    make this name begin with ``mt_pdl_wait();`` (and is there one)? Answered once a kernel (an eager
    step asks at every launch)."""
    known = _pdl_answers.get((family, name))
    if known is not None:
        return known
    defs = _pdl_cache.get(family)
    if defs is None:
        found = kernel_definitions(module_source(family))
        defs = _pdl_cache[family] = ([p for p, ok in found if ok], [p for p, ok in found if not ok])
    ready, not_ready = defs
    answer = _pdl_answers[(family, name)] = (any(p.fullmatch(name) for p in ready)
                                             and not any(p.fullmatch(name) for p in not_ready))
    return answer


# --------------------------------------------------------------------------- argument helpers
def i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise OverflowError(f"{v} does not fit in int32")
    return np.int32(v)


def i64(v) -> np.int64:
    v = int(v)
    if not -(2**63) <= v < 2**63:
        raise OverflowError(f"{v} does not fit in int64")
    return np.int64(v)


def f32(v) -> np.float32:
    return np.float32(v)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid1d(total: int, block: int = BLOCK_1D) -> tuple[int]:
    return (max(1, min(cdiv(int(total), block), _MAX_GRID_1D)),)


def wtype(qtype) -> str:
    """Normalise a weight type: 'Q4_0', 'q4_0', GGMLQuantizationType.Q4_0, ... -> 'q4_0'."""
    name = str(getattr(qtype, "name", qtype)).lower()
    if name not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {qtype!r}; supported: {sorted(WEIGHT_TYPES)}")
    return name


def check_block_type(qtype, ne0: int) -> tuple[str, int, int]:
    """(type name, elements per block, bytes per block), ne0 checked to be whole blocks."""
    t = wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    return t, qk, nbytes


def act_type(a) -> str:
    """Storage type of an activation / cache array: 'f32', 'f16' or 'bf16' (uint16 bits)."""
    name = np.dtype(a.dtype).name
    if name == "float32":
        return "f32"
    if name == "float16":
        return "f16"
    if name in ("uint16", "bfloat16"):
        return "bf16"
    raise TypeError(f"unsupported dtype {name} (want float32, float16 or uint16/bfloat16 for bf16)")


def cache_type_of(a, given: str | None = None) -> str:
    """Storage type of a KV-cache array: its dtype's for float storage; a quantized cache (uint8
    blocks) must be named by `given`, one of KV_QUANT_TYPES."""
    if np.dtype(a.dtype) == np.uint8:
        if given not in KV_QUANT_TYPES:
            raise TypeError(f"a uint8 cache needs its quantized type named (one of {', '.join(KV_QUANT_TYPES)}), "
                            f"got {given!r}")
        return given
    t = act_type(a)
    if given is not None and given != t:
        raise TypeError(f"cache array of type {t} given as {given!r}")
    return t


def estrides(a) -> tuple[int, ...]:
    """Element strides of an array (numpy order)."""
    isz = a.dtype.itemsize
    out = []
    for s in a.strides:
        if s % isz:
            raise ValueError(f"stride {s} is not a multiple of the item size {isz}")
        out.append(s // isz)
    return tuple(out)


def rows2d(a, ne0: int | None = None, n_rows: int | None = None,
           row_stride: int | None = None) -> tuple[int, int, int]:
    """(ne0, n_rows, row_stride) of an array seen as rows of contiguous elements: the innermost
    dim is the row; all leading dims must collapse into one evenly spaced row index (size-1
    dims are ignored). Explicit arguments win."""
    shape = tuple(a.shape)
    if not shape:
        raise ValueError("expected an array with at least one dimension")
    st = estrides(a)
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


def as4(shape, strides) -> tuple[list[int], list[int]]:
    """numpy-order shape/strides (<= 4 dims) -> ggml ne[0..3], s[0..3]."""
    if len(shape) > 4:
        raise ValueError("at most 4 dimensions")
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    s = list(reversed(strides)) + [0] * (4 - len(strides))
    for i in range(4):
        if ne[i] == 1:
            s[i] = 0
    return ne, s


def nd(a) -> tuple[list[int], list[int]]:
    """ggml (ne[0..3], element strides[0..3]) of an array."""
    return as4(a.shape, estrides(a))


def check_f32(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype != np.float32:
            raise TypeError(f"expected float32, got {a.dtype}")


def check_i32(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype != np.int32:
            raise TypeError(f"expected int32 indices, got {a.dtype}")


def check_contig(*arrays) -> None:
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")


def tail(a, rows: int, row_stride: int):
    """View of ``a`` starting ``rows`` rows (of row_stride elements) in (no copy)."""
    if rows == 0:
        return a
    if a.ndim == 2:
        if a.shape[0] > 1 and estrides(a)[0] != row_stride:
            raise ValueError("token stride differs from the array's row stride")
        return a[rows:]
    if a.ndim == 1:
        return a[rows * row_stride:]
    raise ValueError("expected a 1-D or 2-D array")

def head_strides(a, head_dim: int, n_head: int, given) -> tuple[int, int]:
    """(head stride, token/row stride) in elements of a [tokens, heads, head_dim] tensor."""
    if given is not None:
        return int(given[0]), int(given[1])
    st = estrides(a)
    if a.ndim >= 1 and a.shape[-1] > 1 and st[-1] != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if a.ndim == 3:
        return st[1], st[0]
    if a.ndim == 2:
        return head_dim, st[0]
    return head_dim, head_dim * n_head


def row_block(ne0: int, cap: int = 1024) -> int:
    return max(32, min(cap, cdiv(max(1, ne0 // 4), 32) * 32))
