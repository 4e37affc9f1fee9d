// metatp: y[out, T] = W x for small T (decode, T <= 8), reading ggml weights directly.
//
// Layout: W has n_rows rows (ggml ne[1] = out_features) of ne0 elements (ne[0] =
// in_features), row r at W + r*row_bytes; x is f32, token t at x + t*x_stride
// (ne0 elements); y is f32, token t at y + t*y_stride (n_rows elements).
// A per-device slice of a split weight is a pointer offset + the full row_bytes.
#include "quant.cuh"

// Block (bx, by): by rows per block, bx threads per row (bx a multiple of 32, bx*by <= 256).
// Each thread walks chunks (CW weights) of its row with stride bx; partial sums are
// reduced with warp shuffles, then across the row's warps through shared memory.
template <typename W, int NT>
__device__ __forceinline__ void matvec_impl(const mt_u8* __restrict__ w,
                                            const float* __restrict__ x, float* __restrict__ y,
                                            int ne0, int n_rows, int row_bytes, int n_tok,
                                            int x_stride, int y_stride) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

    if (row < n_rows) {
        const mt_u8* wr = w + (mt_i64)row * row_bytes;
        const int units = (ne0 / W::QK) * W::NCHUNK;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            const int ib = u / W::NCHUNK;
            const int c = u - ib * W::NCHUNK;
            float v[W::CW];
            W::load(wr + (mt_i64)ib * W::BYTES, c, v);
            const float* xb = x + (mt_i64)ib * W::QK;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const float* xt = xb + (mt_i64)t * x_stride;
                    float s = 0.0f;
#pragma unroll
                    for (int k = 0; k < W::CW; ++k) s = fmaf(v[k], __ldg(xt + W::idx(c, k)), s);
                    acc[t] += s;
                }
            }
        }
    }

#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = mt_warp_sum(acc[t]);

    const int lane = threadIdx.x & 31;
    const int wpr = blockDim.x >> 5;  // warps per row
    if (wpr == 1) {                   // uniform over the block
        if (lane == 0 && row < n_rows) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < n_tok) y[(mt_i64)t * y_stride + row] = acc[t];
        }
        return;
    }
    __shared__ float red[8][NT];  // <= 256 threads -> <= 8 warps
    const int warp = (threadIdx.y * blockDim.x + threadIdx.x) >> 5;
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) red[warp][t] = acc[t];
    }
    __syncthreads();
    if (threadIdx.x == 0 && row < n_rows) {
        const int w0 = threadIdx.y * wpr;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n_tok) {
                float s = 0.0f;
                for (int i = 0; i < wpr; ++i) s += red[w0 + i][t];
                y[(mt_i64)t * y_stride + row] = s;
            }
        }
    }
}

// matvec_<type>_t<NT>(const uint8 *w, const float *x, float *y, int32 ne0, int32 n_rows,
//                     int32 row_bytes, int32 n_tokens, int32 x_stride, int32 y_stride)
// NT in {1, 2, 4, 8} is the compile-time upper bound of n_tokens (use the smallest
// NT >= n_tokens). Launch: block (bx, by) with bx % 32 == 0 and bx*by <= 256,
// grid (ceil(n_rows / by)). ne0 must be a multiple of the type's block size.
#define MT_MATVEC_ENTRY_T(name, W, NT)                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                      \
        matvec_##name##_t##NT(const mt_u8* w, const float* x, float* y, int ne0,           \
                              int n_rows, int row_bytes, int n_tokens, int x_stride,       \
                              int y_stride) {                                              \
        matvec_impl<W, NT>(w, x, y, ne0, n_rows, row_bytes, n_tokens, x_stride, y_stride); \
    }
#define MT_MATVEC_ENTRY(name, W)      \
    MT_MATVEC_ENTRY_T(name, W, 1)     \
    MT_MATVEC_ENTRY_T(name, W, 2)     \
    MT_MATVEC_ENTRY_T(name, W, 4)     \
    MT_MATVEC_ENTRY_T(name, W, 8)

MT_FOR_ALL_WTYPES(MT_MATVEC_ENTRY)
