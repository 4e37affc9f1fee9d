// metatp: KV-cache storage types — how attention reads element i of one head's cache row,
// and how SET_ROWS quantizes a row of 32-element blocks into a quantized cache.
//
// A cache row of a quantized type is whole ggml blocks (the split table and the cache-type
// check keep every head row whole blocks), so element i of a head row lives in block i / 32.
// Row and head strides of a quantized cache are in bytes (its storage is uint8).
//
// Block layouts (ggml, all 32 elements, blocks only 2-byte aligned):
//   q8_0 34 B: f16 d, int8 qs[32]                    x = q * d
//   q4_0 18 B: f16 d, qs[16]                         x = d * (q - 8)
//   q4_1 20 B: f16 d, f16 m, qs[16]                  x = d * q + m
//   q5_0 22 B: f16 d, u32 qh, qs[16]                 x = d * (q - 16)
//   q5_1 24 B: f16 d, f16 m, u32 qh, qs[16]          x = d * q + m
// 4-bit values: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of
// qs[j - 16]; a 5-bit value takes bit j of qh (little endian) as its fifth bit.
#ifndef METATP_KVCACHE_CUH
#define METATP_KVCACHE_CUH

#include "quant.cuh"

// ------------------------------------------------------------ exact f32 arithmetic
// Quantization must match gguf.quants bit for bit. CuPy compiles with -ftz=true and FMA
// contraction on; PTX with an explicit rounding mode and no .ftz is never fused and keeps
// subnormals, whatever the compiler flags.
#ifndef MT_HOST_EMU
__device__ __forceinline__ float mt_mul_x(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float mt_add_x(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float mt_sub_x(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float mt_div_x(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#else
// the emulator: host IEEE arithmetic, no FTZ, -ffp-contract=off
__device__ __forceinline__ float mt_mul_x(float a, float b) { return a * b; }
__device__ __forceinline__ float mt_add_x(float a, float b) { return a + b; }
__device__ __forceinline__ float mt_sub_x(float a, float b) { return a - b; }
__device__ __forceinline__ float mt_div_x(float a, float b) { return a / b; }
#endif

// Float comparisons flush subnormals under -ftz=true; integer keys do not. For a finite
// float, key order is float order (-0 sorts just below +0).
__device__ __forceinline__ int mt_order_key(float x) {
    const int i = __float_as_int(x);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float mt_from_key(int k) {
    return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff);
}
__device__ __forceinline__ bool mt_is_zero(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) == 0u;
}
// 1/d, or 0 for d == 0 (gguf.quants: id = where(d == 0, 0, 1 / d))
__device__ __forceinline__ float mt_inv_or_zero(float d) {
    return mt_is_zero(d) ? 0.0f : mt_div_x(1.0f, d);
}

__device__ __forceinline__ int mt_warp_max_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ int mt_warp_min_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ mt_u32 mt_warp_or(mt_u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The value of largest magnitude in the warp, the lowest lane on ties (numpy argmax of |x|,
// ggml's `if (amax < fabsf(v))` loop).
__device__ __forceinline__ float mt_warp_absmax_signed(float x, int lane) {
    mt_u32 a = __float_as_uint(x) & 0x7fffffffu;
    int i = lane;
    float v = x;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const mt_u32 oa = __shfl_xor_sync(0xffffffffu, a, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        if (oa > a || (oa == a && oi < i)) {
            a = oa;
            i = oi;
            v = ov;
        }
    }
    return v;
}

__device__ __forceinline__ void mt_st16(mt_u8* p, mt_u16 v) { *(mt_u16*)p = v; }
__device__ __forceinline__ void mt_st32(mt_u8* p, mt_u32 v) {   // 2-byte aligned
    mt_st16(p, (mt_u16)(v & 0xffffu));
    mt_st16(p + 2, (mt_u16)(v >> 16));
}

// ------------------------------------------------------------ cache types
// Every cache type has:
//   T                         storage element (a quantized cache: bytes)
//   get(row, i)               element i of a head row as f32
//   get8(row, i, vec, o)      elements i..i+7 (i % 8 == 0) into o; vec: row + i is 16-byte
//                             aligned (float types only)
// A quantized type also has QK, BYTES and quantize(x, lane, block): the 32 lanes of a warp
// hold the 32 values of one block, lane l value l, and write that block.
struct KvF32 {
    typedef float T;
    static __device__ __forceinline__ float get(const float* r, int i) { return r[i]; }
    static __device__ __forceinline__ void get8(const float* r, int i, bool vec, float* o) {
        const float* p = r + i;
        if (vec) {
            const float4 a = *(const float4*)p;
            const float4 b = *(const float4*)(p + 4);
            o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
            o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = p[k];
        }
    }
};
struct KvF16 {
    typedef mt_u16 T;
    static __device__ __forceinline__ float get(const mt_u16* r, int i) { return mt_h2f(r[i]); }
    static __device__ __forceinline__ void get8(const mt_u16* r, int i, bool vec, float* o) {
        const mt_u16* p = r + i;
        if (vec) {
            const uint4 u = *(const uint4*)p;
            o[0] = mt_h2f((mt_u16)(u.x & 0xffffu)); o[1] = mt_h2f((mt_u16)(u.x >> 16));
            o[2] = mt_h2f((mt_u16)(u.y & 0xffffu)); o[3] = mt_h2f((mt_u16)(u.y >> 16));
            o[4] = mt_h2f((mt_u16)(u.z & 0xffffu)); o[5] = mt_h2f((mt_u16)(u.z >> 16));
            o[6] = mt_h2f((mt_u16)(u.w & 0xffffu)); o[7] = mt_h2f((mt_u16)(u.w >> 16));
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = mt_h2f(p[k]);
        }
    }
};
struct KvBF16 {
    typedef mt_u16 T;
    static __device__ __forceinline__ float get(const mt_u16* r, int i) { return mt_bf2f(r[i]); }
    static __device__ __forceinline__ void get8(const mt_u16* r, int i, bool vec, float* o) {
        const mt_u16* p = r + i;
        if (vec) {
            const uint4 u = *(const uint4*)p;
            o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
            o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
            o[4] = __uint_as_float(u.z << 16); o[5] = __uint_as_float(u.z & 0xffff0000u);
            o[6] = __uint_as_float(u.w << 16); o[7] = __uint_as_float(u.w & 0xffff0000u);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = mt_bf2f(p[k]);
        }
    }
};

// 4-bit element e of the nibbles at qs (e < 16 low nibble of qs[e], else high of qs[e-16])
__device__ __forceinline__ int mt_nib(const mt_u8* qs, int e) {
    const int b = qs[e & 15];
    return (e & 16) ? (b >> 4) : (b & 15);
}
// 8 nibbles e0..e0+7 (e0 % 8 == 0) of the nibbles at qs (2-byte aligned)
__device__ __forceinline__ void mt_nib8(const mt_u8* qs, int e0, int* q) {
    const int sh = (e0 & 16) ? 4 : 0;
    const mt_u32 w0 = mt_ld32(qs + (e0 & 15)), w1 = mt_ld32(qs + (e0 & 15) + 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] = (int)((w0 >> (8 * k + sh)) & 15u);
        q[4 + k] = (int)((w1 >> (8 * k + sh)) & 15u);
    }
}

struct KvQ8_0 {
    typedef mt_u8 T;
    enum { QK = 32, BYTES = 34 };
    static __device__ __forceinline__ float get(const mt_u8* r, int i) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        return __fmul_rn((float)(mt_i8)b[2 + (i & 31)], mt_ldh(b));
    }
    static __device__ __forceinline__ void get8(const mt_u8* r, int i, bool, float* o) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const float d = mt_ldh(b);
        const mt_u8* q = b + 2 + (i & 31);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const mt_u16 w = mt_ld16(q + 2 * k);
            o[2 * k] = __fmul_rn((float)(mt_i8)(w & 0xffu), d);
            o[2 * k + 1] = __fmul_rn((float)(mt_i8)(w >> 8), d);
        }
    }
    // d = amax / 127, q = round(x / d) (half away from zero)
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) {
        const float amax = __uint_as_float((mt_u32)mt_warp_max_i((int)(__float_as_uint(x) & 0x7fffffffu)));
        const float d = mt_div_x(amax, 127.0f);
        const float id = mt_inv_or_zero(d);
        const int q = (int)roundf(mt_mul_x(x, id));
        if (lane == 0) mt_st16(b, mt_f2h(d));
        b[2 + lane] = (mt_u8)(mt_i8)q;
    }
};

struct KvQ4_0 {
    typedef mt_u8 T;
    enum { QK = 32, BYTES = 18 };
    static __device__ __forceinline__ float get(const mt_u8* r, int i) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        return __fmul_rn(mt_ldh(b), (float)(mt_nib(b + 2, i & 31) - 8));
    }
    static __device__ __forceinline__ void get8(const mt_u8* r, int i, bool, float* o) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const float d = mt_ldh(b);
        int q[8];
        mt_nib8(b + 2, i & 31, q);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = __fmul_rn(d, (float)(q[k] - 8));
    }
    // d = max / -8 (max: the signed value of largest magnitude), q = min(15, trunc(x/d + 8.5))
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) {
        const float d = mt_div_x(mt_warp_absmax_signed(x, lane), -8.0f);
        const float id = mt_inv_or_zero(d);
        const int q = min(15, (int)mt_add_x(mt_mul_x(x, id), 8.5f));
        const int hi = __shfl_xor_sync(0xffffffffu, q, 16);
        if (lane == 0) mt_st16(b, mt_f2h(d));
        if (lane < 16) b[2 + lane] = (mt_u8)(q | (hi << 4));
    }
};

struct KvQ4_1 {
    typedef mt_u8 T;
    enum { QK = 32, BYTES = 20 };
    static __device__ __forceinline__ float get(const mt_u8* r, int i) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        return __fadd_rn(__fmul_rn(mt_ldh(b), (float)mt_nib(b + 4, i & 31)), mt_ldh(b + 2));
    }
    static __device__ __forceinline__ void get8(const mt_u8* r, int i, bool, float* o) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const float d = mt_ldh(b), m = mt_ldh(b + 2);
        int q[8];
        mt_nib8(b + 4, i & 31, q);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = __fadd_rn(__fmul_rn(d, (float)q[k]), m);
    }
    // d = (max - min) / 15, m = min, q = min(15, trunc((x - min)/d + 0.5))
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) {
        const float mx = mt_from_key(mt_warp_max_i(mt_order_key(x)));
        const float mn = mt_from_key(mt_warp_min_i(mt_order_key(x)));
        const float d = mt_div_x(mt_sub_x(mx, mn), 15.0f);
        const float id = mt_inv_or_zero(d);
        const int q = min(15, (int)mt_add_x(mt_mul_x(mt_sub_x(x, mn), id), 0.5f));
        const int hi = __shfl_xor_sync(0xffffffffu, q, 16);
        if (lane == 0) {
            mt_st16(b, mt_f2h(d));
            mt_st16(b + 2, mt_f2h(mn));
        }
        if (lane < 16) b[4 + lane] = (mt_u8)(q | (hi << 4));
    }
};

struct KvQ5_0 {
    typedef mt_u8 T;
    enum { QK = 32, BYTES = 22 };
    static __device__ __forceinline__ float get(const mt_u8* r, int i) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const int e = i & 31;
        const int q = mt_nib(b + 6, e) | (int)(((mt_ld32(b + 2) >> e) & 1u) << 4);
        return __fmul_rn(mt_ldh(b), (float)(q - 16));
    }
    static __device__ __forceinline__ void get8(const mt_u8* r, int i, bool, float* o) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const int e0 = i & 31;
        const float d = mt_ldh(b);
        const mt_u32 qh = mt_ld32(b + 2) >> e0;
        int q[8];
        mt_nib8(b + 6, e0, q);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = __fmul_rn(d, (float)((q[k] | (int)(((qh >> k) & 1u) << 4)) - 16));
    }
    // d = max / -16, q = min(31, trunc(x/d + 16.5))
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) {
        const float d = mt_div_x(mt_warp_absmax_signed(x, lane), -16.0f);
        const float id = mt_inv_or_zero(d);
        const int q = min(31, (int)mt_add_x(mt_mul_x(x, id), 16.5f));
        const int hi = __shfl_xor_sync(0xffffffffu, q, 16);
        const mt_u32 qh = mt_warp_or(((mt_u32)(q >> 4) & 1u) << lane);
        if (lane == 0) {
            mt_st16(b, mt_f2h(d));
            mt_st32(b + 2, qh);
        }
        if (lane < 16) b[6 + lane] = (mt_u8)((q & 15) | ((hi & 15) << 4));
    }
};

struct KvQ5_1 {
    typedef mt_u8 T;
    enum { QK = 32, BYTES = 24 };
    static __device__ __forceinline__ float get(const mt_u8* r, int i) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const int e = i & 31;
        const int q = mt_nib(b + 8, e) | (int)(((mt_ld32(b + 4) >> e) & 1u) << 4);
        return __fadd_rn(__fmul_rn(mt_ldh(b), (float)q), mt_ldh(b + 2));
    }
    static __device__ __forceinline__ void get8(const mt_u8* r, int i, bool, float* o) {
        const mt_u8* b = r + (i >> 5) * BYTES;
        const int e0 = i & 31;
        const float d = mt_ldh(b), m = mt_ldh(b + 2);
        const mt_u32 qh = mt_ld32(b + 4) >> e0;
        int q[8];
        mt_nib8(b + 8, e0, q);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = __fadd_rn(__fmul_rn(d, (float)(q[k] | (int)(((qh >> k) & 1u) << 4))), m);
    }
    // d = (max - min) / 31, m = min, q = min(31, trunc((x - min)/d + 0.5))
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) {
        const float mx = mt_from_key(mt_warp_max_i(mt_order_key(x)));
        const float mn = mt_from_key(mt_warp_min_i(mt_order_key(x)));
        const float d = mt_div_x(mt_sub_x(mx, mn), 31.0f);
        const float id = mt_inv_or_zero(d);
        const int q = min(31, (int)mt_add_x(mt_mul_x(mt_sub_x(x, mn), id), 0.5f));
        const int hi = __shfl_xor_sync(0xffffffffu, q, 16);
        const mt_u32 qh = mt_warp_or(((mt_u32)(q >> 4) & 1u) << lane);
        if (lane == 0) {
            mt_st16(b, mt_f2h(d));
            mt_st16(b + 2, mt_f2h(mn));
            mt_st32(b + 4, qh);
        }
        if (lane < 16) b[8 + lane] = (mt_u8)((q & 15) | ((hi & 15) << 4));
    }
};

#endif  // METATP_KVCACHE_CUH
