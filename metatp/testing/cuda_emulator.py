"""A CPU emulator of metatp's CUDA kernels, for tests on machines without a GPU.

The same `cuda/*.cu` sources are compiled as host C++ by g++ (one fiber per CUDA thread,
`__syncthreads` and warp shuffles emulated) and launched on numpy arrays through ctypes. It
refuses what a real launch would refuse (block/grid limits, a block above the kernel's
``__launch_bounds__``, shared memory, argument C types, and a ``None`` pointer, which CuPy 13 would
pass as garbage), and what a GPU faults on: a load, store or atomic through a typed pointer at an
address that is not a multiple of the type's alignment (CUDA's: 2 for 16-bit types, 4 for int and
float, 8 for uint2 / float2, 16 for uint4 / float4), checked on every access by g++'s
``-fsanitize=alignment`` and raised as cudaErrorMisalignedAddress naming the kernel, the address,
the thread and the source line (sticky through `EmuRuntime`, as on a GPU). So a kernel that passes
here has had its logic, its launch contract and its alignment checked. Still only a GPU shows:
memory ordering and races, registers (a block the registers do not allow: checked from ptxas's
report by ``tests/cuda/test_cuda_compile.py``, not at launch here), and speed. An `Emulator` is a
kernel engine: ``with launch.using(Emulator()):`` runs the launchers on it, and `EmuRuntime` (the
emulated device API the backend is tested with) brings one.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import operator
import os
import re
import shutil
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from metatp.backends.cuda.kernels import expected_entry_points
from metatp.backends.cuda.launch import device_ptr, is_array, module_source
from metatp.testing.emulated_faults import EmulatedCudaError
from metatp.testing.emulator_cxx import LAUNCHER, PRELUDE

__all__ = ["Emulator", "compile_family", "emulator_available", "launch_bounds"]


#: Emulator.block_order -> the launcher's order code
_BLOCK_ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}

_SHARED_EXTERN_RE = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def _host_source(src: str, entries) -> str:
    """CUDA source text (includes expanded) as host C++ with trampolines for `entries`."""
    src = _SHARED_EXTERN_RE.sub(lambda m: f"#define {m.group(2)} (({m.group(1)}*)mt_emu::dyn_smem)", src)
    src = re.sub(r"\b__shared__\b", "static", src)
    tramps = "\n".join(
        f'extern "C" void mt_tramp_{n}(void** a) {{ mt_emu::invoke(&{n}, a); }}\n'
        f'extern "C" const char* mt_sig_{n}() {{ return mt_emu::sig(&{n}); }}'
        for n in entries)
    return PRELUDE + src + LAUNCHER + tramps + "\n"


def emulator_available() -> bool:
    """True when a host C++ compiler for the emulator is on PATH."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


_lock = threading.RLock()
# -z defs: a symbol the library needs and nobody defines (a sanitizer handler) fails the build, not the load
# -U_FORTIFY_SOURCE: the fibers _longjmp between their stacks (glibc's __longjmp_chk would refuse it)
_EMU_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off", "-w",
              "-Wl,-z,defs", "-U_FORTIFY_SOURCE")
# compile-only: the alignment check of every typed access (handled by the prelude; no libubsan)
_EMU_CHECKS = ("-fsanitize=alignment",)


def _build(name: str, host_source: str) -> Path:
    """The shared library of `host_source` (compiled once, cached by source hash)."""
    from metatp.backends.host_build import build_shared_library, host_cache_dir

    return build_shared_library(name, host_source, ".cpp", os.environ.get("CXX", "g++"), _EMU_FLAGS,
                                host_cache_dir("METATP_EMU_CACHE", "metatp-emu"), compile_flags=_EMU_CHECKS)


def compile_family(family: str) -> Path:
    """The shared library of one family (compiled once, cached by source hash): what a test
    session builds ahead, in parallel, before its tests load it."""
    return _built_family(family, module_source(family))[0]


@functools.lru_cache(maxsize=32)
def _built_family(family: str, cuda_source: str) -> tuple[Path, tuple[str, ...], dict[str, int]]:
    """A family's library, the lines of the host C++ it was built from (to quote a faulting line)
    and its kernels' launch bounds; once per process and source text."""
    host = _host_source(cuda_source, expected_entry_points()[family])
    try:
        path = _build(family, host)
    except RuntimeError as e:
        raise RuntimeError(f"emulator build of {family}.cu failed: {e}") from None
    return path, tuple(host.splitlines()), launch_bounds(cuda_source)


_BOUNDS_MARK = "__mt_launch_bounds__"
_BOUNDS_RE = re.compile(_BOUNDS_MARK + r"\s*\(((?:[^()]|\([^()]*\))*)\)\s*(\w+)\s*\(")


@functools.lru_cache(maxsize=64)
def launch_bounds(cuda_source: str) -> dict[str, int]:
    """Each kernel's ``__launch_bounds__`` maximum of threads a block, from CUDA source text (no
    includes): the source is run through the C preprocessor with the macro defined as a marker, so
    bounds given by a macro and entry names pasted by one come out as the GPU compiler sees them."""
    cmd = [os.environ.get("CXX", "g++"), "-E", "-P", "-x", "c++",
           f"-D__launch_bounds__(...)={_BOUNDS_MARK}(__VA_ARGS__)", "-"]
    r = subprocess.run(cmd, input=cuda_source, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"preprocessing for __launch_bounds__ failed:\n{r.stderr[-2000:]}")
    return {name: _int_expression(args.split(",")[0], name) for args, name in _BOUNDS_RE.findall(r.stdout)}


def _int_expression(text: str, kernel: str) -> int:
    """The value of a preprocessed integer constant expression (literals, + - * / % and parentheses)."""
    text = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", text.strip())
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(unreadable)

    unreadable = f"{kernel}: __launch_bounds__({text}) is not an integer expression the emulator reads"
    try:
        return value(ast.parse(text, mode="eval").body)
    except SyntaxError:
        raise ValueError(unreadable) from None


class _EmuKernel:
    """A kernel of the emulator, called like cupy.RawKernel."""

    def __init__(self, emu: "Emulator", lib, name: str, source_lines: Sequence[str] = (),
                 max_threads: int | None = None) -> None:
        self.emu = emu
        self.name = name
        self.max_threads = max_threads          # __launch_bounds__ (None: none given)
        self._source_lines = source_lines        # the host C++ it was compiled from (to quote a faulting line)
        self._tramp = ctypes.cast(getattr(lib, f"mt_tramp_{name}"), ctypes.c_void_p)
        sig_fn = getattr(lib, f"mt_sig_{name}")
        sig_fn.restype = ctypes.c_char_p
        self.signature = sig_fn().decode()
        self._launch = lib.mt_emu_launch
        self._launch.restype = ctypes.c_int
        self._pdl_waits = lib.mt_emu_pdl_waits
        self._pdl_waits.restype = ctypes.c_long
        self.max_dynamic_shared_size_bytes = 0

    def _convert(self, args) -> list:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.signature)} parameters")
        out = []
        for i, (a, kind) in enumerate(zip(args, self.signature)):
            if kind == "p":
                if a is None:       # CuPy 13 turns None into a pointer to garbage, not NULL
                    raise TypeError(f"{self.name}: argument {i} is None; pass np.uint64(0) for an absent "
                                    "pointer (CuPy 13 does not pass None as NULL)")
                if not (is_array(a) or isinstance(a, np.uint64)):
                    raise TypeError(f"{self.name}: argument {i} must be an array or pointer, got {type(a).__name__}")
                out.append(ctypes.c_uint64(int(a) if isinstance(a, np.uint64) else device_ptr(a)))
            elif kind == "i":
                if not isinstance(a, np.int32):
                    raise TypeError(f"{self.name}: argument {i} must be np.int32, got {type(a).__name__}")
                out.append(ctypes.c_int32(int(a)))
            elif kind == "l":
                if not isinstance(a, np.int64):
                    raise TypeError(f"{self.name}: argument {i} must be np.int64, got {type(a).__name__}")
                out.append(ctypes.c_int64(int(a)))
            elif kind == "f":
                if not isinstance(a, np.float32):
                    raise TypeError(f"{self.name}: argument {i} must be np.float32, got {type(a).__name__}")
                out.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"{self.name}: parameter {i} has a type the emulator cannot pass")
        return out

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None, programmatic: bool = False) -> None:
        """Launch as ``cupy.RawKernel`` does; `programmatic`: with the programmatic stream serialization
        attribute (what the pdl option's cuLaunchKernelEx sets), recorded in the emulator's
        `programmatic` count, and refused at run time unless every thread called mt_pdl_wait()."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        self._check_launch_bounds(block)
        if shared_mem > 48 * 1024 and shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of dynamic shared memory need "
                               "max_dynamic_shared_size_bytes raised first")
        if shared_mem > 227 * 1024:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of shared memory exceed the device limit")
        vals = self._convert(args)
        self.emu.dispatch(lambda: self._run(grid, block, vals, shared_mem, programmatic))

    def _run(self, grid, block, vals, shared_mem, programmatic: bool = False) -> None:
        if self.emu.before_launch is not None:        # a test's injected fault (EmuRuntime.inject)
            self.emu.before_launch(self.name)
        ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        err = ctypes.create_string_buffer(512)
        order, seed = self.emu.next_block_order()
        rc = self._launch(self._tramp, ptrs, *(ctypes.c_uint(g) for g in grid), *(ctypes.c_uint(b) for b in block),
                          ctypes.c_ulong(shared_mem), ctypes.c_int(order), ctypes.c_ulonglong(seed), err,
                          ctypes.c_int(len(err)))
        if rc == 4:
            raise EmulatedCudaError(716, f"{self.name}: {self._quote(err.value.decode())}")
        if rc != 0:
            raise RuntimeError(f"{self.name}: {err.value.decode()}")
        if programmatic:
            self._check_programmatic(grid, block)

    def _check_launch_bounds(self, block) -> None:
        """A block larger than the kernel's __launch_bounds__ is refused by the driver, as CuPy
        raises it at the launch (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES; the context stays usable)."""
        threads = int(np.prod(block))
        if self.max_threads is not None and self.max_threads < threads <= 1024:
            raise EmulatedCudaError(701, f"{self.name}: a block of {threads} threads, more than its "
                                         f"__launch_bounds__({self.max_threads})")

    def _quote(self, report: str) -> str:
        """The misaligned-access report with the source line it names ("line N: ...")."""
        m = re.match(r"line (\d+): ", report)
        if m is None or not 0 < int(m.group(1)) <= len(self._source_lines):
            return report
        return f"{report[m.end():]}, at `{self._source_lines[int(m.group(1)) - 1].strip()}`"

    def _check_programmatic(self, grid, block) -> None:
        """A kernel launched programmatically may start before its predecessor ends: each of its
        threads must have waited (mt_pdl_wait) before touching what other kernels write."""
        threads = int(np.prod(grid)) * int(np.prod(block))
        waits = int(self._pdl_waits())
        if waits != threads:
            raise RuntimeError(f"{self.name}: launched with programmatic stream serialization, but {waits} "
                               f"mt_pdl_wait() calls for {threads} threads (each thread must wait once, "
                               "before any early return)")
        self.emu.programmatic[self.name] += 1


class _EmuModule:
    def __init__(self, emu: "Emulator", lib, source_lines: Sequence[str], bounds: dict[str, int]) -> None:
        self.emu = emu
        self.lib = lib
        self.source_lines = source_lines
        self.bounds = bounds

    def get_function(self, name: str) -> _EmuKernel:
        return _EmuKernel(self.emu, self.lib, name, self.source_lines, self.bounds.get(name))


class Emulator:
    """The CPU stand-in for a GPU: numpy arrays, kernels compiled as host C++.

    ``dispatch`` runs work at once, or appends it to ``capture`` while one is active
    (what a backend's emulated CUDA-graph capture records and replays). ``before_launch(name)``,
    when set, is called as each kernel runs, eagerly or in a replayed graph (an emulated
    runtime's fault injection). ``programmatic`` counts, per kernel, the launches that ran with
    the programmatic stream serialization attribute (the backend's pdl option). ``block_order``:
    the order a launch runs its blocks in, "forward" (index order), "reverse" or "shuffle" (a new
    permutation each launch, drawn from ``seed``): a GPU promises no order, so a kernel whose
    blocks cooperate (the last one to finish merges) is tested with the others."""

    name = "emulator"
    _libs: dict[Path, Any] = {}         # compiled library (by source hash) -> loaded ctypes handle

    def __init__(self, sm_count: int = 4, block_order: str = "forward", seed: int = 0) -> None:
        self._sm_count = sm_count
        self.block_order = block_order
        self._seed = seed
        self._n_launched = 0
        self.current_device = 0
        self.capture: list | None = None
        self.launches = 0
        self.programmatic: Counter[str] = Counter()    # programmatic launches run, per kernel
        self.before_launch: Callable[[str], None] | None = None
        self._kernels: dict[tuple[str, str], _EmuKernel] = {}

    def device_id(self) -> int:
        return self.current_device

    def module(self, family: str) -> _EmuModule:
        with _lock:
            path, source_lines, bounds = _built_family(family, module_source(family))
            lib = Emulator._load(path)
        return _EmuModule(self, lib, source_lines, bounds)

    def probe_kernel(self, source: str, name: str) -> _EmuKernel:
        """A test's own kernel `name` from CUDA `source` (no includes) on this emulator: for
        checking the emulator's intrinsics, collectives and launch checks alone."""
        host = _host_source(source, [name])
        with _lock:
            lib = Emulator._load(_build(f"probe_{name}", host))
        return _EmuKernel(self, lib, name, tuple(host.splitlines()), launch_bounds(source).get(name))

    @staticmethod
    def _load(path: Path):
        """The loaded library at `path` (loaded once per process)."""
        lib = Emulator._libs.get(path)
        if lib is None:
            lib = Emulator._libs[path] = ctypes.CDLL(str(path))
        return lib

    def kernel(self, family: str, name: str) -> _EmuKernel:
        """launch.KernelEngine: one emulated kernel serves every emulated GPU (host memory)."""
        k = self._kernels.get((family, name))
        if k is None:
            k = self._kernels[(family, name)] = self.module(family).get_function(name)
        return k

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def sm_count(self) -> int:
        return self._sm_count

    def next_block_order(self) -> tuple[int, int]:
        """(order code, seed) of the next launch's blocks (see `block_order`)."""
        if self.block_order not in _BLOCK_ORDERS:
            raise ValueError(f"block_order {self.block_order!r}; choose one of {', '.join(_BLOCK_ORDERS)}")
        self._n_launched += 1
        return _BLOCK_ORDERS[self.block_order], (self._seed * 1_000_003 + self._n_launched) % 2**64

    def dispatch(self, work) -> None:
        self.launches += 1
        if self.capture is not None:
            self.capture.append(work)
        else:
            work()


