// metatp: elementwise and small row-wise ops (f32 unless stated).
// Tensors are ggml-style 4-D: ne[0..3] with element strides s[0..3] (not bytes).
// All scalars are int32 / float32. 1-D kernels are grid-stride loops (any launch).
#include "quant.cuh"

#define MT_GRID_STRIDE(i, total)                                                   \
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (mt_i64)gridDim.x * blockDim.x)

// A flat index over ne0*ne1*ne2*ne3 elements, split into its 4-D coordinates.
struct Idx4 {
    int i0, i1, i2, i3;
    __device__ __forceinline__ Idx4(mt_i64 r, int ne0, int ne1, int ne2) {
        i0 = (int)(r % ne0); r /= ne0;
        i1 = (int)(r % ne1); r /= ne1;
        i2 = (int)(r % ne2);
        i3 = (int)(r / ne2);
    }
    // element offset of these coordinates under strides s0..s3
    __device__ __forceinline__ mt_i64 at(int s0, int s1, int s2, int s3) const {
        return (mt_i64)i0 * s0 + (mt_i64)i1 * s1 + (mt_i64)i2 * s2 + (mt_i64)i3 * s3;
    }
};

// ------------------------------------------------------------ binary ops
struct OpAdd { static __device__ __forceinline__ float f(float a, float b) { return a + b; } };
struct OpSub { static __device__ __forceinline__ float f(float a, float b) { return a - b; } };
struct OpMul { static __device__ __forceinline__ float f(float a, float b) { return a * b; } };
struct OpDiv { static __device__ __forceinline__ float f(float a, float b) { return a / b; } };

// dst[i0,i1,i2,i3] = op(a[i0,i1,i2,i3], b[i0 % nb0, i1 % nb1, i2 % nb2, i3 % nb3])
template <typename OP>
__device__ __forceinline__ void binary_impl(const float* a, const float* b, float* y, int ne0,
                                            int ne1, int ne2, int ne3, int a_s0, int a_s1,
                                            int a_s2, int a_s3, int b_ne0, int b_ne1, int b_ne2,
                                            int b_ne3, int b_s0, int b_s1, int b_s2, int b_s3,
                                            int y_s0, int y_s1, int y_s2, int y_s3) {
    const mt_i64 total = (mt_i64)ne0 * ne1 * ne2 * ne3;
    MT_GRID_STRIDE(i, total) {
        const Idx4 p(i, ne0, ne1, ne2);
        const float av = a[p.at(a_s0, a_s1, a_s2, a_s3)];
        const float bv = b[(mt_i64)(p.i0 % b_ne0) * b_s0 + (mt_i64)(p.i1 % b_ne1) * b_s1 +
                           (mt_i64)(p.i2 % b_ne2) * b_s2 + (mt_i64)(p.i3 % b_ne3) * b_s3];
        y[p.at(y_s0, y_s1, y_s2, y_s3)] = OP::f(av, bv);
    }
}

// binary_<add|sub|mul|div>_f32(const float *a, const float *b, float *y,
//     int32 ne0, int32 ne1, int32 ne2, int32 ne3,            // shape of a and y
//     int32 a_s0, int32 a_s1, int32 a_s2, int32 a_s3,
//     int32 b_ne0, int32 b_ne1, int32 b_ne2, int32 b_ne3,    // each 1 or a divisor of ne
//     int32 b_s0, int32 b_s1, int32 b_s2, int32 b_s3,
//     int32 y_s0, int32 y_s1, int32 y_s2, int32 y_s3)
// ggml broadcasting: b repeats along every dim where b_ne < ne. y may alias a.
#define MT_BINARY_ENTRY(name, OP)                                                            \
    extern "C" __global__ void binary_##name##_f32(                                          \
        const float* a, const float* b, float* y, int ne0, int ne1, int ne2, int ne3,        \
        int a_s0, int a_s1, int a_s2, int a_s3, int b_ne0, int b_ne1, int b_ne2, int b_ne3,  \
        int b_s0, int b_s1, int b_s2, int b_s3, int y_s0, int y_s1, int y_s2, int y_s3) {    \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                           \
        binary_impl<OP>(a, b, y, ne0, ne1, ne2, ne3, a_s0, a_s1, a_s2, a_s3, b_ne0, b_ne1,  \
                        b_ne2, b_ne3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3);      \
    }
MT_BINARY_ENTRY(add, OpAdd)
MT_BINARY_ENTRY(sub, OpSub)
MT_BINARY_ENTRY(mul, OpMul)
MT_BINARY_ENTRY(div, OpDiv)

// Whole-array counts (n) are int64: an array of 2^31 elements is 8 GiB of f32, within reach of a
// vocab x tokens logits buffer; the grid-stride index is 64-bit as well.
// add_inplace_f32(float *y, const float *x, int64 n): y[i] += x[i]
extern "C" __global__ void add_inplace_f32(float* y, const float* x, mt_i64 n) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] += x[i];
}
// add_inplace_f32_bf16(float *y, const uint16 *x /* bf16 */, int64 n): y[i] += float(x[i])
extern "C" __global__ void add_inplace_f32_bf16(float* y, const mt_u16* x, mt_i64 n) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] += mt_bf2f(x[i]);
}
// add_inplace_bf16(uint16 *y, const uint16 *x, int64 n): y = bf16(float(y) + float(x))
extern "C" __global__ void add_inplace_bf16(mt_u16* y, const mt_u16* x, mt_i64 n) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] = mt_f2bf(mt_bf2f(y[i]) + mt_bf2f(x[i]));
}

// fill_f32(float *y, int32 n, float32 value)
extern "C" __global__ void fill_f32(float* y, int n, float value) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] = value;
}

// --------------------------------------------------------- activations
struct ActSilu { static __device__ __forceinline__ float f(float x) { return mt_silu(x); } };
struct ActGelu { static __device__ __forceinline__ float f(float x) { return mt_gelu(x); } };

// Element-wise maps with two float parameters p0, p1 (unused by most).
struct MapScale {  // x * p0 + p1 (ggml SCALE)
    static __device__ __forceinline__ float f(float x, float p0, float p1) {
        return fmaf(x, p0, p1);
    }
};
struct MapSilu {
    static __device__ __forceinline__ float f(float x, float, float) { return mt_silu(x); }
};
struct MapGelu {
    static __device__ __forceinline__ float f(float x, float, float) { return mt_gelu(x); }
};
struct MapSigmoid {
    static __device__ __forceinline__ float f(float x, float, float) {
        return 1.0f / (1.0f + expf(-x));
    }
};
struct MapSoftplus {  // log(1 + e^x) without overflow
    static __device__ __forceinline__ float f(float x, float, float) {
        return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
    }
};

template <typename MAP>
__device__ __forceinline__ void unary_impl(const float* x, float* y, int ne0, int ne1, int ne2,
                                           int ne3, int x_s0, int x_s1, int x_s2, int x_s3,
                                           int y_s0, int y_s1, int y_s2, int y_s3, float p0,
                                           float p1) {
    const mt_i64 total = (mt_i64)ne0 * ne1 * ne2 * ne3;
    MT_GRID_STRIDE(i, total) {
        const Idx4 p(i, ne0, ne1, ne2);
        y[p.at(y_s0, y_s1, y_s2, y_s3)] = MAP::f(x[p.at(x_s0, x_s1, x_s2, x_s3)], p0, p1);
    }
}

// unary_<scale|silu|gelu|sigmoid|softplus>_f32(const float *x, float *y,
//     int32 ne0, int32 ne1, int32 ne2, int32 ne3, int32 x_s0, int32 x_s1, int32 x_s2,
//     int32 x_s3, int32 y_s0, int32 y_s1, int32 y_s2, int32 y_s3, float32 p0, float32 p1)
// y = f(x) element-wise over a strided 4-D tensor (y may alias x with the same strides).
// scale: x*p0 + p1; the others ignore p0/p1. Launch: 1-D grid-stride.
#define MT_UNARY_ENTRY(name, MAP)                                                              \
    extern "C" __global__ void unary_##name##_f32(                                             \
        const float* x, float* y, int ne0, int ne1, int ne2, int ne3, int x_s0, int x_s1,      \
        int x_s2, int x_s3, int y_s0, int y_s1, int y_s2, int y_s3, float p0, float p1) {      \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        unary_impl<MAP>(x, y, ne0, ne1, ne2, ne3, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2,    \
                        y_s3, p0, p1);                                                         \
    }
MT_UNARY_ENTRY(scale, MapScale)
MT_UNARY_ENTRY(silu, MapSilu)
MT_UNARY_ENTRY(gelu, MapGelu)
MT_UNARY_ENTRY(sigmoid, MapSigmoid)
MT_UNARY_ENTRY(softplus, MapSoftplus)

// <swiglu|geglu>_f32(const float *gate, const float *up, float *y, int32 ne0, int32 n_rows,
//                    int32 gate_row_stride, int32 up_row_stride, int32 y_row_stride)
// y[r, i] = act(gate[r, i]) * up[r, i], act = silu (swiglu) or gelu-tanh (geglu).
// For a fused [2*ne0, n_rows] tensor pass gate = base, up = base + ne0, both strides 2*ne0.
#define MT_GLU_ENTRY(name, ACT)                                                              \
    extern "C" __global__ void name##_f32(const float* gate, const float* up, float* y,     \
                                          int ne0, int n_rows, int gate_row_stride,          \
                                          int up_row_stride, int y_row_stride) {             \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                           \
        const mt_i64 total = (mt_i64)ne0 * n_rows;                                           \
        MT_GRID_STRIDE(i, total) {                                                           \
            const int r = (int)(i / ne0);                                                    \
            const int c = (int)(i - (mt_i64)r * ne0);                                        \
            const float g = gate[(mt_i64)r * gate_row_stride + c];                           \
            const float u = up[(mt_i64)r * up_row_stride + c];                               \
            y[(mt_i64)r * y_row_stride + c] = ACT::f(g) * u;                                 \
        }                                                                                    \
    }
MT_GLU_ENTRY(swiglu, ActSilu)
MT_GLU_ENTRY(geglu, ActGelu)

// ------------------------------------------------------------ row ops
// soft_max_f32(const float *x, const float *mask /* or null */, float *y, int32 ne0,
//              int32 n_rows, int32 x_row_stride, int32 mask_row_stride, int32 y_row_stride,
//              int32 mask_rows, float32 scale)
// y[r] = softmax(x[r] * scale + mask[r % mask_rows]). A row that is all -inf gives 0s.
// Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
extern "C" __global__ void __launch_bounds__(1024)
    soft_max_f32(const float* x, const float* mask, float* y, int ne0, int n_rows,
                 int x_row_stride, int mask_row_stride, int y_row_stride, int mask_rows,
                 float scale) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (mt_i64)r * x_row_stride;
    const float* mr = mask ? mask + (mt_i64)(r % mask_rows) * mask_row_stride : 0;
    float* yr = y + (mt_i64)r * y_row_stride;
    float mx = -MT_INF;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
        mx = fmaxf(mx, v);
    }
    mx = mt_block_max(mx, scratch);
    if (mx == -MT_INF) {
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = 0.0f;
        return;
    }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
        sum += expf(v - mx);
    }
    sum = mt_block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i] * scale + (mr ? mr[i] : 0.0f);
        yr[i] = expf(v - mx) * inv;
    }
}

// argmax_f32(const float *x, int32 *y, int32 ne0, int32 n_rows, int32 x_row_stride)
// y[r] = first index of the maximum of row r (NaN never wins; all-NaN row -> 0).
// Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
extern "C" __global__ void __launch_bounds__(1024)
    argmax_f32(const float* x, int* y, int ne0, int n_rows, int x_row_stride) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (mt_i64)r * x_row_stride;
    float best = -MT_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i];
        if (v > best || (v == best && i < bi)) {  // NaN compares false
            best = v;
            bi = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) {
            best = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? sv[lane] : -MT_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) y[r] = (bi == 0x7fffffff) ? 0 : bi;
    }
}

// ------------------------------------------------------------ GET_ROWS
// get_rows_<type>(const uint8 *src, const int32 *idx, float *dst, int32 ne0, int32 n_idx,
//     int32 ne2, int32 ne3, int32 src_nb1, int64 src_nb2, int64 src_nb3,
//     int32 idx_s0, int32 idx_s1, int32 idx_s2, int32 dst_s1, int32 dst_s2, int32 dst_s3)
// ggml GET_ROWS: dst[i3, i2, i1, :] = dequant(src row idx[i1, i2, i3] of batch (i2, i3)),
// i1 < n_idx, i2 < ne2, i3 < ne3. Source strides in bytes (rows are whole blocks; the batch
// strides are 64-bit: one 2-D weight can exceed 2 GiB), index and destination strides in
// elements. Types: all weight types of quant.cuh (f32 covers
// activations). Launch: 1-D grid-stride over n_idx * ne2 * ne3 * ne0 / CW.
template <typename W>
__device__ __forceinline__ void get_rows_impl(const mt_u8* __restrict__ src,
                                              const int* __restrict__ idx,
                                              float* __restrict__ dst, int ne0, int n_idx,
                                              int ne2, int ne3, int src_nb1, mt_i64 src_nb2,
                                              mt_i64 src_nb3, int idx_s0, int idx_s1, int idx_s2,
                                              int dst_s1, int dst_s2, int dst_s3) {
    const int units = (ne0 / W::QK) * W::NCHUNK;
    const mt_i64 total = (mt_i64)units * n_idx * ne2 * ne3;
    MT_GRID_STRIDE(i, total) {
        mt_i64 r = i / units;
        const int u = (int)(i - r * units);
        const int i1 = (int)(r % n_idx); r /= n_idx;
        const int i2 = (int)(r % ne2);
        const int i3 = (int)(r / ne2);
        const int ib = u / W::NCHUNK;
        const int c = u - ib * W::NCHUNK;
        const int row = idx[(mt_i64)i1 * idx_s0 + (mt_i64)i2 * idx_s1 + (mt_i64)i3 * idx_s2];
        const mt_u8* b = src + (mt_i64)row * src_nb1 + i2 * src_nb2 + i3 * src_nb3 +
                         (mt_i64)ib * W::BYTES;
        float v[W::CW];
        W::load(b, c, v);
        float* o = dst + (mt_i64)i1 * dst_s1 + (mt_i64)i2 * dst_s2 + (mt_i64)i3 * dst_s3 +
                   (mt_i64)ib * W::QK;
#pragma unroll
        for (int k = 0; k < W::CW; ++k) o[W::idx(c, k)] = v[k];
    }
}
#define MT_GET_ROWS_ENTRY(name, W)                                                             \
    extern "C" __global__ void get_rows_##name(                                                \
        const mt_u8* src, const int* idx, float* dst, int ne0, int n_idx, int ne2, int ne3,    \
        int src_nb1, mt_i64 src_nb2, mt_i64 src_nb3, int idx_s0, int idx_s1, int idx_s2,       \
        int dst_s1, int dst_s2, int dst_s3) {                                                  \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        get_rows_impl<W>(src, idx, dst, ne0, n_idx, ne2, ne3, src_nb1, src_nb2, src_nb3,       \
                         idx_s0, idx_s1, idx_s2, dst_s1, dst_s2, dst_s3);                      \
    }
MT_FOR_ALL_WTYPES(MT_GET_ROWS_ENTRY)

// ------------------------------------------------------------ ADD_ID
// add_id_f32(const float *a, const float *b, const int32 *ids, float *y, int32 ne0,
//     int32 n_used, int32 n_tok, int32 a_s1, int32 a_s2, int32 b_s1, int32 ids_s0,
//     int32 ids_s1, int32 y_s1, int32 y_s2)
// ggml ADD_ID (per-expert bias): y[t, u, :] = a[t, u, :] + b[ids[u, t], :] with
// a/y element (i, u, t) at i + u*s1 + t*s2 and ids element (u, t) at u*ids_s0 + t*ids_s1.
// Launch: 1-D grid-stride over ne0 * n_used * n_tok.
extern "C" __global__ void add_id_f32(const float* a, const float* b, const int* ids, float* y,
                                      int ne0, int n_used, int n_tok, int a_s1, int a_s2,
                                      int b_s1, int ids_s0, int ids_s1, int y_s1, int y_s2) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    const mt_i64 total = (mt_i64)ne0 * n_used * n_tok;
    MT_GRID_STRIDE(i, total) {
        mt_i64 r = i / ne0;
        const int c = (int)(i - r * ne0);
        const int u = (int)(r % n_used);
        const int t = (int)(r / n_used);
        const int e = ids[(mt_i64)u * ids_s0 + (mt_i64)t * ids_s1];
        y[(mt_i64)t * y_s2 + (mt_i64)u * y_s1 + c] =
            a[(mt_i64)t * a_s2 + (mt_i64)u * a_s1 + c] + b[(mt_i64)e * b_s1 + c];
    }
}

// ------------------------------------------------------------ TOP_K
// Ordering of argsort(-x, stable): larger first, ties by index, NaN after everything.
__device__ __forceinline__ bool mt_topk_better(float v, int i, float bv, int bi) {
    if (bi < 0) return true;
    const bool vn = v != v, bn = bv != bv;
    if (vn != bn) return bn;
    if (vn) return i < bi;
    return v > bv || (v == bv && i < bi);
}

#define MT_TOPK_MAX 256
// top_k_f32(const float *x, int32 *y, int32 ne0, int32 n_rows, int32 k, int32 x_row_stride,
//           int32 y_row_stride)
// y[r, 0..k) = indices of the k largest values of row r, largest first (ties: lower index
// first; NaN last), as numpy's argsort(-x, kind="stable")[:k]. k <= 256.
// Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
extern "C" __global__ void __launch_bounds__(1024)
    top_k_f32(const float* x, int* y, int ne0, int n_rows, int k, int x_row_stride,
              int y_row_stride) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ int sel[MT_TOPK_MAX];
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (mt_i64)r * x_row_stride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = 0; j < k; ++j) {
        float best = 0.0f;
        int bi = -1;
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
            bool taken = false;
            for (int s = 0; s < j; ++s) taken = taken || (sel[s] == i);
            const float v = xr[i];
            if (!taken && mt_topk_better(v, i, best, bi)) {
                best = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && mt_topk_better(ov, oi, best, bi)) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            wv[warp] = best;
            wi[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            best = wv[0];
            bi = wi[0];
            for (int w = 1; w < nw; ++w)
                if (wi[w] >= 0 && mt_topk_better(wv[w], wi[w], best, bi)) {
                    best = wv[w];
                    bi = wi[w];
                }
            sel[j] = bi;
            y[(mt_i64)r * y_row_stride + j] = bi;
        }
        __syncthreads();
    }
}

// ------------------------------------------------------------ copies
// cpy_<src>_<dst>(const S *src, D *dst, int32 ne0, int32 ne1, int32 ne2, int32 ne3,
//                 int32 s0, int32 s1, int32 s2, int32 s3,      // src element strides
//                 int32 d0, int32 d1, int32 d2, int32 d3)      // dst element strides
// Strided 4-D copy with type conversion; pairs f32->f32, f32->f16, f16->f32, f16->f16,
// f32->bf16, bf16->f32 (f16/bf16 as uint16). Pass contiguous dst strides for a gather.
template <typename S, typename D>
__device__ __forceinline__ void cpy_impl(const typename S::T* src, typename D::T* dst, int ne0,
                                         int ne1, int ne2, int ne3, int s0, int s1, int s2,
                                         int s3, int d0, int d1, int d2, int d3) {
    const mt_i64 total = (mt_i64)ne0 * ne1 * ne2 * ne3;
    MT_GRID_STRIDE(i, total) {
        const Idx4 p(i, ne0, ne1, ne2);
        D::store(dst + p.at(d0, d1, d2, d3), S::load(src + p.at(s0, s1, s2, s3)));
    }
}
// f16->f16 through f32 is exact (every f16 is an f32 that converts back unchanged).
#define MT_CPY_ENTRY(sname, S, dname, D)                                                      \
    extern "C" __global__ void cpy_##sname##_##dname(                                         \
        const S::T* src, D::T* dst, int ne0, int ne1, int ne2, int ne3, int s0, int s1,      \
        int s2, int s3, int d0, int d1, int d2, int d3) {                                     \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        cpy_impl<S, D>(src, dst, ne0, ne1, ne2, ne3, s0, s1, s2, s3, d0, d1, d2, d3);         \
    }
MT_CPY_ENTRY(f32, MtF32, f32, MtF32)
MT_CPY_ENTRY(f32, MtF32, f16, MtF16)
MT_CPY_ENTRY(f16, MtF16, f32, MtF32)
MT_CPY_ENTRY(f16, MtF16, f16, MtF16)
MT_CPY_ENTRY(f32, MtF32, bf16, MtBF16)
MT_CPY_ENTRY(bf16, MtBF16, f32, MtF32)

// f32_to_bf16(const float *x, uint16 *y, int64 n)  (round to nearest even, as ggml)
extern "C" __global__ void f32_to_bf16(const float* x, mt_u16* y, mt_i64 n) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] = mt_f2bf(x[i]);
}
// bf16_to_f32(const uint16 *x, float *y, int64 n)
extern "C" __global__ void bf16_to_f32(const mt_u16* x, float* y, mt_i64 n) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    MT_GRID_STRIDE(i, n) y[i] = mt_bf2f(x[i]);
}
