// metatp: RMS_NORM fused with the multiplication by its weight.
#include "quant.cuh"

// rms_norm_f32(const float *x, const float *w /* may be null */, float *y, int32 ne0,
//              int32 n_rows, int32 x_row_stride, int32 y_row_stride, float32 eps)
// y[r, i] = (x[r, i] * 1/sqrt(mean_i(x[r, :]^2) + eps)) * w[i]   (w == null -> no weight)
// Strides in elements; y may alias x. Launch: grid (n_rows), block (bx), bx % 32 == 0, <= 1024.
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_f32(const float* x, const float* w, float* y, int ne0, int n_rows,
                 int x_row_stride, int y_row_stride, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;  // uniform over the block
    const float* xr = x + (mt_i64)r * x_row_stride;
    float* yr = y + (mt_i64)r * y_row_stride;
    float s = 0.0f;
    for (int i = threadIdx.x; i < ne0; i += blockDim.x) {
        const float v = xr[i];
        s = fmaf(v, v, s);
    }
    s = mt_block_sum(s, scratch);
    const float scale = 1.0f / sqrtf(s / (float)ne0 + eps);
    if (w != 0) {
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = (xr[i] * scale) * w[i];
    } else {
        for (int i = threadIdx.x; i < ne0; i += blockDim.x) yr[i] = xr[i] * scale;
    }
}
