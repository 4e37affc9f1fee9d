// metatp: row reductions — RMS_NORM and NORM (fused with the multiplication by their
// weight), SUM_ROWS.
//
// Rows are the ggml dims 1..3 of a tensor: row r = (i1, i2, i3) with
// i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2); row r of x starts at
// x + i1*xs1 + i2*xs2 + i3*xs3 (element strides), so strided views work as they are.
#include "quant.cuh"

__device__ __forceinline__ mt_i64 mt_row_offset(int r, int ne1, int ne2, int s1, int s2, int s3) {
    const int i1 = r % ne1;
    const int q = r / ne1;
    const int i2 = q % ne2;
    const int i3 = q / ne2;
    return (mt_i64)i1 * s1 + (mt_i64)i2 * s2 + (mt_i64)i3 * s3;
}

// RMS: y = x / sqrt(mean(x^2) + eps) * w. Otherwise (layer norm without bias):
// y = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w. w == null: no multiplication.
template <bool RMS>
__device__ __forceinline__ void mt_norm_row(const float* __restrict__ xr, const float* w,
                                            float* yr, int ne0, float eps, float* scratch) {
    float mean = 0.0f;
    if (!RMS) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) s += xr[i];
        mean = mt_block_sum(s, scratch) / (float)ne0;
    }
    float s2 = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i] - mean;
        s2 = fmaf(v, v, s2);
    }
    s2 = mt_block_sum(s2, scratch);
    const float scale = 1.0f / sqrtf(s2 / (float)ne0 + eps);
    if (w != 0) {
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = ((xr[i] - mean) * scale) * w[i];
    } else {
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = (xr[i] - mean) * scale;
    }
}

// rms_norm_f32 / norm_f32(const float *x, const float *w /* [ne0] or null */, float *y,
//     int32 ne0, int32 ne1, int32 ne2, int32 n_rows, int32 xs1, int32 xs2, int32 xs3,
//     int32 ys1, int32 ys2, int32 ys3, float32 eps)
// n_rows = ne1*ne2*ne3. y may alias x (same strides).
// Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
#define MT_NORM_ENTRY(name, RMS)                                                                 \
    extern "C" __global__ void __launch_bounds__(1024)                                           \
        name(const float* x, const float* w, float* y, int ne0, int ne1, int ne2, int n_rows,    \
             int xs1, int xs2, int xs3, int ys1, int ys2, int ys3, float eps) {                   \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                                \
        __shared__ float scratch[32];                                                            \
        const int r = blockIdx.x;                                                                \
        if (r >= n_rows) return; /* uniform over the block */                                   \
        mt_norm_row<RMS>(x + mt_row_offset(r, ne1, ne2, xs1, xs2, xs3), w,                       \
                         y + mt_row_offset(r, ne1, ne2, ys1, ys2, ys3), ne0, eps, scratch);      \
    }
MT_NORM_ENTRY(rms_norm_f32, true)
MT_NORM_ENTRY(norm_f32, false)

// sum_rows_f32(const float *x, float *y, int32 ne0, int32 ne1, int32 ne2, int32 n_rows,
//     int32 xs1, int32 xs2, int32 xs3, int32 ys1, int32 ys2, int32 ys3)
// y[row r] = sum of the ne0 elements of row r (ggml SUM_ROWS: y has ne0 = 1).
// Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
extern "C" __global__ void __launch_bounds__(1024)
    sum_rows_f32(const float* x, float* y, int ne0, int ne1, int ne2, int n_rows, int xs1,
                 int xs2, int xs3, int ys1, int ys2, int ys3) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + mt_row_offset(r, ne1, ne2, xs1, xs2, xs3);
    float s = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) s += xr[i];
    s = mt_block_sum(s, scratch);
    if (threadIdx.x == 0) y[mt_row_offset(r, ne1, ne2, ys1, ys2, ys3)] = s;
}
