"""The host C++ around metatp's CUDA sources when the emulator compiles them (`cuda_emulator`).

`PRELUDE` goes before a family's kernels: CUDA's builtins (threadIdx, __syncthreads, warp
shuffles, atomics, dp4a, mma, the vector types with CUDA's alignment, the alignment sanitizer's
handler) as host C++ on fibers. `LAUNCHER` goes after them: blocks in the requested order, each
block's threads as fibers scheduled to their barriers, and the C entry points Python calls.
Kept apart from the Python driver so that each file has one job; the text is tests-only.
"""

__all__ = ["PRELUDE", "LAUNCHER"]

#: before the kernels: CUDA's builtins, types and intrinsics as host C++, and the fiber scheduler's state
PRELUDE = r"""
// ---- metatp CUDA emulator prelude: the kernels as host C++ (tests only) ----
#include <ucontext.h>
#include <setjmp.h>
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
// CUDA's vector types with CUDA's alignment (vector_types.h): an access through one at an address
// that is not a multiple of it is a misaligned address on the GPU, and a fault here (below).
struct alignas(2) char2 { signed char x, y; };
struct alignas(2) uchar2 { unsigned char x, y; };
struct alignas(4) char4 { signed char x, y, z, w; };
struct alignas(4) uchar4 { unsigned char x, y, z, w; };
struct alignas(4) short2 { short x, y; };
struct alignas(4) ushort2 { unsigned short x, y; };
struct alignas(8) short4 { short x, y, z, w; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) longlong2 { long long x, y; };
struct alignas(16) double2 { double x, y; };

namespace mt_emu {
struct Fiber {
    ucontext_t ctx;  // the fiber's first entry (makecontext / setcontext)
    jmp_buf jb;      // where it yielded (_setjmp): switches without swapcontext's signal-mask system call
    bool started;
    mt_dim3 tid;
    int lin;    // linear thread index in the block (warp = lin / 32)
    int wait;   // 0 runnable, 1 at __syncthreads, 2 at a warp exchange
    bool done;
};
inline Fiber* cur = nullptr;
inline mt_dim3 block_idx, block_dim, grid_dim;
inline jmp_buf sched_jb;     // the scheduler's place (run_block), where a fiber yields to
inline unsigned char xch[1024 * 8];
inline unsigned char* dyn_smem = nullptr;
inline void (*launch_tramp)(void**) = nullptr;
inline void** launch_args = nullptr;

inline long pdl_waits = 0;   // mt_pdl_wait() calls of the current launch (quant.cuh)
inline void note_pdl_wait() { ++pdl_waits; }

inline void yield_to_scheduler() { if (!_setjmp(cur->jb)) _longjmp(sched_jb, 1); }
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

// ---- mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 as a warp collective (PTX ISA, "Matrix
// Fragments for mma.m16n8k32", integer types). groupID = lane >> 2, tig = lane % 4 (threadID_in_group).
//   A (16 x 32 s8, row): a0..a15 (bytes of 4 .b32 registers, a0 = low byte of register 0):
//     row = groupID for i < 4 or 8 <= i < 12, else groupID + 8;
//     col = tig * 4 + (i & 3) for i < 8, else tig * 4 + (i & 3) + 16.
//   B (32 x 8 s8, col): b0..b7 (bytes of 2 .b32 registers): row = tig * 4 + (i & 3) for i < 4,
//     else tig * 4 + (i & 3) + 16; col = groupID.
//   C, D (16 x 8 s32): c0..c3: row = groupID for i < 2, else groupID + 8; col = tig * 2 + (i & 1).
// Strict: every one of the warp's 32 lanes must take part (the .aligned form); a lane missing,
// or lanes at different calls, is a fault the launch reports. Integer accumulation wraps as s32
// (no .satfinite).
struct MmaLane { int a[4]; int b[2]; int c[4]; int d[4]; };
inline MmaLane mma_lane[1024];
inline unsigned mma_calls[1024];        // per lane: mma calls in this launch
inline unsigned mma_done[32];           // per warp: the call number whose product is in mma_lane[].d
inline char fault[256];                 // set by a collective that cannot complete (reported by the launch)

// ---- misaligned accesses. The kernels are compiled with g++'s -fsanitize=alignment (and nothing
// else of UBSan): every load, store, reference and member access through a typed pointer checks
// that the address is a multiple of the type's alignment (2 for a 16-bit type, 4 for int and
// float, 16 for uint4), as a GPU's memory instructions need, and calls the handler below when
// not. The handler is defined here, so libubsan is neither linked nor loaded. The launch reports
// the first one (cudaErrorMisalignedAddress; the kernel's other threads run on).
struct UbsanLocation { const char* file; unsigned line, column; };
struct UbsanType { unsigned short kind, info; char name[1]; };
struct UbsanMismatch { UbsanLocation loc; const UbsanType* type; unsigned char log_alignment, check_kind; };
inline char misaligned[384];
inline void report_misaligned(unsigned line, const char* access, const char* type, unsigned long ptr,
                              unsigned alignment) {
    if (misaligned[0]) return;
    char thread[96] = "outside a kernel thread";
    if (cur) snprintf(thread, sizeof thread, "block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y,
                      block_idx.z, cur->tid.x, cur->tid.y, cur->tid.z);
    snprintf(misaligned, sizeof misaligned, "line %u: %s %s at address 0x%lx, which needs %u-byte alignment, "
             "in %s", line, access, type, ptr, alignment, thread);
}
inline void note_misaligned(const UbsanMismatch* d, unsigned long ptr) {
    static const char* const what[] = {"load of", "store to", "reference to", "member access in",
                                       "member call on", "constructor call on"};
    report_misaligned(d->loc.line, d->check_kind < 6 ? what[d->check_kind] : "access to", d->type->name, ptr,
                      1u << d->log_alignment);
}
// The atomics below reach memory through builtins, which the sanitizer does not see: checked here
// (`line`: the caller's, for the report).
template <class T> inline void require_aligned(const T* p, const char* op, unsigned line) {
    if (((unsigned long)p) % sizeof(T)) report_misaligned(line, op, "on a 4-byte word", (unsigned long)p, sizeof(T));
}
}  // namespace mt_emu
extern "C" void __ubsan_handle_type_mismatch_v1(mt_emu::UbsanMismatch* d, unsigned long ptr) {
    mt_emu::note_misaligned(d, ptr);
}
extern "C" void __ubsan_handle_type_mismatch_v1_abort(mt_emu::UbsanMismatch* d, unsigned long ptr) {
    mt_emu::note_misaligned(d, ptr);
}
namespace mt_emu {

inline int mma_a_row(int lane, int i) { return (lane >> 2) + ((i < 4 || (i >= 8 && i < 12)) ? 0 : 8); }
inline int mma_a_col(int lane, int i) { return (lane % 4) * 4 + (i & 3) + (i < 8 ? 0 : 16); }
inline int mma_b_row(int lane, int i) { return (lane % 4) * 4 + (i & 3) + (i < 4 ? 0 : 16); }
inline int mma_b_col(int lane, int) { return lane >> 2; }
inline int mma_c_row(int lane, int i) { return (lane >> 2) + (i < 2 ? 0 : 8); }
inline int mma_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }
inline int s8_of(const int* regs, int i) { return (int)(signed char)(((unsigned)regs[i / 4] >> (8 * (i % 4))) & 0xffu); }

// The warp's product once, from all 32 lanes' fragments: D = A B + C.
inline void mma_warp_product(int w0) {
    int A[16][32], B[32][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const MmaLane& f = mma_lane[w0 + l];
        for (int i = 0; i < 16; ++i) A[mma_a_row(l, i)][mma_a_col(l, i)] = s8_of(f.a, i);
        for (int i = 0; i < 8; ++i) B[mma_b_row(l, i)][mma_b_col(l, i)] = s8_of(f.b, i);
        for (int i = 0; i < 4; ++i) C[mma_c_row(l, i)][mma_c_col(l, i)] = f.c[i];
    }
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
            const int r = mma_c_row(l, i), n = mma_c_col(l, i);
            unsigned acc = (unsigned)C[r][n];
            for (int k = 0; k < 32; ++k) acc += (unsigned)(A[r][k] * B[k][n]);
            mma_lane[w0 + l].d[i] = (int)acc;
        }
}

// What every mma form shares: the lane's fragments (4 + 2 + 4 words) in, all 32 lanes of the warp
// met at the same call (else a fault and zeros), the warp's product computed once by `product`, the
// lane's 4 words of D out.
inline void mma_collective(void* d, const void* a, const void* b, const void* c, void (*product)(int)) {
    const int lin = cur->lin, w0 = lin & ~31;
    MmaLane& me = mma_lane[lin];
    memcpy(me.a, a, sizeof me.a);
    memcpy(me.b, b, sizeof me.b);
    memcpy(me.c, c, sizeof me.c);
    const unsigned call = ++mma_calls[lin];
    sync_warp();
    const long nth = (long)block_dim.x * block_dim.y * block_dim.z;
    bool whole = w0 + 32 <= nth;
    for (int l = 0; whole && l < 32; ++l) whole = mma_calls[w0 + l] == call;
    if (!whole) {
        if (!fault[0])
            snprintf(fault, sizeof fault, "mma.sync.aligned in block (%u,%u,%u) warp %d without all 32 lanes "
                     "at the same call", block_idx.x, block_idx.y, block_idx.z, w0 / 32);
        memset(d, 0, sizeof me.d);
    } else {
        if (mma_done[w0 / 32] != call) {
            product(w0);
            mma_done[w0 / 32] = call;
        }
        memcpy(d, me.d, sizeof me.d);
    }
    sync_warp();
}

inline void mma_m16n8k32_s8(int* d, const int* a, const int* b, const int* c) {
    mma_collective(d, a, b, c, mma_warp_product);
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"): a word holds two f16, the lower index in its low half.
//   A (16 x 16): a0..a7 (halves of 4 registers): row = groupID for i in {0, 1, 4, 5}, else groupID + 8;
//     col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0).
//   B (16 x 8): b0..b3 (halves of 2 registers): row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0); col = groupID.
//   C, D (16 x 8 f32): as the integer form's.
// The same strictness (`mma_collective`: all 32 lanes at the same call). Each D element is C plus
// the 16 exact products, summed in double and rounded once to f32 (the tensor cores' internal order
// is not specified; the kernel checks' tolerances cover the difference).
inline float f16_of(const int* regs, int i) {
    const unsigned short h = (unsigned short)(((unsigned)regs[i / 2] >> (16 * (i % 2))) & 0xffffu);
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}
inline void mma_warp_product_f16(int w0) {
    double A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const MmaLane& f = mma_lane[w0 + l];
        const int g = l >> 2, t = l % 4;
        for (int i = 0; i < 8; ++i)
            A[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1) + (i >= 4 ? 8 : 0)] = f16_of(f.a, i);
        for (int i = 0; i < 4; ++i) B[t * 2 + (i & 1) + (i >= 2 ? 8 : 0)][g] = f16_of(f.b, i);
        for (int i = 0; i < 4; ++i) {
            float cv;
            memcpy(&cv, &f.c[i], 4);
            C[mma_c_row(l, i)][mma_c_col(l, i)] = cv;
        }
    }
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
            const int r = mma_c_row(l, i), n = mma_c_col(l, i);
            double acc = C[r][n];
            for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][n];
            const float dv = (float)acc;
            memcpy(&mma_lane[w0 + l].d[i], &dv, 4);
        }
}

inline void mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    mma_collective(d, a, b, c, mma_warp_product_f16);
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
inline float __fdiv_rn(float a, float b) { return a / b; }
// __dp4a (sm_61+): c + the sum of the products of the 4 byte pairs of a and b, signed (int) or
// unsigned (unsigned int) bytes; the 32-bit sum wraps as on the GPU.
inline int __dp4a(int a, int b, int c) {
    unsigned r = (unsigned)c;
    for (int i = 0; i < 4; ++i)
        r += (unsigned)((int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i)));
    return (int)r;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
// Atomics: CUDA's int / unsigned / float overloads only (a kernel using another type does not build
// here either). Blocks run one at a time on one host thread; the builtins keep them atomic anyway.
// atomicAdd on f32 rounds to nearest and flushes subnormal inputs and results to sign-preserving
// zero (PTX atom.add.f32); the int one wraps on overflow (two's complement, as the GPU's add).
inline int atomicAdd(int* p, int v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicAdd", line);
    return (int)__atomic_fetch_add((unsigned*)p, (unsigned)v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicAdd(unsigned* p, unsigned v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicAdd", line);
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float mt_emu_ftz(float x) { return (x != 0.0f && fabsf(x) < 1.17549435e-38f) ? copysignf(0.0f, x) : x; }
inline float atomicAdd(float* p, float v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicAdd", line);
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
inline int atomicExch(int* p, int v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicExch", line);
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicExch(unsigned* p, unsigned v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicExch", line);
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicExch(float* p, float v, unsigned line = __builtin_LINE()) {
    mt_emu::require_aligned(p, "atomicExch", line);
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

#: after the kernels: the launcher (blocks in order, a block's threads as fibers) and its C entry points
LAUNCHER = r"""
// ---- emulator launcher: blocks one after another (in index order, reversed or shuffled), the
// threads of a block as fibers ----
namespace mt_emu {
static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;
static const size_t kStack = 128 * 1024;
static void fiber_main() {
    launch_tramp(launch_args);
    cur->done = true;
    _longjmp(sched_jb, 1);
}
// Runs every fiber until all are done; releases warp exchanges and block barriers when every
// live thread of the warp / block has reached them. Returns false on a deadlock.
static bool run_block(int nth, char* err, int err_len) {
    for (;;) {
        for (int i = 0; i < nth; ++i) {
            Fiber& f = fibers[i];
            if (!f.done && f.wait == 0) {
                cur = &f;
                if (!_setjmp(sched_jb)) {
                    if (!f.started) {
                        f.started = true;
                        setcontext(&f.ctx);
                    } else {
                        _longjmp(f.jb, 1);
                    }
                }
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
    pdl_waits = 0;
    memset(mma_calls, 0, sizeof mma_calls);
    memset(mma_done, 0, sizeof mma_done);
    fault[0] = 0;
    misaligned[0] = 0;
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
            f.started = false;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks[i].data();
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = nullptr;     // fiber_main never returns: it jumps back to the scheduler
            makecontext(&f.ctx, (void (*)())fiber_main, 0);
        }
        const bool finished = run_block((int)nth, err, err_len);
        cur = nullptr;
        if (misaligned[0]) {         // first: the GPU would have stopped there
            snprintf(err, err_len, "%s", misaligned);
            return 4;
        }
        if (!finished) return 2;
        if (fault[0]) {
            snprintf(err, err_len, "%s", fault);
            return 3;
        }
        memset(mma_calls, 0, sizeof mma_calls);
        memset(mma_done, 0, sizeof mma_done);
    }
    return 0;
}

// mt_pdl_wait() calls of the last launch: every thread of a programmatic launch must wait
extern "C" long mt_emu_pdl_waits() { return mt_emu::pdl_waits; }
"""
