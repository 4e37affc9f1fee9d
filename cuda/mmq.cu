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
// The tile product (mt_mmq_tile_f32: f32 FMAs, 4 rows x NTT tokens per thread) is the one
// function an int8 tensor-core version replaces: activations quantized per 32-element block
// (q8_1, as llama.cpp's MMQ and the CPU path's q8 activations), weights kept as int8 + scales,
// mma.sync.m16n8k32.s8 on the two tiles. That version is not written yet (see docs/kernels.md).
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
            const int row = row0 + r, u = u0 + uu;
            float v[W::CW];
            if (row < n_rows && u < units) {
                const int ib = u / W::NCHUNK, c = u - ib * W::NCHUNK;
                W::load(w + (mt_i64)row * row_bytes + (mt_i64)ib * W::BYTES, c, v);
            } else {
#pragma unroll
                for (int k = 0; k < W::CW; ++k) v[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < W::CW; ++k) w_s[r][uu * W::CW + k] = v[k];
        }
        // ---- the activation tile: the same elements of TT tokens, in the same order
        for (int e = tid; e < TT * MT_MMQ_KS; e += MT_MMQ_NTH) {
            const int t = e / MT_MMQ_KS, p = e - t * MT_MMQ_KS;
            const int uu = p / W::CW, k = p - uu * W::CW;
            const int tok = tok0 + t, u = u0 + uu;
            float xv = 0.0f;
            if (tok < n_tok && u < units) {
                const int ib = u / W::NCHUNK, c = u - ib * W::NCHUNK;
                xv = __ldg(x + (mt_i64)tok * x_stride + (mt_i64)ib * W::QK + W::idx(c, k));
            }
            x_s[t][p] = xv;
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
#define MT_MMQ_ENTRY_T(name, W, NTT, TT)                                                       \
    extern "C" __global__ void __launch_bounds__(MT_MMQ_NTH)                                  \
        mmq_##name##_t##TT(const mt_u8* w, const float* x, float* y, int ne0, int n_rows,      \
                           int row_bytes, int n_tokens, int x_stride, int y_stride) {          \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        mt_mmq<W, NTT>(w, x, y, ne0, n_rows, row_bytes, n_tokens, x_stride, y_stride);         \
    }
#define MT_MMQ_ENTRY(name, W)         \
    MT_MMQ_ENTRY_T(name, W, 1, 16)    \
    MT_MMQ_ENTRY_T(name, W, 2, 32)    \
    MT_MMQ_ENTRY_T(name, W, 4, 64)

MT_FOR_ALL_WTYPES(MT_MMQ_ENTRY)
