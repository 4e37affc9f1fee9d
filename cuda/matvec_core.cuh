// metatp: the matvec row core shared by matvec.cu and qkv_rope.cu:
// mt_matvec_rows (NW dot products of one row index sharing x, for NT tokens).
#ifndef METATP_MATVEC_CORE_CUH
#define METATP_MATVEC_CORE_CUH

#include "quant.cuh"

// Block (bx, by): by rows per block, bx threads per row (bx a multiple of 32, bx*by <= 256).
// Each thread walks chunks (CW weights) of its row with stride bx; partial sums are
// reduced with warp shuffles, then across the row's warps through shared memory.
// Row = row_block * by + threadIdx.y. xw (or null) multiplies x element-wise on load.
// Returns true in the one thread per row that holds the finished sums in acc.
template <typename W, int NT, int NW>
__device__ __forceinline__ bool mt_matvec_rows(const mt_u8* const* w, const float* __restrict__ x,
                                               int ne0, int n_rows, int row_bytes, int n_tok,
                                               int x_stride, float (&acc)[NW][NT],
                                               int row_block, const float* __restrict__ xw) {
    const int row = row_block * blockDim.y + threadIdx.y;
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t] = 0.0f;

    if (row < n_rows) {
        const int units = (ne0 / W::QK) * W::NCHUNK;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            const int ib = u / W::NCHUNK;
            const int c = u - ib * W::NCHUNK;
            float v[NW][W::CW];
#pragma unroll
            for (int j = 0; j < NW; ++j)
                W::load(w[j] + (mt_i64)row * row_bytes + (mt_i64)ib * W::BYTES, c, v[j]);
            const float* xb = x + (mt_i64)ib * W::QK;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const float* xt = xb + (mt_i64)t * x_stride;
                    float xv[W::CW];
#pragma unroll
                    for (int k = 0; k < W::CW; ++k) xv[k] = __ldg(xt + W::idx(c, k));
                    if (xw != 0) {
                        const float* wb = xw + (mt_i64)ib * W::QK;
#pragma unroll
                        for (int k = 0; k < W::CW; ++k) xv[k] *= __ldg(wb + W::idx(c, k));
                    }
#pragma unroll
                    for (int j = 0; j < NW; ++j) {
                        float s = 0.0f;
#pragma unroll
                        for (int k = 0; k < W::CW; ++k) s = fmaf(v[j][k], xv[k], s);
                        acc[j][t] += s;
                    }
                }
            }
        }
    }

    return mt_rows_reduce<NW, NT>(acc, row, n_rows);
}

#endif  // METATP_MATVEC_CORE_CUH
