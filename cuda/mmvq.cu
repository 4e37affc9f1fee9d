// metatp: y = W x for few tokens with int8 dot products (numerics="q8"), as llama.cpp's mmvq:
// x is rounded to Q8 blocks exactly as llama.cpp's CPU backend rounds it (ggml-cpu's
// quantize_row_q8_0 / q8_1 / q8_K), the weight's integer codes are multiplied with the
// activation codes 4 at a time (__dp4a), and the float block scales come after, per block:
//   y[t, r] = sum_b  scale_w[r, b] * d_x[t, b] * isum(r, t, b)  +  min_w[r, b] * s_x[t, b]
// (b a 32-element block; Q6_K scales each 16-element half apart). The weight's codes and
// scales are those of backends/numpy/codes.py (scale = d*sc rounded once, min = -(dmin*m)),
// the activation's those of the numpy backend's integer kernel (csrc/q8.c), so both backends
// give the same logits up to float summation order.
//
// Activation kinds (the weight type's llama.cpp vec_dot_type):
//   Q8_0 (q8_0, q4_0, q5_0):  blocks of 32, d = f16(amax / 127), q = rint(x * (127 / amax));
//   Q8_1 (q4_1, q5_1):         Q8_0 plus s = f16(amax/127 * sum q) (the unrounded d);
//   Q8_K (q2_k .. q6_k):       blocks of 256, max = the first x of largest |x|, iscale =
//                              -127 / max, q = min(127, rint(iscale * x)), d = 1 / iscale;
//                              the min term takes s = d * (sum of q over the 32-element block).
// In memory (workspace or shared): codes int8 [ne0] per token; d and s float [ne0 / 32] each
// per token (Q8_K's d repeated over its 8 blocks of 32).
//
// Entry points (W: q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k; matvec's shapes):
//   mmvq_<t>_x1           one token, x quantized in the block's prologue (shared memory)
//   mmvq_<t>_t<NT>        1..NT tokens from a quantized workspace (mmvq_quantize_<kind>)
//   mmvq_multi_<t>        q/k/v in one launch, RMS norm of x folded in (as matvec_multi)
//   mmvq_<act>_<t>        gate/up + GLU, RMS norm folded in (as matvec_<act>)
//   mmvq_quantize_<kind>  x -> codes, d, s (workspace) for several tokens
//   mmvq_round_<kind>     x -> q * d as float (the many-token path: mmq on rounded x)
#include "quant.cuh"

#define MT_Q8_0 0
#define MT_Q8_1 1
#define MT_Q8_K 2

__device__ __forceinline__ int mt_warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float mt_round_half(float v) { return mt_h2f(mt_f2h(v)); }

// ------------------------------------------------------------------ activation rounding
// One warp rounds one activation block (32 elements for Q8_0/Q8_1, 256 for Q8_K; lane l holds
// elements l*E .. l*E+E-1). x' = x, or with `norm`: (x * scale) * nw (nw null: no weight), in the
// order of the RMS_NORM and MUL kernels. Out: the lane's codes, and the d and s of its
// 32-element block.
template <int KIND>
struct MtQ8 {
    enum { E = KIND == MT_Q8_K ? 8 : 1, BLK = 32 * E };
};

template <int KIND>
__device__ __forceinline__ void mt_q8_warp(const float* xb, const float* nwb, int norm, float scale,
                                           int (&q)[MtQ8<KIND>::E], float& d, float& s) {
    enum { E = MtQ8<KIND>::E };
    const int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
    float v[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
        v[k] = xb[lane * E + k];
        if (norm) {
            v[k] = __fmul_rn(v[k], scale);
            if (nwb != 0) v[k] = __fmul_rn(v[k], nwb[lane * E + k]);
        }
    }
    if (KIND != MT_Q8_K) {
        const float amax = mt_warp_max(fabsf(v[0]));
        const float db = __fdiv_rn(amax, 127.0f);
        const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        q[0] = (int)rintf(__fmul_rn(v[0], id));
        const int sum = mt_warp_sum_i(q[0]);
        d = mt_round_half(db);
        s = KIND == MT_Q8_1 ? mt_round_half(__fmul_rn(db, (float)sum)) : __fmul_rn(d, (float)sum);
        return;
    }
    // Q8_K: the first element of largest |x| (ties: the lower index), over the warp
    float a = -1.0f, mx = 0.0f;
    int at = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
        if (fabsf(v[k]) > a) {
            a = fabsf(v[k]);
            mx = v[k];
            at = lane * E + k;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(0xffffffffu, a, o);
        const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        const int at2 = __shfl_xor_sync(0xffffffffu, at, o);
        if (a2 > a || (a2 == a && at2 < at)) {
            a = a2;
            mx = m2;
            at = at2;
        }
    }
    int sum = 0;
    if (a == 0.0f) {
        d = 0.0f;
#pragma unroll
        for (int k = 0; k < E; ++k) q[k] = 0;
    } else {
        const float iscale = __fdiv_rn(-127.0f, mx);
#pragma unroll
        for (int k = 0; k < E; ++k) {
            q[k] = min(127, (int)rintf(__fmul_rn(iscale, v[k])));
            sum += q[k];
        }
        d = __fdiv_rn(1.0f, iscale);
    }
    // the 32-element block of this lane: lanes 4m .. 4m+3
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    s = __fmul_rn(d, (float)sum);
}

// Rounds x (ne0 elements) into codes q, d and s (per 32 elements), every warp of the block taking
// activation blocks in turn. Lane 0 of each 32-element block writes its d and s.
template <int KIND>
__device__ __forceinline__ void mt_q8_rows(const float* x, const float* nw, int norm, float scale,
                                           int ne0, int warp, int n_warps, mt_i8* q, float* d,
                                           float* s) {
    enum { E = MtQ8<KIND>::E, BLK = MtQ8<KIND>::BLK };
    const int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
    for (int b = warp; b < ne0 / BLK; b += n_warps) {
        int qv[E];
        float dv, sv;
        mt_q8_warp<KIND>(x + (mt_i64)b * BLK, nw != 0 ? nw + (mt_i64)b * BLK : 0, norm, scale, qv, dv,
                         sv);
        const int i0 = b * BLK + lane * E;
#pragma unroll
        for (int k = 0; k < E; ++k) q[i0 + k] = (mt_i8)qv[k];
        if ((i0 & 31) == 0) {
            d[i0 >> 5] = dv;
            s[i0 >> 5] = sv;
        }
    }
}

// mmvq_quantize_<kind>(const float *x, int32 x_stride, int32 ne0, int32 n_tokens, int8 *xq,
//                      float *xd, float *xs)
// Token t: codes at xq + t*ne0, d and s at xd / xs + t*(ne0/32). Launch: block (32, 8),
// grid (ceil(activation blocks / 8), n_tokens); ne0 a multiple of 32 (Q8_K: 256).
template <int KIND>
__device__ __forceinline__ void mt_mmvq_quantize(const float* x, int x_stride, int ne0, mt_i8* xq,
                                                 float* xd, float* xs) {
    const int t = blockIdx.y;
    const int warp = blockIdx.x * blockDim.y + threadIdx.y;
    const int nb = ne0 / MtQ8<KIND>::BLK;
    if (warp >= nb) return;  // the whole warp: no exchange is left waiting
    mt_q8_rows<KIND>(x + (mt_i64)t * x_stride, 0, 0, 1.0f, ne0, warp, nb, xq + (mt_i64)t * ne0,
                     xd + (mt_i64)t * (ne0 / 32), xs + (mt_i64)t * (ne0 / 32));
}

// mmvq_round_<kind>(const float *x, int32 x_stride, int32 ne0, int32 n_tokens, float *out,
//                   int32 out_stride)
// out[t*out_stride + i] = q * d: x on its Q8 grid (the same codes and scales), for the float
// tiled product of many tokens. Launch as mmvq_quantize; out may alias x.
template <int KIND>
__device__ __forceinline__ void mt_mmvq_round(const float* x, int x_stride, int ne0, float* out,
                                              int out_stride) {
    enum { E = MtQ8<KIND>::E, BLK = MtQ8<KIND>::BLK };
    const int t = blockIdx.y;
    const int b = blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= ne0 / BLK) return;
    const int lane = threadIdx.x & 31;
    int qv[E];
    float dv, sv;
    mt_q8_warp<KIND>(x + (mt_i64)t * x_stride + (mt_i64)b * BLK, 0, 0, 1.0f, qv, dv, sv);
    float* o = out + (mt_i64)t * out_stride + (mt_i64)b * BLK + lane * E;
#pragma unroll
    for (int k = 0; k < E; ++k) o[k] = __fmul_rn((float)qv[k], dv);
}

#define MT_MMVQ_Q8_ENTRIES(name, KIND)                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        mmvq_quantize_##name(const float* x, int x_stride, int ne0, int n_tokens, mt_i8* xq,    \
                             float* xd, float* xs) { mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        mt_mmvq_quantize<KIND>(x, x_stride, ne0, xq, xd, xs);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        mmvq_round_##name(const float* x, int x_stride, int ne0, int n_tokens, float* out,      \
                          int out_stride) { mt_pdl_wait(); mt_pdl_launch_dependents();                                                     \
        mt_mmvq_round<KIND>(x, x_stride, ne0, out, out_stride);                                 \
    }

MT_MMVQ_Q8_ENTRIES(q8_0, MT_Q8_0)
MT_MMVQ_Q8_ENTRIES(q8_1, MT_Q8_1)
MT_MMVQ_Q8_ENTRIES(q8_k, MT_Q8_K)

// ------------------------------------------------------------------ weight codes
// (mt_unbias4, mt_qh_bytes and mt_q5_codes: quant.cuh, shared with mmq.cu)

// Each weight type: QK, BYTES, KIND (the activation's), NSC (scales per 32 elements: the halves
// of 16 of Q2_K, Q3_K and Q6_K have their own), HAS_MIN (NSC == 2: a min per half, which
// multiplies d * the half's sum of activation codes; else one min per 32, times s), and
// codes<VEC>(block, j, q, sc, mn): the 32 signed codes of 32-element block j of the weight block
// as 8 words (elements 4i..4i+3 in word i, lowest byte first), their scale(s) and min(s).
// VEC: 16-byte loads (the block 16-byte aligned).
struct MqQ8_0 {
    enum { QK = 32, BYTES = 34, KIND = MT_Q8_0, NSC = 1, HAS_MIN = 0 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        sc[0] = mt_ldh(b);
        mn[0] = mn[1] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)mt_ld32(b + 2 + 4 * i);
    }
};

// Q4_0 / Q4_1: element i < 16 is the low nibble of qs[i], i >= 16 the high nibble of qs[i-16].
struct MqQ4_0 {
    enum { QK = 32, BYTES = 18, KIND = MT_Q8_0, NSC = 1, HAS_MIN = 0 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        sc[0] = mt_ldh(b);
        mn[0] = mn[1] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const mt_u32 v = mt_ld32(b + 2 + 4 * i);
            q[i] = mt_unbias4(v & 0x0f0f0f0fu, 8);
            q[4 + i] = mt_unbias4((v >> 4) & 0x0f0f0f0fu, 8);
        }
    }
};

struct MqQ4_1 {
    enum { QK = 32, BYTES = 20, KIND = MT_Q8_1, NSC = 1, HAS_MIN = 1 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        sc[0] = mt_ldh(b);
        mn[0] = mt_ldh(b + 2);
        mn[1] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const mt_u32 v = mt_ld32(b + 4 + 4 * i);
            q[i] = (int)(v & 0x0f0f0f0fu);
            q[4 + i] = (int)((v >> 4) & 0x0f0f0f0fu);
        }
    }
};

// Q5_0 / Q5_1: Q4_0's nibbles plus bit 4 from the u32 qh (bit i for element i).
struct MqQ5_0 {
    enum { QK = 32, BYTES = 22, KIND = MT_Q8_0, NSC = 1, HAS_MIN = 0 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        sc[0] = mt_ldh(b);
        mn[0] = mn[1] = 0.0f;
        mt_q5_codes<2, 16>(b, q);
    }
};

struct MqQ5_1 {
    enum { QK = 32, BYTES = 24, KIND = MT_Q8_1, NSC = 1, HAS_MIN = 1 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        sc[0] = mt_ldh(b);
        mn[0] = mt_ldh(b + 2);
        mn[1] = 0.0f;
        mt_q5_codes<4, 0>(b, q);
    }
};

// 8 words from p: four 16-byte loads (p 16-byte aligned) or sixteen 2-byte ones.
template <bool VEC>
__device__ __forceinline__ void mt_ld_words8(const mt_u8* p, mt_u32 (&w)[8]) {
    if (VEC) {
        const uint4 a = *(const uint4*)p;
        const uint4 c = *(const uint4*)(p + 16);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = c.x; w[5] = c.y; w[6] = c.z; w[7] = c.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = mt_ld32(p + 4 * i);
    }
}

// Q4_K (144 bytes, 16-byte multiple): block j's codes are the low (even j) or high (odd j)
// nibbles of qs[32*(j/2) .. +32]; scale d*sc_j, min -(dmin*m_j).
struct MqQ4_K {
    enum { QK = 256, BYTES = 144, KIND = MT_Q8_K, NSC = 1, HAS_MIN = 1 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int j, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        int s, m;
        mt_scale_min_k4(j, b + 4, &s, &m);
        sc[0] = __fmul_rn(mt_ldh(b), (float)s);
        mn[0] = -__fmul_rn(mt_ldh(b + 2), (float)m);
        mn[1] = 0.0f;
        mt_u32 w[8];
        mt_ld_words8<VEC>(b + 16 + 32 * (j >> 1), w);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)((w[i] >> sh) & 0x0f0f0f0fu);
    }
};

// Q5_K (176 bytes): Q4_K's nibbles (qs at 48) plus bit j of qh[l] (qh at 16) as bit 4.
struct MqQ5_K {
    enum { QK = 256, BYTES = 176, KIND = MT_Q8_K, NSC = 1, HAS_MIN = 1 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int j, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        int s, m;
        mt_scale_min_k4(j, b + 4, &s, &m);
        sc[0] = __fmul_rn(mt_ldh(b), (float)s);
        mn[0] = -__fmul_rn(mt_ldh(b + 2), (float)m);
        mn[1] = 0.0f;
        mt_u32 w[8], h[8];
        mt_ld_words8<VEC>(b + 48 + 32 * (j >> 1), w);
        mt_ld_words8<VEC>(b + 16, h);
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            q[i] = (int)(((w[i] >> sh) & 0x0f0f0f0fu) | (((h[i] >> j) & 0x01010101u) << 4));
    }
};

// Q2_K (84 bytes): block j = 4h + s holds elements 128h + 32s + l: (qs[32h + l] >> 2s) & 3 (qs
// at 16); its halves scaled by d * (scales[2j(+1)] & 15), min -(dmin * (scales[2j(+1)] >> 4)).
struct MqQ2_K {
    enum { QK = 256, BYTES = 84, KIND = MT_Q8_K, NSC = 2, HAS_MIN = 1 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int j, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        const float d = mt_ldh(b + 80), dmin = mt_ldh(b + 82);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int v = b[2 * j + i];
            sc[i] = __fmul_rn(d, (float)(v & 15));
            mn[i] = -__fmul_rn(dmin, (float)(v >> 4));
        }
        const mt_u8* qs = b + 16 + 32 * (j >> 2);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)((mt_ld32(qs + 4 * i) >> sh) & 0x03030303u);
    }
};

// Q3_K (110 bytes): block j = 4h + s holds elements 128h + 32s + l: (qs[32h + l] >> 2s) & 3 (qs
// at 32), minus 4 unless bit j of hmask[l] is set; halves scaled by d * (6-bit scale 2j(+1) - 32).
struct MqQ3_K {
    enum { QK = 256, BYTES = 110, KIND = MT_Q8_K, NSC = 2, HAS_MIN = 0 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int j, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        const float d = mt_ldh(b + 108);
        sc[0] = __fmul_rn(d, (float)mt_q3k_scale(b + 96, 2 * j));
        sc[1] = __fmul_rn(d, (float)mt_q3k_scale(b + 96, 2 * j + 1));
        mn[0] = mn[1] = 0.0f;
        const mt_u8* qs = b + 32 + 32 * (j >> 2);
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const mt_u32 lo = (mt_ld32(qs + 4 * i) >> sh) & 0x03030303u;
            const mt_u32 hb = (mt_ld32(b + 4 * i) >> j) & 0x01010101u;
            q[i] = mt_unbias4(lo | (hb << 2), 4);
        }
    }
};

// Q6_K (210 bytes, 2-byte aligned): block j = 4h + k holds elements 128h + 32k + l, l < 32:
// (ql[64h + 32(k&1) + l] >> 4(k>>1)) & 15 | ((qh[32h + l] >> 2k) & 3) << 4, minus 32; the halves
// l < 16 and l >= 16 scaled by d * scales[8h + 2k] and d * scales[8h + 2k + 1].
struct MqQ6_K {
    enum { QK = 256, BYTES = 210, KIND = MT_Q8_K, NSC = 2, HAS_MIN = 0 };
    template <bool VEC>
    static __device__ __forceinline__ void codes(const mt_u8* b, int j, int (&q)[8], float (&sc)[2],
                                                 float (&mn)[2]) {
        const int h = j >> 2, k = j & 3;
        const float d = mt_ldh(b + 208);
        sc[0] = __fmul_rn(d, (float)(mt_i8)b[192 + 8 * h + 2 * k]);
        sc[1] = __fmul_rn(d, (float)(mt_i8)b[192 + 8 * h + 2 * k + 1]);
        mn[0] = mn[1] = 0.0f;
        const mt_u8* ql = b + 64 * h + 32 * (k & 1);
        const mt_u8* qh = b + 128 + 32 * h;
        const int sl = 4 * (k >> 1), sh = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const mt_u32 lo = (mt_ld32(ql + 4 * i) >> sl) & 0x0f0f0f0fu;
            const mt_u32 hi = (mt_ld32(qh + 4 * i) >> sh) & 0x03030303u;
            q[i] = mt_unbias4(lo | (hi << 4), 32);
        }
    }
};

#define MT_FOR_ALL_MMVQ_TYPES(M) \
    M(q8_0, MqQ8_0)              \
    M(q4_0, MqQ4_0)              \
    M(q4_1, MqQ4_1)              \
    M(q5_0, MqQ5_0)              \
    M(q5_1, MqQ5_1)              \
    M(q2_k, MqQ2_K)              \
    M(q3_k, MqQ3_K)              \
    M(q4_k, MqQ4_K)              \
    M(q5_k, MqQ5_K)              \
    M(q6_k, MqQ6_K)

// ------------------------------------------------------------------ the dot products
// Block (bx, by) as matvec: by rows, bx threads per row walking the row's 32-element blocks
// with stride bx. Token t's activation: codes xq + t*ne0, d / s at xd / xs + t*(ne0/32).
// Returns true in the one thread per row that holds the finished sums in acc.
template <typename W, int NT, int NW, bool VEC>
__device__ __forceinline__ bool mt_mmvq_rows(const mt_u8* const* w, const mt_i8* xq,
                                             const float* xd, const float* xs, int ne0, int n_rows,
                                             int row_bytes, int n_tok, float (&acc)[NW][NT],
                                             int row_block) {
    const int row = row_block * blockDim.y + threadIdx.y;
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t] = 0.0f;

    if (row < n_rows) {
        const int units = ne0 / 32;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            const int ib = u / (W::QK / 32);
            const int sub = u - ib * (W::QK / 32);
            int q[NW][8];
            float sc[NW][2], mn[NW][2];
#pragma unroll
            for (int j = 0; j < NW; ++j)
                W::template codes<VEC>(w[j] + (mt_i64)row * row_bytes + (mt_i64)ib * W::BYTES, sub,
                                       q[j], sc[j], mn[j]);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const int* xi = (const int*)(xq + (mt_i64)t * ne0 + (mt_i64)u * 32);
                    int xv[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) xv[i] = xi[i];
                    const float dx = xd[(mt_i64)t * (ne0 / 32) + u];
                    const float sx = xs[(mt_i64)t * (ne0 / 32) + u];
                    // a min per half (Q2_K): d * the half's sum of activation codes, as s is
                    float sh0 = 0.0f, sh1 = 0.0f;
                    if (W::HAS_MIN && W::NSC == 2) {
                        int c0 = 0, c1 = 0;
#pragma unroll
                        for (int i = 0; i < 4; ++i) c0 = __dp4a(xv[i], 0x01010101, c0);
#pragma unroll
                        for (int i = 4; i < 8; ++i) c1 = __dp4a(xv[i], 0x01010101, c1);
                        sh0 = __fmul_rn(dx, (float)c0);
                        sh1 = __fmul_rn(dx, (float)c1);
                    }
#pragma unroll
                    for (int j = 0; j < NW; ++j) {
                        int s0 = 0, s1 = 0;
#pragma unroll
                        for (int i = 0; i < 4; ++i) s0 = __dp4a(q[j][i], xv[i], s0);
#pragma unroll
                        for (int i = 4; i < 8; ++i) s1 = __dp4a(q[j][i], xv[i], s1);
                        float r;
                        if (W::NSC == 2)
                            r = dx * (sc[j][0] * (float)s0 + sc[j][1] * (float)s1);
                        else
                            r = sc[j][0] * dx * (float)(s0 + s1);
                        if (W::HAS_MIN && W::NSC == 2)
                            r = fmaf(mn[j][1], sh1, fmaf(mn[j][0], sh0, r));
                        else if (W::HAS_MIN)
                            r = fmaf(mn[j][0], sx, r);
                        acc[j][t] += r;
                    }
                }
            }
        }
    }

    return mt_rows_reduce<NW, NT>(acc, row, n_rows);
}

// 16-byte loads when every weight pointer and the row stride are 16-byte aligned (Q4_K, Q5_K
// blocks are 16-byte multiples); the choice is uniform over the launch.
template <typename W, int NT, int NW>
__device__ __forceinline__ bool mt_mmvq_rows_any(const mt_u8* const* w, const mt_i8* xq,
                                                 const float* xd, const float* xs, int ne0,
                                                 int n_rows, int row_bytes, int n_tok,
                                                 float (&acc)[NW][NT], int row_block) {
    bool vec = (W::BYTES % 16) == 0 && (row_bytes % 16) == 0;
#pragma unroll
    for (int j = 0; j < NW; ++j) vec = vec && ((mt_u64)(const void*)w[j] % 16) == 0;
    if (vec)
        return mt_mmvq_rows<W, NT, NW, true>(w, xq, xd, xs, ne0, n_rows, row_bytes, n_tok, acc,
                                            row_block);
    return mt_mmvq_rows<W, NT, NW, false>(w, xq, xd, xs, ne0, n_rows, row_bytes, n_tok, acc,
                                         row_block);
}

// The one-token prologue: x (RMS-normalised first when norm != 0) rounded into dynamic shared
// memory: codes [ne0], d [ne0/32], s [ne0/32] (1.25 * ne0 bytes). Every thread must call it.
extern __shared__ int mt_mmvq_smem[];

template <int KIND>
__device__ __forceinline__ void mt_mmvq_prologue(const float* x, int ne0, const float* norm_w,
                                                 float eps, int norm) {
    const float scale = norm ? mt_rms_scale(x, ne0, eps) : 1.0f;
    mt_i8* q = (mt_i8*)mt_mmvq_smem;
    float* d = (float*)(mt_mmvq_smem + ne0 / 4);
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int n_warps = (blockDim.x * blockDim.y) >> 5;
    mt_q8_rows<KIND>(x, norm ? norm_w : 0, norm, scale, ne0, tid >> 5, n_warps, q, d, d + ne0 / 32);
    __syncthreads();
}

__device__ __forceinline__ const mt_i8* mt_mmvq_sq() { return (const mt_i8*)mt_mmvq_smem; }
__device__ __forceinline__ const float* mt_mmvq_sd(int ne0) {
    return (const float*)(mt_mmvq_smem + ne0 / 4);
}

// mmvq_<type>_t<NT>(const uint8 *w, const int8 *xq, const float *xd, const float *xs, float *y,
//     int32 ne0, int32 n_rows, int32 row_bytes, int32 n_tokens, int32 y_stride,
//     const float *add /* or null */, int32 add_stride)
// y[t*y_stride + r] = W[r] . x_t (+ add[t*add_stride + r]) for t < n_tokens <= NT, x_t from the
// workspace. Launch: block (bx, by) as matvec, grid (ceil(n_rows / by)).
template <typename W, int NT>
__device__ __forceinline__ void mt_mmvq(const mt_u8* w, const mt_i8* xq, const float* xd,
                                        const float* xs, float* y, int ne0, int n_rows,
                                        int row_bytes, int n_tok, int y_stride, const float* add,
                                        int add_stride) {
    const mt_u8* ws[1] = {w};
    float acc[1][NT];
    if (!mt_mmvq_rows_any<W, NT, 1>(ws, xq, xd, xs, ne0, n_rows, row_bytes, n_tok, acc,
                                    blockIdx.x))
        return;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            float r = acc[0][t];
            if (add != 0) r += add[(mt_i64)t * add_stride + row];
            y[(mt_i64)t * y_stride + row] = r;
        }
    }
}

// mmvq_<type>_x1(const uint8 *w, const float *x, float *y, int32 ne0, int32 n_rows,
//     int32 row_bytes, const float *add /* or null */)
// One token, x rounded in the prologue. Launch: block (bx, by) as matvec, any grid (a block
// walks the row blocks blockIdx.x, + gridDim.x, ...: one prologue serves several of them),
// dynamic shared memory 1.25 * ne0 bytes.
template <typename W>
__device__ __forceinline__ void mt_mmvq_x1(const mt_u8* w, const float* x, float* y, int ne0,
                                           int n_rows, int row_bytes, const float* add) {
    mt_mmvq_prologue<W::KIND>(x, ne0, 0, 0.0f, 0);
    const mt_u8* ws[1] = {w};
    const float* sd = mt_mmvq_sd(ne0);
    const int n_rb = (n_rows + blockDim.y - 1) / blockDim.y;
    for (int rb = blockIdx.x; rb < n_rb; rb += gridDim.x) {
        float acc[1][1];
        if (mt_mmvq_rows_any<W, 1, 1>(ws, mt_mmvq_sq(), sd, sd + ne0 / 32, ne0, n_rows, row_bytes,
                                      1, acc, rb)) {
            const int row = rb * blockDim.y + threadIdx.y;
            y[row] = acc[0][0] + (add != 0 ? add[row] : 0.0f);
        }
        __syncthreads();  // the reduction's shared memory is reused by the next row block
    }
}

#define MT_MMVQ_ENTRY_T(name, W, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        mmvq_##name##_t##NT(const mt_u8* w, const mt_i8* xq, const float* xd, const float* xs,   \
                            float* y, int ne0, int n_rows, int row_bytes, int n_tokens,          \
                            int y_stride, const float* add, int add_stride) { mt_pdl_wait(); mt_pdl_launch_dependents();                    \
        mt_mmvq<W, NT>(w, xq, xd, xs, y, ne0, n_rows, row_bytes, n_tokens, y_stride, add,        \
                       add_stride);                                                              \
    }
#define MT_MMVQ_ENTRY(name, W)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        mmvq_##name##_x1(const mt_u8* w, const float* x, float* y, int ne0, int n_rows,          \
                         int row_bytes, const float* add) { mt_pdl_wait(); mt_pdl_launch_dependents();                                      \
        mt_mmvq_x1<W>(w, x, y, ne0, n_rows, row_bytes, add);                                     \
    }                                                                                            \
    MT_MMVQ_ENTRY_T(name, W, 1)                                                                  \
    MT_MMVQ_ENTRY_T(name, W, 2)                                                                  \
    MT_MMVQ_ENTRY_T(name, W, 4)                                                                  \
    MT_MMVQ_ENTRY_T(name, W, 8)

MT_FOR_ALL_MMVQ_TYPES(MT_MMVQ_ENTRY)

// ------------------------------------------------------------------ several weights, one x
// mmvq_multi_<type>: matvec_multi's arguments; block as matvec, any grid (a block walks the
// sum_j ceil(rows_j / by) row blocks with stride gridDim.x: the first ceil(rows0 / by) are W0's,
// the next W1's, then W2's); dynamic shared memory 1.25 * ne0 bytes.
template <typename W>
__device__ __forceinline__ void mt_mmvq_multi(const mt_u8* w0, const mt_u8* w1, const mt_u8* w2,
                                              float* y0, float* y1, float* y2, int rows0, int rows1,
                                              int rows2, int rb0, int rb1, int rb2, const float* x,
                                              int ne0, const float* norm_w, float eps, int norm) {
    mt_mmvq_prologue<W::KIND>(x, ne0, norm_w, eps, norm);
    const int by = blockDim.y;
    const int nb0 = (rows0 + by - 1) / by, nb1 = (rows1 + by - 1) / by;
    const int n_rb = nb0 + nb1 + (rows2 + by - 1) / by;
    const float* sd = mt_mmvq_sd(ne0);
    for (int vb = blockIdx.x; vb < n_rb; vb += gridDim.x) {
        int b = vb;
        const mt_u8* w = w0;
        float* y = y0;
        int rows = rows0, rb = rb0;
        if (b >= nb0 + nb1) {
            b -= nb0 + nb1;
            w = w2; y = y2; rows = rows2; rb = rb2;
        } else if (b >= nb0) {
            b -= nb0;
            w = w1; y = y1; rows = rows1; rb = rb1;
        }
        const mt_u8* ws[1] = {w};
        float acc[1][1];
        if (mt_mmvq_rows_any<W, 1, 1>(ws, mt_mmvq_sq(), sd, sd + ne0 / 32, ne0, rows, rb, 1, acc, b))
            y[b * by + threadIdx.y] = acc[0][0];
        __syncthreads();  // the reduction's shared memory is reused by the next row block
    }
}

#define MT_MMVQ_MULTI_ENTRY(name, W)                                                            \
    extern "C" __global__ void __launch_bounds__(256) mmvq_multi_##name(                       \
        const mt_u8* w0, const mt_u8* w1, const mt_u8* w2, float* y0, float* y1, float* y2,     \
        int rows0, int rows1, int rows2, int rb0, int rb1, int rb2, const float* x, int ne0,    \
        const float* norm_w, float eps, int norm) { mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        mt_mmvq_multi<W>(w0, w1, w2, y0, y1, y2, rows0, rows1, rows2, rb0, rb1, rb2, x, ne0,    \
                         norm_w, eps, norm);                                                   \
    }

MT_FOR_ALL_MMVQ_TYPES(MT_MMVQ_MULTI_ENTRY)

// ------------------------------------------------------------------ gate/up + GLU
// mmvq_<swiglu|geglu>_<type>: matvec_<act>'s arguments; block as matvec, any grid (row blocks
// walked as mmvq_x1); dynamic shared memory 1.25 * ne0 bytes.
// y[r] = act(Wg[r] . x') * (Wu[r] . x'), x' rounded after the norm.
struct MqSilu { static __device__ __forceinline__ float f(float v) { return mt_silu(v); } };
struct MqGelu { static __device__ __forceinline__ float f(float v) { return mt_gelu(v); } };

template <typename W, typename ACT>
__device__ __forceinline__ void mt_mmvq_glu(const mt_u8* wg, const mt_u8* wu, const float* x,
                                            float* y, int ne0, int n_rows, int row_bytes,
                                            const float* norm_w, float eps, int norm) {
    mt_mmvq_prologue<W::KIND>(x, ne0, norm_w, eps, norm);
    const mt_u8* ws[2] = {wg, wu};
    const float* sd = mt_mmvq_sd(ne0);
    const int n_rb = (n_rows + blockDim.y - 1) / blockDim.y;
    for (int rb = blockIdx.x; rb < n_rb; rb += gridDim.x) {
        float acc[2][1];
        if (mt_mmvq_rows_any<W, 1, 2>(ws, mt_mmvq_sq(), sd, sd + ne0 / 32, ne0, n_rows, row_bytes,
                                      1, acc, rb)) {
            const int row = rb * blockDim.y + threadIdx.y;
            y[row] = ACT::f(acc[0][0]) * acc[1][0];
        }
        __syncthreads();  // the reduction's shared memory is reused by the next row block
    }
}

#define MT_MMVQ_GLU_ENTRY(name, W)                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        mmvq_swiglu_##name(const mt_u8* wg, const mt_u8* wu, const float* x, float* y,        \
                           int ne0, int n_rows, int row_bytes, const float* norm_w,           \
                           float eps, int norm) { mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        mt_mmvq_glu<W, MqSilu>(wg, wu, x, y, ne0, n_rows, row_bytes, norm_w, eps, norm);      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        mmvq_geglu_##name(const mt_u8* wg, const mt_u8* wu, const float* x, float* y,         \
                          int ne0, int n_rows, int row_bytes, const float* norm_w,            \
                          float eps, int norm) { mt_pdl_wait(); mt_pdl_launch_dependents();                                              \
        mt_mmvq_glu<W, MqGelu>(wg, wu, x, y, ne0, n_rows, row_bytes, norm_w, eps, norm);      \
    }

MT_FOR_ALL_MMVQ_TYPES(MT_MMVQ_GLU_ENTRY)

// ------------------------------------------------------------------ f16 / bf16 weights
// mmvq_round_f16(const float *x, int32 x_stride, int32 ne0, int32 n_tokens, float *out,
//     int32 out_stride, const float *norm_w /* or null */, float32 eps, int32 norm)
// out[t*out_stride + i] = f16(x'[t, i]) as float: llama.cpp's CPU backend rounds x to f16 before a
// product with an f16 or bf16 weight; x' = x, or with norm != 0 (x * rms scale) * norm_w, the
// norm folded into the product that reads x. Launch: block (256), grid (n_tokens).
extern "C" __global__ void __launch_bounds__(256)
    mmvq_round_f16(const float* x, int x_stride, int ne0, int n_tokens, float* out, int out_stride,
                   const float* norm_w, float eps, int norm) { mt_pdl_wait(); mt_pdl_launch_dependents();
    const float* xt = x + (mt_i64)blockIdx.x * x_stride;
    float* ot = out + (mt_i64)blockIdx.x * out_stride;
    const float scale = norm ? mt_rms_scale(xt, ne0, eps) : 1.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        float v = xt[i];
        if (norm) {
            v = __fmul_rn(v, scale);
            if (norm_w != 0) v = __fmul_rn(v, norm_w[i]);
        }
        ot[i] = mt_round_half(v);
    }
}
