"""A CPU emulator of metatp's CUDA kernels, for tests on machines without a GPU.

The same `cuda/*.cu` sources are compiled as host C++ by g++ (one fiber per CUDA thread,
`__syncthreads` and warp shuffles emulated) and launched on numpy arrays through ctypes. It
refuses what a real launch would refuse (block/grid limits, shared memory, argument C types,
and a ``None`` pointer, which CuPy 13 would pass as garbage), so a kernel that passes here has
had its logic and its launch contract checked; memory ordering, alignment and speed still need
a GPU. An `Emulator` is a kernel engine: ``with launch.using(Emulator()):`` runs the launchers
on it, and `EmuRuntime` (the emulated device API the backend is tested with) brings one.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from metatp.backends.cuda.kernels import expected_entry_points
from metatp.backends.cuda.launch import device_ptr, is_array, module_source

__all__ = ["Emulator", "emulator_available", "emulator_source"]


# --------------------------------------------------------------------------- emulator
_EMU_PRELUDE = r"""
// ---- metatp CUDA emulator prelude: the kernels as host C++ (tests only) ----
#include <ucontext.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#define MT_HOST_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct mt_dim3 { unsigned int x, y, z; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };

namespace mt_emu {
struct Fiber {
    ucontext_t ctx;
    mt_dim3 tid;
    int lin;    // linear thread index in the block (warp = lin / 32)
    int wait;   // 0 runnable, 1 at __syncthreads, 2 at a warp exchange
    bool done;
};
inline Fiber* cur = nullptr;
inline mt_dim3 block_idx, block_dim, grid_dim;
inline ucontext_t sched;
inline unsigned char xch[1024 * 8];
inline unsigned char* dyn_smem = nullptr;
inline void (*launch_tramp)(void**) = nullptr;
inline void** launch_args = nullptr;

inline void yield_to_scheduler() { swapcontext(&cur->ctx, &sched); }
inline void sync_block() { cur->wait = 1; yield_to_scheduler(); }
inline void sync_warp() { cur->wait = 2; yield_to_scheduler(); }

template <class T> inline T shfl_xor(T v, int o) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int lin = cur->lin;
    memcpy(xch + 8 * lin, &v, sizeof(T));
    sync_warp();
    const int src = (lin & ~31) | ((lin & 31) ^ (o & 31));
    T r;
    memcpy(&r, xch + 8 * src, sizeof(T));
    sync_warp();
    return r;
}

template <class T> constexpr char kind() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, int>) return 'i';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_same_v<T, long long>) return 'l';
    else return '?';
}
template <class... A> const char* sig(void (*)(A...)) {
    static const char s[] = {kind<A>()..., 0};
    return s;
}
template <class... A, size_t... I>
void call(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(a[I])...);
}
template <class... A> void invoke(void (*f)(A...), void** a) {
    call(f, a, std::index_sequence_for<A...>{});
}
}  // namespace mt_emu

#define threadIdx (mt_emu::cur->tid)
#define blockIdx (mt_emu::block_idx)
#define blockDim (mt_emu::block_dim)
#define gridDim (mt_emu::grid_dim)
#define __syncthreads() mt_emu::sync_block()

template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return mt_emu::shfl_xor(v, o); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
// Atomics: CUDA's int / unsigned / float overloads only (a kernel using another type does not build
// here either). Blocks run one at a time on one host thread; the builtins keep them atomic anyway.
// atomicAdd on f32 rounds to nearest and flushes subnormal inputs and results to sign-preserving
// zero (PTX atom.add.f32); the int one wraps on overflow (two's complement, as the GPU's add).
inline int atomicAdd(int* p, int v) {
    return (int)__atomic_fetch_add((unsigned*)p, (unsigned)v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float mt_emu_ftz(float x) { return (x != 0.0f && fabsf(x) < 1.17549435e-38f) ? copysignf(0.0f, x) : x; }
inline float atomicAdd(float* p, float v) {
    unsigned ob = __atomic_load_n((unsigned*)p, __ATOMIC_SEQ_CST), nb;
    for (;;) {
        float old, sum;
        memcpy(&old, &ob, 4);
        sum = mt_emu_ftz(mt_emu_ftz(old) + mt_emu_ftz(v));
        memcpy(&nb, &sum, 4);
        if (__atomic_compare_exchange_n((unsigned*)p, &ob, nb, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return old;
    }
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* p, float v) {
    unsigned nb, ob;
    memcpy(&nb, &v, 4);
    ob = __atomic_exchange_n((unsigned*)p, nb, __ATOMIC_SEQ_CST);
    float old;
    memcpy(&old, &ob, 4);
    return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
// ---- end of prelude ----
"""

_EMU_LAUNCHER = r"""
// ---- emulator launcher: blocks one after another (in index order, reversed or shuffled), the
// threads of a block as fibers ----
namespace mt_emu {
static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;
static const size_t kStack = 128 * 1024;
static void fiber_main() {
    launch_tramp(launch_args);
    cur->done = true;
}
// Runs every fiber until all are done; releases warp exchanges and block barriers when every
// live thread of the warp / block has reached them. Returns false on a deadlock.
static bool run_block(int nth, char* err, int err_len) {
    for (;;) {
        for (int i = 0; i < nth; ++i) {
            Fiber& f = fibers[i];
            if (!f.done && f.wait == 0) {
                cur = &f;
                swapcontext(&sched, &f.ctx);
            }
        }
        int live = 0, at_block = 0;
        for (int i = 0; i < nth; ++i) {
            if (!fibers[i].done) {
                ++live;
                at_block += fibers[i].wait == 1;
            }
        }
        if (live == 0) return true;
        bool released = false;
        for (int w0 = 0; w0 < nth; w0 += 32) {
            int wl = 0, ww = 0;
            for (int i = w0; i < w0 + 32 && i < nth; ++i) {
                if (!fibers[i].done) {
                    ++wl;
                    ww += fibers[i].wait == 2;
                }
            }
            if (wl > 0 && ww == wl) {
                for (int i = w0; i < w0 + 32 && i < nth; ++i) fibers[i].wait = 0;
                released = true;
            }
        }
        if (!released && at_block == live) {
            for (int i = 0; i < nth; ++i) fibers[i].wait = 0;
            released = true;
        }
        if (!released) {
            snprintf(err, err_len, "deadlock in block (%u,%u,%u): %d live threads, %d at "
                     "__syncthreads, the rest at a warp exchange", block_idx.x, block_idx.y,
                     block_idx.z, live, at_block);
            return false;
        }
    }
}
}  // namespace mt_emu

extern "C" int mt_emu_launch(void (*tramp)(void**), void** args, unsigned gx, unsigned gy,
                             unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned long smem, int order, unsigned long long seed, char* err,
                             int err_len) {
    using namespace mt_emu;
    const long nth = (long)bx * by * bz;
    if (nth <= 0 || nth > 1024 || bx > 1024 || by > 1024 || bz > 64 || gx == 0 || gy == 0 ||
        gz == 0 || gy > 65535 || gz > 65535 || gx > 2147483647u) {
        snprintf(err, err_len, "invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u)",
                 gx, gy, gz, bx, by, bz);
        return 1;
    }
    if ((long)fibers.size() < nth) fibers.resize(nth);
    while ((long)stacks.size() < nth) stacks.emplace_back(kStack);
    std::vector<unsigned char> smem_buf(smem + 64, 0xFF);   // NaN bytes: catch reads before writes
    dyn_smem = (unsigned char*)(((uintptr_t)smem_buf.data() + 63) & ~(uintptr_t)63);
    launch_tramp = tramp;
    launch_args = args;
    block_dim = {bx, by, bz};
    grid_dim = {gx, gy, gz};
    // the blocks' linear indices (x fastest) in the order they run: 0 as numbered, 1 reversed,
    // 2 a Fisher-Yates shuffle drawn from `seed` (splitmix64)
    const unsigned long long n_blocks = (unsigned long long)gx * gy * gz;
    std::vector<unsigned long long> block_order(n_blocks);
    for (unsigned long long b = 0; b < n_blocks; ++b) block_order[b] = order == 1 ? n_blocks - 1 - b : b;
    if (order == 2) {
        unsigned long long st = seed;
        for (unsigned long long b = n_blocks; b > 1; --b) {
            st += 0x9E3779B97F4A7C15ull;
            unsigned long long r = st;
            r = (r ^ (r >> 30)) * 0xBF58476D1CE4E5B9ull;
            r = (r ^ (r >> 27)) * 0x94D049BB133111EBull;
            r ^= r >> 31;
            std::swap(block_order[b - 1], block_order[r % b]);
        }
    }
    for (unsigned long long b : block_order) {
        block_idx = {(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / ((unsigned long long)gx * gy))};
        for (long i = 0; i < nth; ++i) {
            Fiber& f = fibers[i];
            f.tid = {(unsigned)(i % bx), (unsigned)((i / bx) % by), (unsigned)(i / ((long)bx * by))};
            f.lin = (int)i;
            f.wait = 0;
            f.done = false;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks[i].data();
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = &sched;
            makecontext(&f.ctx, (void (*)())fiber_main, 0);
        }
        if (!run_block((int)nth, err, err_len)) return 2;
    }
    return 0;
}
"""

#: Emulator.block_order -> the launcher's order code
_BLOCK_ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}

_SHARED_EXTERN_RE = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def emulator_source(family: str) -> str:
    """One family as host C++: prelude, the kernels (shared memory made static), trampolines."""
    src = module_source(family)
    src = _SHARED_EXTERN_RE.sub(lambda m: f"#define {m.group(2)} (({m.group(1)}*)mt_emu::dyn_smem)", src)
    src = re.sub(r"\b__shared__\b", "static", src)
    tramps = "\n".join(
        f'extern "C" void mt_tramp_{n}(void** a) {{ mt_emu::invoke(&{n}, a); }}\n'
        f'extern "C" const char* mt_sig_{n}() {{ return mt_emu::sig(&{n}); }}'
        for n in expected_entry_points()[family])
    return _EMU_PRELUDE + src + _EMU_LAUNCHER + tramps + "\n"


def emulator_available() -> bool:
    """True when a host C++ compiler for the emulator is on PATH."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


_lock = threading.RLock()
_EMU_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off", "-w")


def _compile_emulator(family: str) -> Path:
    """The shared library of one family (compiled once, cached by source hash)."""
    from metatp.backends.host_build import build_shared_library, host_cache_dir

    try:
        return build_shared_library(family, emulator_source(family), ".cpp", os.environ.get("CXX", "g++"),
                                    _EMU_FLAGS, host_cache_dir("METATP_EMU_CACHE", "metatp-emu"))
    except RuntimeError as e:
        raise RuntimeError(f"emulator build of {family}.cu failed: {e}") from None


class _EmuKernel:
    """A kernel of the emulator, called like cupy.RawKernel."""

    def __init__(self, emu: "Emulator", lib, name: str) -> None:
        self.emu = emu
        self.name = name
        self._tramp = ctypes.cast(getattr(lib, f"mt_tramp_{name}"), ctypes.c_void_p)
        sig_fn = getattr(lib, f"mt_sig_{name}")
        sig_fn.restype = ctypes.c_char_p
        self.signature = sig_fn().decode()
        self._launch = lib.mt_emu_launch
        self._launch.restype = ctypes.c_int
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

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if shared_mem > 48 * 1024 and shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of dynamic shared memory need "
                               "max_dynamic_shared_size_bytes raised first")
        if shared_mem > 227 * 1024:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of shared memory exceed the device limit")
        vals = self._convert(args)
        self.emu.dispatch(lambda: self._run(grid, block, vals, shared_mem))

    def _run(self, grid, block, vals, shared_mem) -> None:
        if self.emu.before_launch is not None:        # a test's injected fault (EmuRuntime.inject)
            self.emu.before_launch(self.name)
        ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        err = ctypes.create_string_buffer(512)
        order, seed = self.emu.next_block_order()
        rc = self._launch(self._tramp, ptrs, *(ctypes.c_uint(g) for g in grid), *(ctypes.c_uint(b) for b in block),
                          ctypes.c_ulong(shared_mem), ctypes.c_int(order), ctypes.c_ulonglong(seed), err,
                          ctypes.c_int(len(err)))
        if rc != 0:
            raise RuntimeError(f"{self.name}: {err.value.decode()}")


class _EmuModule:
    def __init__(self, emu: "Emulator", lib) -> None:
        self.emu = emu
        self.lib = lib

    def get_function(self, name: str) -> _EmuKernel:
        return _EmuKernel(self.emu, self.lib, name)


class Emulator:
    """The CPU stand-in for a GPU: numpy arrays, kernels compiled as host C++.

    ``dispatch`` runs work at once, or appends it to ``capture`` while one is active
    (what a backend's emulated CUDA-graph capture records and replays). ``before_launch(name)``,
    when set, is called as each kernel runs, eagerly or in a replayed graph (an emulated
    runtime's fault injection). ``block_order``: the order a launch runs its blocks in,
    "forward" (index order), "reverse" or "shuffle" (a new permutation each launch, drawn from
    ``seed``): a GPU promises no order, so a kernel whose blocks cooperate (the last one to
    finish merges) is tested with the others."""

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
        self.before_launch: Callable[[str], None] | None = None
        self._kernels: dict[tuple[str, str], _EmuKernel] = {}

    def device_id(self) -> int:
        return self.current_device

    def module(self, family: str) -> _EmuModule:
        with _lock:
            path = _compile_emulator(family)
            lib = Emulator._libs.get(path)
            if lib is None:
                lib = Emulator._libs[path] = ctypes.CDLL(str(path))
        return _EmuModule(self, lib)

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


