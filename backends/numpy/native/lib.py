"""Building and loading the C library (`csrc/cpu_kernels.c`), its argument structs, one prepared
call (`_Call`), batches of calls, the kernel thread count and its governor (`adaptive_threads`:
fewer threads while other processes hold CPUs, csrc/threads.c).

The library is built on first use with the machine's C compiler (-O3 -march=native, OpenMP when
available; METATP_KERNEL_ISA=avx512-amx|avx512-vnni|avx-vnni|avx2|portable builds that path instead) and
cached; where that is impossible (no compiler, METATP_CPU_KERNELS=0)
`available()` is False and the backend keeps its numpy path.
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

from metatp.backends.host_build import build_shared_library, host_cache_dir
from metatp.ir.errors import ConfigError

__all__ = ["available", "kernel_info", "isa", "library_isa", "build_library", "default_threads", "batchable",
           "batch", "adaptive_threads", "set_adaptive_threads", "team_cap", "others_load", "ATTN_CHUNK", "MAX_ROWS",
           "MAX_GROUP_ITEMS"]

# The decode attention cuts the KV length into chunks at absolute multiples of ATTN_CHUNK cells
# (ATTN_CHUNK in attention.c): a query row's result depends only on its visible cells and their
# positions modulo ATTN_CHUNK, so a sequence whose first cell is a multiple of it gets the same
# bits alone or batched with others (the engine places sequences so).
ATTN_CHUNK = 128

# The most rows (tokens of one step) the few-token kernels are used for: a step of 64 sequences'
# decode tokens; longer prompt chunks go to float32 BLAS (faster there, but its sums depend on the
# batch shape). numpy/kernels dispatches on it.
MAX_ROWS = 64

# Products (or attentions) one grouped call takes at most (MAX_ITEMS in simd.h).
MAX_GROUP_ITEMS = 64

# The ISA builds of the kernels besides -march=native: their compiler flags and the /proc/cpuinfo
# flags a CPU needs to run them. METATP_KERNEL_ISA picks one (e.g. the AVX2 path on a CPU that also
# has AVX-512, to measure what an AVX2-only machine runs); the tests build and run each one the CPU
# can run (tests/support/cpu.py). avx512-amx (csrc/q8_amx.c: q8 products of 16-32 tokens on AMX
# tiles) is what -march=native builds too where the CPU reports the tiles (`_AMX_NATIVE`); where
# the OS then refuses the tile state, those products take the avx512-vnni tiles (same bits).
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-w")
ISA_BUILDS = {
    "avx512-amx": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c",
                    "-mamx-tile", "-mamx-int8", "-DMETATP_AMX"),
                   ("avx512_vnni", "avx512vl", "avx512bw", "amx_tile", "amx_int8")),
    "avx512-vnni": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
                    ("avx512_vnni", "avx512vl", "avx512bw")),
    "avx-vnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx_vnni",)),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma")),
    "portable": ((), ()),
}

# added to the first -march=native set on a CPU with AMX tiles (a compiler without them falls back
# to the plain native set)
_AMX_NATIVE = ("-mamx-tile", "-mamx-int8", "-DMETATP_AMX")
_FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-w"),
    ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=gnu11", "-w"),   # no OpenMP runtime
    ("-O3", "-fPIC", "-shared", "-std=gnu11", "-w"),                        # compiler without -march=native
)
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _struct(name: str, fields: str) -> type[ctypes.Structure]:
    """A ctypes mirror of one argument struct of the C kernels ("name:type ..."; i=int64,
    f=float, p=pointer), fields in the C order."""
    kinds = {"i": _I64, "f": _F32, "p": _PTR}
    return type(name, (ctypes.Structure,), {"_fields_": [(f.split(":")[0], kinds[f.split(":")[1]])
                                                         for f in fields.split()]})


# Every entry point of the library and the struct its one pointer argument points to.
_ARGS = {
    "metatp_qmatmul": _struct("QMatmulGroup", "n:i items:p nthreads:i"),
    "metatp_rope": _struct("RopeArgs", "T:i H:i D:i n_dims:i neox:i x:p x_st:i x_sh:i out:p o_st:i o_sh:i cs:p nthreads:i"),
    "metatp_attention": _struct("AttentionArgs", "T:i H:i Hkv:i D:i Dv:i n_kv:i q:p q_sh:i q_st:i k:p k_sh:i "
                                                 "k_sj:i k_type:i v:p v_sh:i v_sj:i v_type:i mask:p m_st:i scale:f "
                                                 "softcap:f sinks:p out:p o_st:i o_sh:i scratch:p max_chunks:i "
                                                 "nthreads:i q8:i qq:p qd:p n_kv_at:p"),
    "metatp_attention_group": _struct("AttentionGroup", "n:i items:p nthreads:i"),
    "metatp_glu": _struct("GluArgs", "T:i n:i act:i a:p a_st:i b:p b_st:i out:p o_st:i nthreads:i"),
    "metatp_rms_norm": _struct("RmsNormArgs", "T:i n:i x:p x_st:i w:p out:p o_st:i eps:f nthreads:i"),
    "metatp_add": _struct("AddArgs", "T:i n:i a:p a_st:i b:p b_st:i out:p o_st:i nthreads:i"),
    "metatp_allreduce": _struct("AllreduceArgs", "n:i count:i bufs:p active:p"),
    "metatp_set_rows": _struct("SetRowsArgs", "T:i n:i src:p src_st:i dst:p dst_st:i dst_rows:i ids:p type:i"),
    "metatp_kv_convert": _struct("KvConvertArgs", "type:i rows:i n:i x:p q:p out:p"),
    "metatp_q8_matmul": _struct("Q8MatmulGroup", "n:i items:p nthreads:i"),
    "metatp_q8_quantize": _struct("Q8QuantArgs", "kind:i ntok:i k:i x:p ldx:i q:p d:p s:p isum:p"),
    "metatp_q8_isums": _struct("Q8IsumArgs", "w:p xq:p out:p"),
    "metatp_round_half": _struct("HalfArgs", "n:i x:p out:p"),
    "metatp_batch": _struct("BatchArgs", "n:i fns:p args:p failed:i"),
    "metatp_row_best": _struct("RowBestArgs", "rows:i n:i ld:i x:p val:p idx:p finite:p nthreads:i"),
    "metatp_dequant": _struct("DequantArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p out:p ldo:i "
                                             "nthreads:i group:i half_scales:i"),
}


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


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_unrunnable(isa: str) -> str | None:
    """Why this machine cannot run the ISA build `isa` (of ISA_BUILDS), or None when it can."""
    flags, needs = ISA_BUILDS[isa]
    if flags and platform.machine() not in ("x86_64", "AMD64"):
        return f"it is an x86-64 build; this machine is {platform.machine()}"
    missing = sorted(set(needs) - cpu_flags())
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _chosen_flag_sets() -> tuple[tuple[str, ...], ...]:
    """The flag sets to try in order: -march=native and its fallbacks, or the one ISA build that
    METATP_KERNEL_ISA names (refused by name when unknown or not runnable here, where running it
    would die of an illegal instruction)."""
    want = os.environ.get("METATP_KERNEL_ISA", "").strip().lower()
    if want in ("", "native"):
        if isa_unrunnable("avx512-amx") is None:
            return (_FLAG_SETS[0] + _AMX_NATIVE, *_FLAG_SETS)
        return _FLAG_SETS
    if want not in ISA_BUILDS:
        raise ConfigError(f"METATP_KERNEL_ISA={want!r}: choose native or one of {', '.join(ISA_BUILDS)}")
    why = isa_unrunnable(want)
    if why:
        raise ConfigError(f"METATP_KERNEL_ISA={want!r}: {why}")
    return (BASE_FLAGS + ISA_BUILDS[want][0],)


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


# the library's small query and control functions: (result type, argument types)
_QUERIES = {
    "metatp_qmatmul_groups": (ctypes.c_int, []),
    "metatp_isa": (ctypes.c_char_p, []),
    "metatp_amx": (ctypes.c_int, []),
    "metatp_attn_chunk": (ctypes.c_int, []),
    "metatp_thread_governor": (ctypes.c_int, [ctypes.c_int]),
    "metatp_team_cap": (ctypes.c_int, []),
    "metatp_team_others_milli": (ctypes.c_int, []),
    "metatp_team_size": (ctypes.c_int, [ctypes.c_int64]),
    "metatp_team_cap_for": (ctypes.c_int, [ctypes.c_int64, ctypes.c_double]),
}


def build_library(flags: tuple[str, ...], cc: str | None = None) -> ctypes.CDLL:
    """Build (or take from the cache) `csrc/cpu_kernels.c` with these compiler flags and load it.
    Raises RuntimeError/OSError when that fails. (Tests also build other ISA paths with it.)
    cpu_kernels.c is a unity file including the other files of csrc/: they are compiled with -I
    on that folder, and a change in any of them builds anew."""

    cc = cc or os.environ.get("CC", "cc")
    with resources.as_file(resources.files("metatp.backends").joinpath("csrc")) as csrc:
        source = (csrc / "cpu_kernels.c").read_text(encoding="utf-8")
        path = build_shared_library("cpu_kernels", source, ".c", cc, flags,
                                    host_cache_dir("METATP_KERNEL_CACHE", "metatp-kernels"), _cpu_signature(),
                                    libs=("-lm",), include_dir=csrc)
    lib = ctypes.CDLL(str(path))
    for name in _ARGS:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p]
    for name, (restype, argtypes) in _QUERIES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.metatp_attn_chunk() != ATTN_CHUNK:
        raise RuntimeError(f"attention.c has ATTN_CHUNK {lib.metatp_attn_chunk()}, native/lib.py {ATTN_CHUNK}")
    lib.metatp_thread_governor(int(adaptive_threads()))
    _built[str(path)] = lib
    return lib


def library_isa(lib: ctypes.CDLL) -> str:
    """Which integer dot-product path a build compiled: avx512-amx, avx512-vnni, avx-vnni, avx2 or
    portable."""
    return lib.metatp_isa().decode()


def amx_refused(lib: ctypes.CDLL) -> bool:
    """True when the build has AMX tiles but the OS refused this process the tile state (its
    products of many tokens then run the avx512-vnni tiles, with the same bits)."""
    return lib.metatp_amx() < 0


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, a line saying which build or why none)."""
    if os.environ.get("METATP_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "off (METATP_CPU_KERNELS=0)"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None, f"off (no C compiler {cc!r} on PATH)"
    errors = []
    for flags in _chosen_flag_sets():
        try:
            lib = build_library(flags, cc)
        except (RuntimeError, OSError) as e:
            errors.append(str(e).splitlines()[0])
            continue
        shown = " ".join(f for f in flags if f.startswith(("-march", "-fopenmp")))
        if "-march=native" not in flags:
            shown += f" METATP_KERNEL_ISA={library_isa(lib)}"
        info = f"cpu_kernels ({cc} {shown}; q8 {library_isa(lib)})".replace(" ;", ";")
        if amx_refused(lib):
            info += ", AMX tile state refused by the OS: avx512-vnni tiles"
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


# Every library built in this process (each ISA build has its own thread governor).
_built: dict[str, ctypes.CDLL] = {}
_adaptive: bool | None = None          # set_adaptive_threads; None: METATP_ADAPTIVE_THREADS decides


def adaptive_threads() -> bool:
    """Do the kernels' parallel regions take fewer threads while other processes hold CPUs
    (csrc/threads.c)? On unless METATP_ADAPTIVE_THREADS=0 or `set_adaptive_threads(False)`.
    Why: every region waits for its slowest thread, and a thread sharing a CPU with another busy
    process is slow at every region (a 24-token chat 3-7x slower with two threads than with one
    beside one busy process on 2 CPUs). The count never changes the bits."""
    if _adaptive is not None:
        return _adaptive
    return os.environ.get("METATP_ADAPTIVE_THREADS", "1").strip().lower() not in ("0", "off", "false", "no")


def set_adaptive_threads(on: bool | None) -> None:
    """Switch the thread governor of every library built in this process (and of those built
    later); None: back to METATP_ADAPTIVE_THREADS. Call it between kernel calls (tests do, to
    compare exact thread counts)."""
    global _adaptive
    _adaptive = None if on is None else bool(on)
    for lib in _built.values():
        lib.metatp_thread_governor(int(adaptive_threads()))


def team_cap(lib: ctypes.CDLL | None = None) -> int | None:
    """The most threads a parallel region of `lib` (default: the library in use) takes now, or
    None when nothing caps it (not adaptive, no load seen yet, or no library)."""
    lib = lib if lib is not None else _library()[0]
    if lib is None:
        return None
    cap = lib.metatp_team_cap()
    return None if cap >= 2 ** 31 - 1 else cap


def others_load(lib: ctypes.CDLL | None = None) -> float | None:
    """Other processes' load (in CPUs) over the governor's last window, or None before any check
    (for reports: why `team_cap` is what it is)."""
    lib = lib if lib is not None else _library()[0]
    milli = -1 if lib is None else lib.metatp_team_others_milli()
    return None if milli < 0 else milli / 1000


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


def _elems(a: np.ndarray, axis: int) -> int:
    """Stride of `axis` in float32 elements."""
    return a.strides[axis] // 4

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
