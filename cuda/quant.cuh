// metatp CUDA kernels: common helpers and ggml weight block layouts.
//
// Header-free on purpose: NVRTC (used by cupy.RawModule) has no host headers, and
// <cuda_fp16.h>/<cuda_bf16.h> need CCCL paths that differ between CuPy versions.
// f16 conversions go through PTX `cvt`, bf16 through bit manipulation.
// The Python loader (backends/cuda_kernels.py) pastes this file in place of the
// `#include "quant.cuh"` line before handing a source to NVRTC; nvcc finds it as
// a normal include next to the .cu file.
//
// Code must stay C++11-compatible (CuPy 13 compiles with -std=c++11, CuPy 14 with c++17).
#ifndef METATP_QUANT_CUH
#define METATP_QUANT_CUH

typedef unsigned char mt_u8;
typedef unsigned short mt_u16;
typedef unsigned int mt_u32;
typedef signed char mt_i8;
typedef long long mt_i64;
typedef unsigned long long mt_u64;

#define MT_INF (__int_as_float(0x7f800000))
// Start value for running maxima in online softmax: large and finite, so that
// exp(m_old - m_new) never evaluates (-inf) - (-inf) = NaN on fully masked rows.
#define MT_NEG_BIG (-1.0e30f)
#define MT_WARP 32

// ---------------------------------------------------------------- conversions
#ifndef MT_HOST_EMU
__device__ __forceinline__ float mt_h2f(mt_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ mt_u16 mt_f2h(float f) {
    mt_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
// MT_HOST_EMU: the sources compiled as host C++ by a CPU emulation harness (testing only).
__device__ __forceinline__ float mt_h2f(mt_u16 h) {
    _Float16 x;
    __builtin_memcpy(&x, &h, 2);
    return (float)x;
}
__device__ __forceinline__ mt_u16 mt_f2h(float f) {
    const _Float16 x = (_Float16)f;
    mt_u16 h;
    __builtin_memcpy(&h, &x, 2);
    return h;
}
#endif

__device__ __forceinline__ float mt_bf2f(mt_u16 b) {
    return __uint_as_float(((mt_u32)b) << 16);
}

// Same rounding as ggml_compute_fp32_to_bf16 / gguf.quants.BF16: NaN -> quiet NaN,
// everything else round-to-nearest-even on the upper 16 bits.
__device__ __forceinline__ mt_u16 mt_f2bf(float f) {
    mt_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (mt_u16)((u >> 16) | 64u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (mt_u16)(u >> 16);
}

// Storage types of activations / caches. f16 and bf16 live in 16-bit words.
struct MtF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
};
struct MtF16 {
    typedef mt_u16 T;
    static __device__ __forceinline__ float load(const mt_u16* p) { return mt_h2f(*p); }
    static __device__ __forceinline__ void store(mt_u16* p, float v) { *p = mt_f2h(v); }
};
struct MtBF16 {
    typedef mt_u16 T;
    static __device__ __forceinline__ float load(const mt_u16* p) { return mt_bf2f(*p); }
    static __device__ __forceinline__ void store(mt_u16* p, float v) { *p = mt_f2bf(v); }
};

// ------------------------------------------------------------- activations
__device__ __forceinline__ float mt_silu(float x) { return x / (1.0f + expf(-x)); }
// ggml gelu (tanh approximation)
__device__ __forceinline__ float mt_gelu(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}

// ------------------------------------------------------------------- loads
// Quant blocks are only guaranteed 2-byte aligned (Q4_0 = 18 bytes, Q8_0 = 34,
// Q6_K = 210), so wider words are assembled from 16-bit loads.
__device__ __forceinline__ mt_u16 mt_ld16(const mt_u8* p) {
    return *(const mt_u16*)p;
}
__device__ __forceinline__ mt_u32 mt_ld32(const mt_u8* p) {
    return (mt_u32)mt_ld16(p) | ((mt_u32)mt_ld16(p + 2) << 16);
}
__device__ __forceinline__ float mt_ldh(const mt_u8* p) { return mt_h2f(mt_ld16(p)); }

// ------------------------------------------------------------ reductions
__device__ __forceinline__ float mt_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float mt_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, <= 1024; 1-D blocks).
// `scratch` needs 32 floats. Every thread gets the result.
__device__ __forceinline__ float mt_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    v = mt_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0f;
    return mt_warp_sum(v);
}
__device__ __forceinline__ float mt_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    v = mt_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -MT_INF;
    return mt_warp_max(v);
}

// The epilogue of a rows kernel (matvec.cu, mmvq.cu): blocks of (bx, by) threads, by rows a block,
// bx threads (whole warps) a row, each thread holding partial sums acc[j][t] of its row. Sums them
// over the row's threads (warp shuffles, then across the row's warps through shared memory) and
// returns true in the one thread per row (threadIdx.x == 0, row < n_rows) that holds the totals.
// Every thread of the block must call it (it may synchronize the block). <= 256 threads.
template <int NW, int NT>
__device__ __forceinline__ bool mt_rows_reduce(float (&acc)[NW][NT], int row, int n_rows) {
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t] = mt_warp_sum(acc[j][t]);

    const int lane = threadIdx.x & 31;
    const int wpr = blockDim.x >> 5;  // warps per row (uniform over the block)
    if (wpr == 1) return lane == 0 && row < n_rows;

    __shared__ float red[8][NW * NT];  // <= 256 threads -> <= 8 warps
    const int warp = (threadIdx.y * blockDim.x + threadIdx.x) >> 5;
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NW; ++j)
#pragma unroll
            for (int t = 0; t < NT; ++t) red[warp][j * NT + t] = acc[j][t];
    }
    __syncthreads();
    if (threadIdx.x != 0 || row >= n_rows) return false;
    const int w0 = threadIdx.y * wpr;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float s = 0.0f;
            for (int i = 0; i < wpr; ++i) s += red[w0 + i][j * NT + t];
            acc[j][t] = s;
        }
    }
    return true;
}

// 1 / sqrt(mean(x^2) + eps) over x[0..ne0), reduced by the whole (2-D) block; every
// thread must call it. <= 256 threads.
__device__ __forceinline__ float mt_rms_scale(const float* __restrict__ x, int ne0, float eps) {
    __shared__ float part[8];
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nth = blockDim.x * blockDim.y;
    float s = 0.0f;
    for (int i = tid; i < ne0; i += nth) s = fmaf(x[i], x[i], s);
    s = mt_warp_sum(s);
    if ((tid & 31) == 0) part[tid >> 5] = s;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < (nth >> 5); ++w) t += part[w];
    __syncthreads();  // part is reused by the next call
    return 1.0f / sqrtf(t / (float)ne0 + eps);
}

// RoPE of one rotated pair (a, b) at position p, pair ip (dims 2ip, 2ip+1 of the rotated part;
// ggml's theta = p * base^(-2ip/n_dims), divided by freq_factors[ip] when given, times freq_scale;
// cos and sin scaled by attn_factor). One definition for rope.cu and the fused qkv_rope.cu, so
// the fused kernel rotates with the rope kernel's arithmetic.
__device__ __forceinline__ void mt_rope_pair(float& a, float& b, float p, int ip, int n_dims,
                                             const float* freq_factors, float freq_base,
                                             float freq_scale, float attn_factor) {
    float theta = p * powf(freq_base, -(float)(2 * ip) / (float)n_dims);
    if (freq_factors != 0) theta = theta / freq_factors[ip];
    theta = freq_scale * theta;
    float sn, cs;
    sincosf(theta, &sn, &cs);
    cs *= attn_factor;
    sn *= attn_factor;
    const float a0 = a;
    a = a0 * cs - b * sn;
    b = a0 * sn + b * cs;
}

// ------------------------------------------------------------ packed int8 weight codes
// The int8 families (mmvq's dp4a, mmq's mma) take 4 codes a word, lowest byte first.
// Signed bytes b - bias from 4 unsigned bytes b <= 127 + bias, with no carry between bytes.
__device__ __forceinline__ int mt_unbias4(mt_u32 v, int bias) {
    return (int)((v + 0x01010101u * (mt_u32)(128 - bias)) ^ 0x80808080u);
}

// The 4 bits qh >> i0 (i0 .. i0+3) as bit 4 of 4 bytes.
__device__ __forceinline__ mt_u32 mt_qh_bytes(mt_u32 qh, int i0) {
    const mt_u32 h = (qh >> i0) & 15u;
    return ((h & 1u) | ((h & 2u) << 7) | ((h & 4u) << 14) | ((h & 8u) << 21)) << 4;
}

// Q5_0 / Q5_1 block codes as 8 words: Q4_0's nibbles (at OFF + 4) plus bit 4 from the u32 qh
// (at OFF; bit i for element i); BIAS 16 gives Q5_0's signed codes, 0 Q5_1's unsigned ones.
template <int OFF, int BIAS>
__device__ __forceinline__ void mt_q5_codes(const mt_u8* b, int* q) {
    const mt_u32 qh = mt_ld32(b + OFF);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const mt_u32 v = mt_ld32(b + OFF + 4 + 4 * i);
        const mt_u32 lo = (v & 0x0f0f0f0fu) | mt_qh_bytes(qh, 4 * i);
        const mt_u32 hi = ((v >> 4) & 0x0f0f0f0fu) | mt_qh_bytes(qh, 16 + 4 * i);
        q[i] = BIAS ? mt_unbias4(lo, BIAS) : (int)lo;
        q[4 + i] = BIAS ? mt_unbias4(hi, BIAS) : (int)hi;
    }
}

// ------------------------------------------------------------ weight types
// Every weight type is described by one struct:
//   QK      elements per block          BYTES   bytes per block
//   NCHUNK  chunks per block            CW      elements per chunk
//   idx(c, k)       position inside the block of value k of chunk c
//   load(b, c, v)   dequantize chunk c of the block at b into v[0..CW)
// Dequantisation is written with explicit _rn intrinsics so the results match
// gguf.quants (numpy, f32) bit for bit.

struct WF32 {
    enum { QK = 1, BYTES = 4, NCHUNK = 1, CW = 1 };
    static __device__ __forceinline__ int idx(int, int) { return 0; }
    static __device__ __forceinline__ void load(const mt_u8* b, int, float* v) {
        v[0] = *(const float*)b;
    }
};

struct WF16 {
    enum { QK = 1, BYTES = 2, NCHUNK = 1, CW = 1 };
    static __device__ __forceinline__ int idx(int, int) { return 0; }
    static __device__ __forceinline__ void load(const mt_u8* b, int, float* v) {
        v[0] = mt_ldh(b);
    }
};

struct WBF16 {
    enum { QK = 1, BYTES = 2, NCHUNK = 1, CW = 1 };
    static __device__ __forceinline__ int idx(int, int) { return 0; }
    static __device__ __forceinline__ void load(const mt_u8* b, int, float* v) {
        v[0] = mt_bf2f(mt_ld16(b));
    }
};

// Q4_0: f16 d, 16 bytes; element i<16 = low nibble of qs[i], i>=16 = high nibble of qs[i-16].
// Chunk c (0..3): bytes qs[4c..4c+3] -> elements 4c..4c+3 (low), 16+4c..16+4c+3 (high).
struct WQ4_0 {
    enum { QK = 32, BYTES = 18, NCHUNK = 4, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) {
        return (k < 4) ? 4 * c + k : 12 + 4 * c + k;
    }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const float d = mt_ldh(b);
        const mt_u32 q = mt_ld32(b + 2 + 4 * c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = __fmul_rn(d, (float)((int)((q >> (8 * k)) & 15u) - 8));
            v[4 + k] = __fmul_rn(d, (float)((int)((q >> (8 * k + 4)) & 15u) - 8));
        }
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles (same order as Q4_0); value q*d + m.
struct WQ4_1 {
    enum { QK = 32, BYTES = 20, NCHUNK = 4, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) {
        return (k < 4) ? 4 * c + k : 12 + 4 * c + k;
    }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const float d = mt_ldh(b);
        const float m = mt_ldh(b + 2);
        const mt_u32 q = mt_ld32(b + 4 + 4 * c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = __fadd_rn(__fmul_rn(d, (float)((q >> (8 * k)) & 15u)), m);
            v[4 + k] = __fadd_rn(__fmul_rn(d, (float)((q >> (8 * k + 4)) & 15u)), m);
        }
    }
};

// Q8_0: f16 d, 32 int8. Chunk c (0..3) = elements 8c..8c+7.
struct WQ8_0 {
    enum { QK = 32, BYTES = 34, NCHUNK = 4, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) { return 8 * c + k; }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const float d = mt_ldh(b);
        const mt_u8* q = b + 2 + 8 * c;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const mt_u16 w = mt_ld16(q + 2 * k);
            v[2 * k] = __fmul_rn((float)(mt_i8)(w & 0xffu), d);
            v[2 * k + 1] = __fmul_rn((float)(mt_i8)(w >> 8), d);
        }
    }
};

// Q5_0 (22 bytes): f16 d, u32 qh (bit i = bit 4 of element i), qs[16] as Q4_0's nibbles;
// value d * (q - 16). Chunks as Q4_0 (element bits 4c+k and 16+4c+k of qh).
struct WQ5_0 {
    enum { QK = 32, BYTES = 22, NCHUNK = 4, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) { return WQ4_0::idx(c, k); }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const float d = mt_ldh(b);
        const mt_u32 h = mt_ld32(b + 2);
        const mt_u32 q = mt_ld32(b + 6 + 4 * c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int lo = (int)(((q >> (8 * k)) & 15u) | (((h >> (4 * c + k)) & 1u) << 4));
            const int hi = (int)(((q >> (8 * k + 4)) & 15u) | (((h >> (16 + 4 * c + k)) & 1u) << 4));
            v[k] = __fmul_rn(d, (float)(lo - 16));
            v[4 + k] = __fmul_rn(d, (float)(hi - 16));
        }
    }
};

// Q5_1 (24 bytes): f16 d, f16 m, u32 qh, qs[16]; value q*d + m (q = Q5_0's 5-bit code).
struct WQ5_1 {
    enum { QK = 32, BYTES = 24, NCHUNK = 4, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) { return WQ4_0::idx(c, k); }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const float d = mt_ldh(b);
        const float m = mt_ldh(b + 2);
        const mt_u32 h = mt_ld32(b + 4);
        const mt_u32 q = mt_ld32(b + 8 + 4 * c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const mt_u32 lo = ((q >> (8 * k)) & 15u) | (((h >> (4 * c + k)) & 1u) << 4);
            const mt_u32 hi = ((q >> (8 * k + 4)) & 15u) | (((h >> (16 + 4 * c + k)) & 1u) << 4);
            v[k] = __fadd_rn(__fmul_rn(d, (float)lo), m);
            v[4 + k] = __fadd_rn(__fmul_rn(d, (float)hi), m);
        }
    }
};

// K-quants: super-blocks of 256 elements.
// 6-bit scale/min j (0..7) of Q4_K/Q5_K (ggml get_scale_min_k4).
__device__ __forceinline__ void mt_scale_min_k4(int j, const mt_u8* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K (144 bytes): f16 d, f16 dmin, scales[12], qs[128]. Sub-block j (32 elements)
// uses qs[32*(j/2) .. +32], low nibbles for even j, high for odd j; value
// (d*sc_j)*q - (dmin*m_j). Chunk c (0..31): pair p = c/8, l0 = 4*(c%8):
// bytes qs[32p+l0 .. +4] -> elements 64p+l0+k (low) and 64p+32+l0+k (high).
struct WQ4_K {
    enum { QK = 256, BYTES = 144, NCHUNK = 32, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) {
        const int p = c >> 3, l0 = (c & 7) * 4;
        return 64 * p + l0 + ((k < 4) ? k : 28 + k);
    }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const int p = c >> 3, l0 = (c & 7) * 4;
        const float d = mt_ldh(b), dmin = mt_ldh(b + 2);
        int sc0, m0, sc1, m1;
        mt_scale_min_k4(2 * p, b + 4, &sc0, &m0);
        mt_scale_min_k4(2 * p + 1, b + 4, &sc1, &m1);
        const float d0 = __fmul_rn(d, (float)sc0), dm0 = __fmul_rn(dmin, (float)m0);
        const float d1 = __fmul_rn(d, (float)sc1), dm1 = __fmul_rn(dmin, (float)m1);
        const mt_u32 q = mt_ld32(b + 16 + 32 * p + l0);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = __fsub_rn(__fmul_rn(d0, (float)((q >> (8 * k)) & 15u)), dm0);
            v[4 + k] = __fsub_rn(__fmul_rn(d1, (float)((q >> (8 * k + 4)) & 15u)), dm1);
        }
    }
};

// Q5_K (176 bytes): f16 d, f16 dmin, scales[12], qh[32], qs[128]. Like Q4_K plus a
// fifth bit: element 32j+l takes bit j of qh[l].
struct WQ5_K {
    enum { QK = 256, BYTES = 176, NCHUNK = 32, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int k) { return WQ4_K::idx(c, k); }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const int p = c >> 3, l0 = (c & 7) * 4;
        const float d = mt_ldh(b), dmin = mt_ldh(b + 2);
        int sc0, m0, sc1, m1;
        mt_scale_min_k4(2 * p, b + 4, &sc0, &m0);
        mt_scale_min_k4(2 * p + 1, b + 4, &sc1, &m1);
        const float d0 = __fmul_rn(d, (float)sc0), dm0 = __fmul_rn(dmin, (float)m0);
        const float d1 = __fmul_rn(d, (float)sc1), dm1 = __fmul_rn(dmin, (float)m1);
        const mt_u32 h = mt_ld32(b + 16 + l0);
        const mt_u32 q = mt_ld32(b + 48 + 32 * p + l0);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const mt_u32 hb = h >> (8 * k);
            const mt_u32 qlo = ((q >> (8 * k)) & 15u) | (((hb >> (2 * p)) & 1u) << 4);
            const mt_u32 qhi = ((q >> (8 * k + 4)) & 15u) | (((hb >> (2 * p + 1)) & 1u) << 4);
            v[k] = __fsub_rn(__fmul_rn(d0, (float)qlo), dm0);
            v[4 + k] = __fsub_rn(__fmul_rn(d1, (float)qhi), dm1);
        }
    }
};

// Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d. For half h (128 elements)
// and l in 0..31: element 128h + l + 32k (k = 0..3) =
//   (ql[64h + l + 32*(k&1)] >> 4*(k>>1)) & 15  |  ((qh[32h + l] >> 2k) & 3) << 4,  minus 32,
// times d * scales[(128h + l + 32k) / 16]. Chunk c (0..31): h = c/16, l0 = 2*(c%16),
// value index kk = 2k + i for l = l0 + i.
struct WQ6_K {
    enum { QK = 256, BYTES = 210, NCHUNK = 32, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int kk) {
        const int h = c >> 4, l0 = (c & 15) * 2;
        return 128 * h + l0 + (kk & 1) + 32 * (kk >> 1);
    }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const int h = c >> 4, l0 = (c & 15) * 2;
        const float d = mt_ldh(b + 208);
        const mt_u32 qa = mt_ld16(b + 64 * h + l0);
        const mt_u32 qb = mt_ld16(b + 64 * h + l0 + 32);
        const mt_u32 qh = mt_ld16(b + 128 + 32 * h + l0);
        const int sbase = 192 + 8 * h + (l0 >> 4);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float ds = __fmul_rn(d, (float)(mt_i8)b[sbase + 2 * k]);
            const mt_u32 ql = (k & 1) ? qb : qa;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const mt_u32 lo = (ql >> (8 * i + 4 * (k >> 1))) & 15u;
                const mt_u32 hi = (qh >> (8 * i + 2 * k)) & 3u;
                const int q = (int)(lo | (hi << 4)) - 32;
                v[2 * k + i] = __fmul_rn(ds, (float)q);
            }
        }
    }
};

// Q2_K (84 bytes): scales[16] (low nibble: scale, high: min), qs[64], f16 d, f16 dmin. Element
// 128h + 32s + l (h 0..1, s 0..3, l 0..31) = (qs[32h + l] >> 2s) & 3, sub-block j = element / 16;
// value (d*(sc_j & 15))*q - (dmin*(sc_j >> 4)). Chunk c (0..31): h = c/16, l0 = 2*(c%16),
// value kk = 2s + i is element 128h + 32s + l0 + i.
struct WQ2_K {
    enum { QK = 256, BYTES = 84, NCHUNK = 32, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int kk) {
        const int h = c >> 4, l0 = (c & 15) * 2;
        return 128 * h + 32 * (kk >> 1) + l0 + (kk & 1);
    }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const int h = c >> 4, l0 = (c & 15) * 2;
        const float d = mt_ldh(b + 80), dmin = mt_ldh(b + 82);
        const mt_u32 q = mt_ld16(b + 16 + 32 * h + l0);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int sc = b[8 * h + 2 * s + (l0 >> 4)];
            const float dl = __fmul_rn(d, (float)(sc & 15)), ml = __fmul_rn(dmin, (float)(sc >> 4));
#pragma unroll
            for (int i = 0; i < 2; ++i)
                v[2 * s + i] = __fsub_rn(__fmul_rn(dl, (float)((q >> (8 * i + 2 * s)) & 3u)), ml);
        }
    }
};

// Q3_K (110 bytes): hmask[32], qs[64], scales[12] (16 6-bit scales), f16 d. Element
// 128h + 32s + l: low bits (qs[32h + l] >> 2s) & 3, minus 4 unless bit 4h + s of hmask[l] is
// set; sub-block j = element / 16 has scale (low nibble of scales[j % 8], j >= 8: high) |
// ((scales[8 + j % 4] >> 2*(j / 4)) & 3) << 4, minus 32; value (d * scale) * q.
// Chunks as Q2_K.
__device__ __forceinline__ int mt_q3k_scale(const mt_u8* s, int j) {
    const int lo = (s[j & 7] >> (4 * (j >> 3))) & 15;
    const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

struct WQ3_K {
    enum { QK = 256, BYTES = 110, NCHUNK = 32, CW = 8 };
    static __device__ __forceinline__ int idx(int c, int kk) { return WQ2_K::idx(c, kk); }
    static __device__ __forceinline__ void load(const mt_u8* b, int c, float* v) {
        const int h = c >> 4, l0 = (c & 15) * 2;
        const float d = mt_ldh(b + 108);
        const mt_u32 q = mt_ld16(b + 32 + 32 * h + l0);
        const mt_u32 m = mt_ld16(b + l0);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const float dl = __fmul_rn(d, (float)mt_q3k_scale(b + 96, 8 * h + 2 * s + (l0 >> 4)));
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int lo = (int)((q >> (8 * i + 2 * s)) & 3u);
                const int hb = (int)((m >> (8 * i + 4 * h + s)) & 1u);
                v[2 * s + i] = __fmul_rn(dl, (float)(lo - (hb ? 0 : 4)));
            }
        }
    }
};

// Instantiate MACRO(suffix, WeightType) for every supported weight type.
#define MT_FOR_ALL_WTYPES(M) \
    M(f32, WF32)             \
    M(f16, WF16)             \
    M(bf16, WBF16)           \
    M(q8_0, WQ8_0)           \
    M(q4_0, WQ4_0)           \
    M(q4_1, WQ4_1)           \
    M(q5_0, WQ5_0)           \
    M(q5_1, WQ5_1)           \
    M(q2_k, WQ2_K)           \
    M(q3_k, WQ3_K)           \
    M(q4_k, WQ4_K)           \
    M(q5_k, WQ5_K)           \
    M(q6_k, WQ6_K)

// ---------------------------------------------------------------- programmatic dependent launch
// With the cupy backend's pdl option a kernel is launched with the programmatic stream
// serialization attribute (cuLaunchKernelEx): it may start while the kernel before it in the
// stream is still running. Every kernel therefore begins with
//     mt_pdl_wait(); mt_pdl_launch_dependents();
// before it reads or writes anything another kernel touches: griddepcontrol.wait returns once the
// kernels it depends on have completed and their writes are visible (at once for a kernel
// launched without the attribute), and launch_dependents lets the next kernel's blocks be
// scheduled while this one runs. The wait must come before any early return: a block that exits
// without waiting could complete the grid before its predecessor, and its successor's wait would
// then not cover the predecessor. Only weights and constants may be read before the wait.
// Below sm_90 both are no-ops; the emulator counts the waits (a programmatic launch there checks
// that every thread waited).
#ifdef MT_HOST_EMU
__device__ __forceinline__ void mt_pdl_wait() { mt_emu::note_pdl_wait(); }
__device__ __forceinline__ void mt_pdl_launch_dependents() {}
#else
__device__ __forceinline__ void mt_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void mt_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
#endif

#endif  // METATP_QUANT_CUH
