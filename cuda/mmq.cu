// metatp: y = W x for many tokens (prefill, batched decode), reading ggml weights directly:
// llama.cpp's MMQ idea. A block owns a tile of MT_MMQ_TR output rows x TT tokens; it walks
// the row length in steps of MT_MMQ_KS elements, and each step decodes the tile's weight
// blocks ONCE into shared memory (f32), loads the tokens' activations for the same
// elements beside them, and multiplies the two tiles for all TT tokens. The weights are
// read from global memory ceil(n_tokens / TT) times per launch instead of once per few
// tokens (matvec) or dequantized to a whole f16 copy first (the cuBLAS path).
//
// Layout as matvec.cu: W has n_rows rows of ne0 elements, row r at W + r*row_bytes (a
// per-device slice of a split weight is a pointer offset + the full row_bytes); x f32,
// token t at x + t*x_stride; y f32, token t at y + t*y_stride.
//
// The step's elements are kept in the weight type's chunk order (unit u = block u/NCHUNK,
// chunk u%NCHUNK, CW elements at W::idx): both tiles use the same order, so the products
// are those of the natural order, and one step may take part of a K-quant super-block.
//
// The int8 path (numerics "q8", at the end of this file): activations rounded to llama.cpp's Q8
// blocks by q8_quantize_*, weights unpacked to int8 tiles, products on the tensor cores with
// mma.sync.m16n8k32 s8, scales applied in f32 per 32-element block.
#include "quant.cuh"

#define MT_MMQ_TR 64    // output rows per block
#define MT_MMQ_KS 64    // elements of the row length per step (a multiple of every CW)
#define MT_MMQ_NTH 256  // threads per block: 16 row groups x 16 token groups

// acc[i][j] += sum_k w_s[ty + 16 i][k] * x_s[tx + 16 j][k] over the step's KS elements.
// Rows and tokens are interleaved by 16 so that a warp reads two w rows (broadcast) and 16
// x rows at a stride of KS + 1 floats (distinct banks).
template <int NTT>
__device__ __forceinline__ void mt_mmq_tile_f32(const float (*w_s)[MT_MMQ_KS + 1],
                                                const float (*x_s)[MT_MMQ_KS + 1], int ty, int tx,
                                                float (&acc)[4][NTT]) {
#pragma unroll 4
    for (int k = 0; k < MT_MMQ_KS; ++k) {
        float wv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) wv[i] = w_s[ty + 16 * i][k];
#pragma unroll
        for (int j = 0; j < NTT; ++j) {
            const float xv = x_s[tx + 16 * j][k];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i][j] = fmaf(wv[i], xv, acc[i][j]);
        }
    }
}

// The tiles' two loads, shared by the f32 and the tensor-core kernels: unit u (CW elements) of a
// weight row decoded, zeros past the edges; element k of unit u of token tok's activations, 0 past them.
template <typename W>
__device__ __forceinline__ void mt_mmq_unit(const mt_u8* __restrict__ w, int row, int u, int n_rows, int units,
                                            int row_bytes, float* v) {
    if (row < n_rows && u < units) {
        const int ib = u / W::NCHUNK, c = u - ib * W::NCHUNK;
        W::load(w + (mt_i64)row * row_bytes + (mt_i64)ib * W::BYTES, c, v);
    } else {
#pragma unroll
        for (int k = 0; k < W::CW; ++k) v[k] = 0.0f;
    }
}
template <typename W>
__device__ __forceinline__ float mt_mmq_act(const float* __restrict__ x, int tok, int u, int k, int n_tok, int units,
                                            int x_stride) {
    if (tok >= n_tok || u >= units) return 0.0f;
    const int ib = u / W::NCHUNK, c = u - ib * W::NCHUNK;
    return __ldg(x + (mt_i64)tok * x_stride + (mt_i64)ib * W::QK + W::idx(c, k));
}

// TT = 16 * NTT tokens per block.
template <typename W, int NTT>
__device__ __forceinline__ void mt_mmq(const mt_u8* __restrict__ w, const float* __restrict__ x,
                                       float* __restrict__ y, int ne0, int n_rows, int row_bytes,
                                       int n_tok, int x_stride, int y_stride) {
    enum { TT = 16 * NTT, UPS = MT_MMQ_KS / W::CW };  // tokens per tile, units per step
    __shared__ float w_s[MT_MMQ_TR][MT_MMQ_KS + 1];
    __shared__ float x_s[TT][MT_MMQ_KS + 1];
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int row0 = blockIdx.x * MT_MMQ_TR;
    const int tok0 = blockIdx.y * TT;
    const int units = (ne0 / W::QK) * W::NCHUNK;

    float acc[4][NTT];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NTT; ++j) acc[i][j] = 0.0f;

    for (int u0 = 0; u0 < units; u0 += UPS) {
        // ---- the weight tile: each of TR x UPS chunks decoded once (zeros past the edges)
        for (int e = tid; e < MT_MMQ_TR * UPS; e += MT_MMQ_NTH) {
            const int r = e / UPS, uu = e - r * UPS;
            float v[W::CW];
            mt_mmq_unit<W>(w, row0 + r, u0 + uu, n_rows, units, row_bytes, v);
#pragma unroll
            for (int k = 0; k < W::CW; ++k) w_s[r][uu * W::CW + k] = v[k];
        }
        // ---- the activation tile: the same elements of TT tokens, in the same order
        for (int e = tid; e < TT * MT_MMQ_KS; e += MT_MMQ_NTH) {
            const int t = e / MT_MMQ_KS, p = e - t * MT_MMQ_KS;
            const int uu = p / W::CW;
            x_s[t][p] = mt_mmq_act<W>(x, tok0 + t, u0 + uu, p - uu * W::CW, n_tok, units, x_stride);
        }
        __syncthreads();
        mt_mmq_tile_f32<NTT>(w_s, x_s, ty, tx, acc);
        __syncthreads();  // the tiles are rewritten by the next step
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = row0 + ty + 16 * i;
        if (row >= n_rows) continue;
#pragma unroll
        for (int j = 0; j < NTT; ++j) {
            const int tok = tok0 + tx + 16 * j;
            if (tok < n_tok) y[(mt_i64)tok * y_stride + row] = acc[i][j];
        }
    }
}

// mmq_<type>_t<TT>(const uint8 *w, const float *x, float *y, int32 ne0, int32 n_rows,
//                  int32 row_bytes, int32 n_tokens, int32 x_stride, int32 y_stride)
// y[t*y_stride + r] = sum_i W[r, i] x[t*x_stride + i] for r < n_rows, t < n_tokens.
// TT in {16, 32, 64} tokens per block. Launch: block (256), grid (ceil(n_rows / 64),
// ceil(n_tokens / TT)). ne0 must be a multiple of the type's block size (any number of
// steps: a partial last step is zero-filled). Static shared memory 4*(64 + TT)*65 bytes.
// One entry macro for both tiled kernels: kernel_<type>_t<TT> calling fn<W, NTT> (mt_mmq here,
// mt_mmq_h below: the same arguments and launch).
#define MT_MMQ_ENTRY_T(kernel, fn, name, W, NTT, TT)                                           \
    extern "C" __global__ void __launch_bounds__(MT_MMQ_NTH)                                  \
        kernel##_##name##_t##TT(const mt_u8* w, const float* x, float* y, int ne0, int n_rows,  \
                                int row_bytes, int n_tokens, int x_stride, int y_stride) {     \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        fn<W, NTT>(w, x, y, ne0, n_rows, row_bytes, n_tokens, x_stride, y_stride);             \
    }
#define MT_MMQ_ENTRIES(kernel, fn, name, W)         \
    MT_MMQ_ENTRY_T(kernel, fn, name, W, 1, 16)      \
    MT_MMQ_ENTRY_T(kernel, fn, name, W, 2, 32)      \
    MT_MMQ_ENTRY_T(kernel, fn, name, W, 4, 64)
#define MT_MMQ_ENTRY(name, W) MT_MMQ_ENTRIES(mmq, mt_mmq, name, W)

MT_FOR_ALL_WTYPES(MT_MMQ_ENTRY)


// ---- The same tiles on the tensor cores (the cupy option mmq_tensor_cores): the weight tile and
// the activation tile are decoded as in mt_mmq (each weight block once a step, both in the type's
// chunk order) but kept as f16 in shared memory (rounded to nearest even, as the cuBLAS path rounds
// its operands), pairs of elements in 32-bit words, and multiplied with mma.sync.m16n8k16 f16 ->
// f32. 8 warps: warp w takes the block's rows 16 (w & 3) .. +15 and tokens (w >> 2) TT/2 .. +TT/2-1,
// TT/16 products of 8 tokens for every 16 elements. f32 accumulation across the steps.
#define MT_MMQH_LDW (MT_MMQ_KS / 2 + 4)  // words per shared row: 144 bytes, fragment loads on 32 banks

// D (16 x 8 f32) += A (16 x 16 f16, row) B (16 x 8 f16, col). Fragments as the PTX ISA lays them out
// for m16n8k16 with .f16 (g = lane >> 2, t = lane & 3; a word holds two f16, the lower index in its
// low half): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] =
// A[g+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c[0..1] = D[g][2t, 2t+1],
// c[2..3] = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mt_mma_f16(float (&c)[4], const mt_u32 (&a)[4], const mt_u32 (&b)[2]) {
#ifndef MT_HOST_EMU
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // f16 mma m16n8k16 needs sm_80+: an older GPU gets a launch error, never a wrong sum
#endif
#else
    mt_emu::mma_m16n8k16_f16(c, a, b, c);
#endif
}

__device__ __forceinline__ mt_u32 mt_f2h2(float lo, float hi) {
    return (mt_u32)mt_f2h(lo) | ((mt_u32)mt_f2h(hi) << 16);
}

template <typename W, int NTT>
__device__ __forceinline__ void mt_mmq_h(const mt_u8* __restrict__ w, const float* __restrict__ x,
                                         float* __restrict__ y, int ne0, int n_rows, int row_bytes,
                                         int n_tok, int x_stride, int y_stride) {
    // PW: elements a thread decodes at once (a whole unit; two for the one-element units of f32/f16/bf16)
    enum { TT = 16 * NTT, NB = TT / 16, PW = W::CW >= 2 ? W::CW : 2, UPW = PW / W::CW };
    __shared__ mt_u32 w_s[MT_MMQ_TR][MT_MMQH_LDW];
    __shared__ mt_u32 x_s[TT][MT_MMQH_LDW];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wr = 16 * (warp & 3), wt = (warp >> 2) * (TT / 2);
    const int row0 = blockIdx.x * MT_MMQ_TR;
    const int tok0 = blockIdx.y * TT;
    const int units = (ne0 / W::QK) * W::NCHUNK;

    float acc[NB][4];
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

    for (int u0 = 0; u0 < units; u0 += MT_MMQ_KS / W::CW) {
        // ---- the weight tile: PW elements (UPW units) a work item, each unit decoded once
        for (int e = tid; e < MT_MMQ_TR * (MT_MMQ_KS / PW); e += MT_MMQ_NTH) {
            const int r = e / (MT_MMQ_KS / PW), q0 = (e - r * (MT_MMQ_KS / PW)) * PW;
            float v[PW];
#pragma unroll
            for (int h = 0; h < UPW; ++h)
                mt_mmq_unit<W>(w, row0 + r, u0 + q0 / W::CW + h, n_rows, units, row_bytes, v + h * W::CW);
#pragma unroll
            for (int k = 0; k < PW; k += 2) w_s[r][(q0 + k) / 2] = mt_f2h2(v[k], v[k + 1]);
        }
        // ---- the activation tile: the same elements of TT tokens, two a word
        for (int e = tid; e < TT * (MT_MMQ_KS / 2); e += MT_MMQ_NTH) {
            const int t = e / (MT_MMQ_KS / 2), p = 2 * (e - t * (MT_MMQ_KS / 2));
            const int ua = p / W::CW, ub = (p + 1) / W::CW;
            x_s[t][p / 2] = mt_f2h2(mt_mmq_act<W>(x, tok0 + t, u0 + ua, p - ua * W::CW, n_tok, units, x_stride),
                                    mt_mmq_act<W>(x, tok0 + t, u0 + ub, p + 1 - ub * W::CW, n_tok, units, x_stride));
        }
        __syncthreads();
#pragma unroll
        for (int k0 = 0; k0 < MT_MMQ_KS / 2; k0 += 8) {  // 16 elements (8 words) a product
            const mt_u32 a[4] = {w_s[wr + g][k0 + t4], w_s[wr + g + 8][k0 + t4], w_s[wr + g][k0 + 4 + t4],
                                 w_s[wr + g + 8][k0 + 4 + t4]};
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                const mt_u32 b[2] = {x_s[wt + 8 * j + g][k0 + t4], x_s[wt + 8 * j + g][k0 + 4 + t4]};
                mt_mma_f16(acc[j], a, b);
            }
        }
        __syncthreads();  // the tiles are rewritten by the next step
    }

#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + wr + g + (i < 2 ? 0 : 8), tok = tok0 + wt + 8 * j + 2 * t4 + (i & 1);
            if (row < n_rows && tok < n_tok) y[(mt_i64)tok * y_stride + row] = acc[j][i];
        }
}

// mmq_h_<type>_t<TT>: mmq_<type>_t<TT>'s arguments, launch and result, the products on the tensor
// cores from f16 tiles (sm_80+; the f16 rounding of both operands, f32 accumulation).
#define MT_MMQH_ENTRY(name, W) MT_MMQ_ENTRIES(mmq_h, mt_mmq_h, name, W)

MT_FOR_ALL_WTYPES(MT_MMQH_ENTRY)


// =============================================================================================
// The int8 path (numerics "q8": llama.cpp's rounding of activations, its MMQ on tensor cores).
//
// 1. q8_quantize_{0,1,k}: each activation row rounded to Q8 blocks exactly as ggml-cpu (and
//    metatp/testing/oracles.py ref_q8_quantize) round them: codes int8 [n][K], scales f32
//    [n][K/32] (Q8_0, Q8_1; kept as f16 values) or [n][K/256] (Q8_K), Q8_1's s f32 [n][K/32],
//    int32 sums of every 16 codes [n][K/16].
// 2. mmq_i8_<type>_t<TT>: a block owns 64 weight rows x TT tokens, 4 warps of 16 rows each. Each
//    step takes 4 units of 32 elements: the weight tile's codes are unpacked ONCE into int8
//    shared memory (in natural element order, beside each (row, unit)'s f32 scale, second
//    scale and offset), the activation codes are copied beside them, and every warp multiplies
//    its 16 rows by all TT tokens with mma.sync.m16n8k32 s8 (int32 per unit), then applies
//    y += xd * (wd * isum) + wm * xs in f32, as the CPU's integer kernels do:
//      q8_0, q4_0 (Q8_0 acts):  wd = d, codes q or n - 8;           wm = 0
//      q4_1 (Q8_1):             wd = d, codes n;                    wm = m, xs = s
//      q4_k, q5_k (Q8_K):       wd = d * sc_j, codes n (4/5 bits);  wm = -dmin * m_j, xs = xd * sum q
//      q6_k (Q8_K):             two products per unit (16-element scales: A's columns 0..15 and
//                               16..31 are separate registers), wd0 = d * sc, wd1 = d * sc'
//      q5_0 (Q8_0), q5_1 (Q8_1): as q4_0 / q4_1, 5-bit codes
//      q3_k (Q8_K):             as q6_k (codes: 2 bits and the hmask bit, minus 4)
//      q2_k (Q8_K):             as q6_k, plus an offset per half: wm_h * xd * (the half's sum of q)
// =============================================================================================
#define MT_Q8_0 0
#define MT_Q8_1 1
#define MT_Q8_K 2

// ---- the activation rounding: one warp per block of 32 (Q8_0 / Q8_1) or 256 (Q8_K) elements.
// Launch: block (256) = 8 warps, grid (ceil(blocks per row / 8), n_tokens).
template <int KIND>
__device__ __forceinline__ void mt_q8_quantize_32(const float* __restrict__ x, mt_i8* __restrict__ q,
                                                  float* __restrict__ d, float* __restrict__ s,
                                                  int* __restrict__ isum, int k, int x_stride) {
    const int lane = threadIdx.x & 31, b = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (b >= k / 32) return;  // the whole warp
    const float v = x[(mt_i64)t * x_stride + 32 * b + lane];
    const float amax = mt_warp_max(fabsf(v));
    const float db = __fdiv_rn(amax, 127.0f);
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const int qv = (int)rintf(__fmul_rn(v, id));
    int s16 = qv;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) s16 += __shfl_xor_sync(0xffffffffu, s16, o);
    const int s32 = s16 + __shfl_xor_sync(0xffffffffu, s16, 16);
    q[(mt_i64)t * k + 32 * b + lane] = (mt_i8)qv;
    if ((lane & 15) == 0) isum[(mt_i64)t * (k / 16) + 2 * b + (lane >> 4)] = s16;
    if (lane == 0) {
        d[(mt_i64)t * (k / 32) + b] = mt_h2f(mt_f2h(db));
        if (KIND == MT_Q8_1) s[(mt_i64)t * (k / 32) + b] = mt_h2f(mt_f2h(__fmul_rn(db, (float)s32)));
    }
}

// Q8_K: max = the first element of largest |x| (lane l holds elements 8l..8l+7), iscale =
// -127/max, q = min(127, rint(iscale * x)), d = 1/iscale.
__device__ __forceinline__ void mt_q8_quantize_256(const float* __restrict__ x, mt_i8* __restrict__ q,
                                                   float* __restrict__ d, int* __restrict__ isum, int k,
                                                   int x_stride) {
    const int lane = threadIdx.x & 31, b = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (b >= k / 256) return;  // the whole warp
    const float* xb = x + (mt_i64)t * x_stride + 256 * b + 8 * lane;
    float v[8];
    float best = 0.0f, bestv = 0.0f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = xb[i];
        const float ax = fabsf(v[i]);
        if (ax > best) {
            best = ax;
            bestv = v[i];
            bi = 8 * lane + i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const float ov = __shfl_xor_sync(0xffffffffu, bestv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
            best = ob;
            bestv = ov;
            bi = oi;
        }
    }
    const float iscale = best != 0.0f ? __fdiv_rn(-127.0f, bestv) : 0.0f;
    int sum = 0;
    mt_i8* qb = q + (mt_i64)t * k + 256 * b + 8 * lane;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int qi = best != 0.0f ? min(127, (int)rintf(__fmul_rn(iscale, v[i]))) : 0;
        qb[i] = (mt_i8)qi;
        sum += qi;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) isum[(mt_i64)t * (k / 16) + 16 * b + (lane >> 1)] = sum;
    if (lane == 0) d[(mt_i64)t * (k / 256) + b] = best != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
}

// q8_quantize_<0|1|k>(const float *x, int8 *q, float *d, float *s, int32 *isum, int32 k,
//                     int32 n_tokens, int32 x_stride): token t's K floats at x + t*x_stride;
// outputs packed per token (q + t*k, d + t*k/32 or t*k/256, s + t*k/32 (Q8_1 only; else not
// touched), isum + t*k/16). k a multiple of 32 (256 for Q8_K). Block (256), grid
// (ceil(k / 32 / 8) or ceil(k / 256 / 8), n_tokens).
extern "C" __global__ void __launch_bounds__(256)
    q8_quantize_0(const float* x, mt_i8* q, float* d, float* s, int* isum, int k, int n_tokens, int x_stride) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    mt_q8_quantize_32<MT_Q8_0>(x, q, d, s, isum, k, x_stride);
}
extern "C" __global__ void __launch_bounds__(256)
    q8_quantize_1(const float* x, mt_i8* q, float* d, float* s, int* isum, int k, int n_tokens, int x_stride) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    mt_q8_quantize_32<MT_Q8_1>(x, q, d, s, isum, k, x_stride);
}
extern "C" __global__ void __launch_bounds__(256)
    q8_quantize_k(const float* x, mt_i8* q, float* d, float* s, int* isum, int k, int n_tokens, int x_stride) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    mt_q8_quantize_256(x, q, d, isum, k, x_stride);
}

// ---- the tensor-core product: D (16 x 8 s32) += A (16 x 32 s8, row) B (32 x 8 s8, col).
// Fragments as the PTX ISA lays them out (g = lane >> 2, t = lane & 3): a[0] = A[g][4t..4t+3],
// a[1] = A[g+8][4t..], a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]; b[0] = B[4t..4t+3][g],
// b[1] = B[16+4t..][g]; c[0..1] = D[g][2t, 2t+1], c[2..3] = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mt_mma_s8(int (&c)[4], const int (&a)[4], const int (&b)[2]) {
#ifndef MT_HOST_EMU
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // int8 mma needs sm_80+: an older GPU gets a launch error, never a wrong sum
#endif
#else
    mt_emu::mma_m16n8k32_s8(c, a, b, c);
#endif
}

// ---- weights as int8 units of 32 elements (natural order), one struct per type:
//   KIND   the activation rounding its products take (llama.cpp's vec_dot_type)
//   SPLIT  1: the unit's two halves of 16 have scales of their own (q2_k, q3_k, q6_k)
//   MIN16  1: and offsets of their own (q2_k: wm[0], wm[1], each times d * its half's code sum)
//   load(row, u, q, wd0, wd1, wm): unit u of the row -> 8 words of 4 int8 codes, scales, offset(s).
// (n + 0x78) ^ 0x80 per byte is n - 8 for n in 0..15, (n + 0x60) ^ 0x80 is n - 32 for 0..63.
struct Q8WQ8_0 {
    enum { KIND = MT_Q8_0, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const mt_u8* b = row + (mt_i64)u * 34;
        *wd0 = mt_ldh(b);
        *wd1 = 0.0f;
        *wm = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)mt_ld32(b + 2 + 4 * i);
    }
};
struct Q8WQ4_0 {
    enum { KIND = MT_Q8_0, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const mt_u8* b = row + (mt_i64)u * 18;
        *wd0 = mt_ldh(b);
        *wd1 = 0.0f;
        *wm = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const mt_u32 v = mt_ld32(b + 2 + 4 * i);
            q[i] = (int)(((v & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u);
            q[4 + i] = (int)((((v >> 4) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u);
        }
    }
};
struct Q8WQ4_1 {
    enum { KIND = MT_Q8_1, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const mt_u8* b = row + (mt_i64)u * 20;
        *wd0 = mt_ldh(b);
        *wd1 = 0.0f;
        *wm = mt_ldh(b + 2);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const mt_u32 v = mt_ld32(b + 4 + 4 * i);
            q[i] = (int)(v & 0x0F0F0F0Fu);
            q[4 + i] = (int)((v >> 4) & 0x0F0F0F0Fu);
        }
    }
};
// Q5_0 / Q5_1: quant.cuh's mt_q5_codes (Q5_0's codes minus 16, Q5_1's unsigned with the offset m).
struct Q8WQ5_0 {
    enum { KIND = MT_Q8_0, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const mt_u8* b = row + (mt_i64)u * 22;
        *wd0 = mt_ldh(b);
        *wd1 = 0.0f;
        *wm = 0.0f;
        mt_q5_codes<2, 16>(b, q);
    }
};
struct Q8WQ5_1 {
    enum { KIND = MT_Q8_1, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const mt_u8* b = row + (mt_i64)u * 24;
        *wd0 = mt_ldh(b);
        *wd1 = 0.0f;
        *wm = mt_ldh(b + 2);
        mt_q5_codes<4, 0>(b, q);
    }
};
// Q2_K: unit u = 32 elements 128h + 32s + l (j = u % 8 = 4h + s) of super-block u / 8: codes
// (qs[32h + l] >> 2s) & 3; halves l < 16, l >= 16 scaled by d * (scales[2j(+1)] & 15), offsets
// -(dmin * (scales[2j(+1)] >> 4)) in wm[0], wm[1] (MIN16: each times d * its half's code sum).
struct Q8WQ2_K {
    enum { KIND = MT_Q8_K, SPLIT = 1, MIN16 = 1 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const int j = u & 7;
        const mt_u8* b = row + (mt_i64)(u >> 3) * 84;
        const float d = mt_ldh(b + 80), dmin = mt_ldh(b + 82);
        const int s0 = b[2 * j], s1 = b[2 * j + 1];
        *wd0 = __fmul_rn(d, (float)(s0 & 15));
        *wd1 = __fmul_rn(d, (float)(s1 & 15));
        wm[0] = -__fmul_rn(dmin, (float)(s0 >> 4));
        wm[1] = -__fmul_rn(dmin, (float)(s1 >> 4));
        const mt_u8* qs = b + 16 + 32 * (j >> 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (int)((mt_ld32(qs + 4 * i) >> (2 * (j & 3))) & 0x03030303u);
    }
};
// Q3_K: unit u as Q2_K's; codes (qs[32h + l] >> 2s) & 3, minus 4 unless bit j of hmask[l] is set;
// halves scaled by d * (6-bit scale 2j(+1) - 32). (n + 0x7C) ^ 0x80 per byte is n - 4.
struct Q8WQ3_K {
    enum { KIND = MT_Q8_K, SPLIT = 1, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const int j = u & 7;
        const mt_u8* b = row + (mt_i64)(u >> 3) * 110;
        const float d = mt_ldh(b + 108);
        *wd0 = __fmul_rn(d, (float)mt_q3k_scale(b + 96, 2 * j));
        *wd1 = __fmul_rn(d, (float)mt_q3k_scale(b + 96, 2 * j + 1));
        *wm = 0.0f;
        const mt_u8* qs = b + 32 + 32 * (j >> 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const mt_u32 lo = (mt_ld32(qs + 4 * i) >> (2 * (j & 3))) & 0x03030303u;
            const mt_u32 hb = (mt_ld32(b + 4 * i) >> j) & 0x01010101u;
            q[i] = (int)(((lo | (hb << 2)) + 0x7C7C7C7Cu) ^ 0x80808080u);
        }
    }
};
// Q4_K / Q5_K: unit u = sub-block j = u % 8 of super-block u / 8.
template <int BITS5>
__device__ __forceinline__ void mt_q8w_k45(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
    const int j = u & 7;
    const mt_u8* b = row + (mt_i64)(u >> 3) * (BITS5 ? 176 : 144);
    int sc, mn;
    mt_scale_min_k4(j, b + 4, &sc, &mn);
    *wd0 = __fmul_rn(mt_ldh(b), (float)sc);
    *wd1 = 0.0f;
    *wm = -__fmul_rn(mt_ldh(b + 2), (float)mn);
    const mt_u8* qs = b + (BITS5 ? 48 : 16) + 32 * (j >> 1);
    const int sh = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        mt_u32 v = (mt_ld32(qs + 4 * i) >> sh) & 0x0F0F0F0Fu;
        if (BITS5) v |= ((mt_ld32(b + 16 + 4 * i) >> j) & 0x01010101u) << 4;
        q[i] = (int)v;
    }
}
struct Q8WQ4_K {
    enum { KIND = MT_Q8_K, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        mt_q8w_k45<0>(row, u, q, wd0, wd1, wm);
    }
};
struct Q8WQ5_K {
    enum { KIND = MT_Q8_K, SPLIT = 0, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        mt_q8w_k45<1>(row, u, q, wd0, wd1, wm);
    }
};
// Q6_K: unit u = 32 elements 128h + 32k + l (j = u % 8 = 4h + k, l = 0..31) of super-block u / 8;
// scales[8h + 2k] for l < 16, scales[8h + 2k + 1] for l >= 16.
struct Q8WQ6_K {
    enum { KIND = MT_Q8_K, SPLIT = 1, MIN16 = 0 };
    static __device__ __forceinline__ void load(const mt_u8* row, int u, int* q, float* wd0, float* wd1, float* wm) {
        const int j = u & 7, h = j >> 2, k = j & 3;
        const mt_u8* b = row + (mt_i64)(u >> 3) * 210;
        const float d = mt_ldh(b + 208);
        *wd0 = __fmul_rn(d, (float)(mt_i8)b[192 + 8 * h + 2 * k]);
        *wd1 = __fmul_rn(d, (float)(mt_i8)b[192 + 8 * h + 2 * k + 1]);
        *wm = 0.0f;
        const mt_u8* ql = b + 64 * h + 32 * (k & 1);
        const mt_u8* qh = b + 128 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const mt_u32 lo = (mt_ld32(ql + 4 * i) >> (4 * (k >> 1))) & 0x0F0F0F0Fu;
            const mt_u32 hi = ((mt_ld32(qh + 4 * i) >> (2 * k)) & 0x03030303u) << 4;
            q[i] = (int)(((lo | hi) + 0x60606060u) ^ 0x80808080u);
        }
    }
};

#define MT_MMQ8_TR 64                     // weight rows per block (4 warps x 16)
#define MT_MMQ8_UPS 4                     // 32-element units per step
#define MT_MMQ8_NTH 128
#define MT_MMQ8_WS (MT_MMQ8_UPS * 8 + 4)  // int32 words per tile row: +4 makes fragment loads conflict-free

template <typename Q, int TT>
__device__ __forceinline__ void mt_mmq8(const mt_u8* __restrict__ w, const mt_i8* __restrict__ xq,
                                        const float* __restrict__ xd, const float* __restrict__ xs1,
                                        const int* __restrict__ xisum, float* __restrict__ y, int ne0,
                                        int n_rows, int row_bytes, int n_tok, int y_stride) {
    enum { NT = TT / 8, UPS = MT_MMQ8_UPS, TR = MT_MMQ8_TR };
    __shared__ int w_s[TR][MT_MMQ8_WS];
    enum { U16 = Q::MIN16 ? UPS : 1 };  // the per-half offsets' arrays (unused without MIN16)
    __shared__ float wd0_s[TR][UPS], wd1_s[TR][UPS], wm_s[TR][UPS], wm1_s[TR][U16];
    __shared__ int x_s[TT][MT_MMQ8_WS];
    __shared__ float xd_s[TT][UPS], xs_s[TT][UPS], xs1_s[TT][U16];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;
    const int row0 = blockIdx.x * TR, tok0 = blockIdx.y * TT;
    const int units = ne0 / 32;
    const int r0 = 16 * warp + g, r1 = r0 + 8;  // this lane's rows in the tile

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

    for (int u0 = 0; u0 < units; u0 += UPS) {
        // ---- the weight tile: each (row, unit) unpacked once (zeros past the edges)
        for (int e = tid; e < TR * UPS; e += MT_MMQ8_NTH) {
            const int r = e / UPS, uu = e - r * UPS;
            const int row = row0 + r, u = u0 + uu;
            int qv[8];
            float d0 = 0.0f, d1 = 0.0f, m[2] = {0.0f, 0.0f};
            if (row < n_rows && u < units) {
                Q::load(w + (mt_i64)row * row_bytes, u, qv, &d0, &d1, m);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) qv[i] = 0;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) w_s[r][8 * uu + i] = qv[i];
            wd0_s[r][uu] = d0;
            wd1_s[r][uu] = d1;
            wm_s[r][uu] = m[0];
            if (Q::MIN16) wm1_s[r][Q::MIN16 ? uu : 0] = m[1];
        }
        // ---- the activation tile: codes (words of 4) and each (token, unit)'s scale and offset sum
        for (int e = tid; e < TT * UPS * 8; e += MT_MMQ8_NTH) {
            const int t = e / (UPS * 8), p = e - t * (UPS * 8);
            const int tok = tok0 + t, u = u0 + (p >> 3);
            int v = 0;
            if (tok < n_tok && u < units) v = *(const int*)(xq + (mt_i64)tok * ne0 + 32 * u + 4 * (p & 7));
            x_s[t][p] = v;
        }
        for (int e = tid; e < TT * UPS; e += MT_MMQ8_NTH) {
            const int t = e / UPS, uu = e - t * UPS;
            const int tok = tok0 + t, u = u0 + uu;
            float dv = 0.0f, sv = 0.0f, sv1 = 0.0f;
            if (tok < n_tok && u < units) {
                if (Q::KIND == MT_Q8_K) {
                    dv = xd[(mt_i64)tok * (ne0 / 256) + (u >> 3)];
                    const int* is = xisum + (mt_i64)tok * (ne0 / 16) + 2 * u;
                    if (Q::MIN16) {
                        sv = __fmul_rn(dv, (float)is[0]);
                        sv1 = __fmul_rn(dv, (float)is[1]);
                    } else {
                        sv = __fmul_rn(dv, (float)(is[0] + is[1]));
                    }
                } else {
                    dv = xd[(mt_i64)tok * units + u];
                    if (Q::KIND == MT_Q8_1) sv = xs1[(mt_i64)tok * units + u];
                }
            }
            xd_s[t][uu] = dv;
            xs_s[t][uu] = sv;
            if (Q::MIN16) xs1_s[t][Q::MIN16 ? uu : 0] = sv1;
        }
        __syncthreads();
#pragma unroll
        for (int uu = 0; uu < UPS; ++uu) {
            int a[4];
            a[0] = w_s[r0][8 * uu + tg];
            a[1] = w_s[r1][8 * uu + tg];
            a[2] = w_s[r0][8 * uu + 4 + tg];
            a[3] = w_s[r1][8 * uu + 4 + tg];
            const float wd0[2] = {wd0_s[r0][uu], wd0_s[r1][uu]};
            const float wd1[2] = {wd1_s[r0][uu], wd1_s[r1][uu]};
            const float wm[2] = {wm_s[r0][uu], wm_s[r1][uu]};
            const int u16 = Q::MIN16 ? uu : 0;
            const float wm1[2] = {wm1_s[r0][u16], wm1_s[r1][u16]};
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                int b[2];
                b[0] = x_s[8 * j + g][8 * uu + tg];
                b[1] = x_s[8 * j + g][8 * uu + 4 + tg];
                int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                if (Q::SPLIT) {
                    const int alo[4] = {a[0], a[1], 0, 0}, ahi[4] = {0, 0, a[2], a[3]};
                    mt_mma_s8(c0, alo, b);
                    mt_mma_s8(c1, ahi, b);
                } else {
                    mt_mma_s8(c0, a, b);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = 8 * j + 2 * tg + (i & 1), h = i >> 1;
                    float dot = wd0[h] * (float)c0[i];
                    if (Q::SPLIT) dot = fmaf(wd1[h], (float)c1[i], dot);
                    acc[j][i] = fmaf(xd_s[t][uu], dot, acc[j][i]);
                    if (Q::KIND != MT_Q8_0) acc[j][i] = fmaf(wm[h], xs_s[t][uu], acc[j][i]);
                    if (Q::MIN16) acc[j][i] = fmaf(wm1[h], xs1_s[t][u16], acc[j][i]);
                }
            }
        }
        __syncthreads();  // the tiles are rewritten by the next step
    }

#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + (i < 2 ? r0 : r1), tok = tok0 + 8 * j + 2 * tg + (i & 1);
            if (row < n_rows && tok < n_tok) y[(mt_i64)tok * y_stride + row] = acc[j][i];
        }
}

// mmq_i8_<type>_t<TT>(const uint8 *w, const int8 *xq, const float *xd, const float *xs,
//                     const int32 *xisum, float *y, int32 ne0, int32 n_rows, int32 row_bytes,
//                     int32 n_tokens, int32 y_stride)
// y[t*y_stride + r] = sum over the row of W[r] times token t's Q8 activations (q8_quantize_*
// of the type's KIND, packed per token as that kernel writes them; xs: Q8_1's s, else not read).
// TT in {16, 32, 64, 128}. Launch: block (128), grid (ceil(n_rows / 64), ceil(n_tokens / TT)).
// ne0 a multiple of the type's block; sm_80+.
#define MT_MMQ8_ENTRY_T(name, Q, TT)                                                                     \
    extern "C" __global__ void __launch_bounds__(MT_MMQ8_NTH)                                           \
        mmq_i8_##name##_t##TT(const mt_u8* w, const mt_i8* xq, const float* xd, const float* xs,        \
                              const int* xisum, float* y, int ne0, int n_rows, int row_bytes,           \
                              int n_tokens, int y_stride) {                                             \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                                      \
        mt_mmq8<Q, TT>(w, xq, xd, xs, xisum, y, ne0, n_rows, row_bytes, n_tokens, y_stride);            \
    }
#define MT_MMQ8_ENTRY(name, Q)       \
    MT_MMQ8_ENTRY_T(name, Q, 16)     \
    MT_MMQ8_ENTRY_T(name, Q, 32)     \
    MT_MMQ8_ENTRY_T(name, Q, 64)     \
    MT_MMQ8_ENTRY_T(name, Q, 128)

MT_MMQ8_ENTRY(q8_0, Q8WQ8_0)
MT_MMQ8_ENTRY(q4_0, Q8WQ4_0)
MT_MMQ8_ENTRY(q4_1, Q8WQ4_1)
MT_MMQ8_ENTRY(q5_0, Q8WQ5_0)
MT_MMQ8_ENTRY(q5_1, Q8WQ5_1)
MT_MMQ8_ENTRY(q2_k, Q8WQ2_K)
MT_MMQ8_ENTRY(q3_k, Q8WQ3_K)
MT_MMQ8_ENTRY(q4_k, Q8WQ4_K)
MT_MMQ8_ENTRY(q5_k, Q8WQ5_K)
MT_MMQ8_ENTRY(q6_k, Q8WQ6_K)
