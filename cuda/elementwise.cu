// metatp: elementwise and small row-wise ops (f32 unless stated).
// Tensors are ggml-style 4-D: ne[0..3] with element strides s[0..3] (not bytes).
// All scalars are int32 / float32. 1-D kernels are grid-stride loops (any launch).
#include "quant.cuh"

#define MT_GRID_STRIDE(i, total)                                                   \
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (mt_i64)gridDim.x * blockDim.x)

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
        mt_i64 r = i;
        const int i0 = (int)(r % ne0); r /= ne0;
        const int i1 = (int)(r % ne1); r /= ne1;
        const int i2 = (int)(r % ne2);
        const int i3 = (int)(r / ne2);
        const float av = a[(mt_i64)i0 * a_s0 + (mt_i64)i1 * a_s1 + (mt_i64)i2 * a_s2 +
                           (mt_i64)i3 * a_s3];
        const float bv = b[(mt_i64)(i0 % b_ne0) * b_s0 + (mt_i64)(i1 % b_ne1) * b_s1 +
                           (mt_i64)(i2 % b_ne2) * b_s2 + (mt_i64)(i3 % b_ne3) * b_s3];
        y[(mt_i64)i0 * y_s0 + (mt_i64)i1 * y_s1 + (mt_i64)i2 * y_s2 + (mt_i64)i3 * y_s3] =
            OP::f(av, bv);
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
        binary_impl<OP>(a, b, y, ne0, ne1, ne2, ne3, a_s0, a_s1, a_s2, a_s3, b_ne0, b_ne1,  \
                        b_ne2, b_ne3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3);      \
    }
MT_BINARY_ENTRY(add, OpAdd)
MT_BINARY_ENTRY(sub, OpSub)
MT_BINARY_ENTRY(mul, OpMul)
MT_BINARY_ENTRY(div, OpDiv)

// add_inplace_f32(float *y, const float *x, int32 n): y[i] += x[i]
extern "C" __global__ void add_inplace_f32(float* y, const float* x, int n) {
    MT_GRID_STRIDE(i, n) y[i] += x[i];
}
// add_inplace_f32_bf16(float *y, const uint16 *x /* bf16 */, int32 n): y[i] += float(x[i])
extern "C" __global__ void add_inplace_f32_bf16(float* y, const mt_u16* x, int n) {
    MT_GRID_STRIDE(i, n) y[i] += mt_bf2f(x[i]);
}
// add_inplace_bf16(uint16 *y, const uint16 *x, int32 n): y = bf16(float(y) + float(x))
extern "C" __global__ void add_inplace_bf16(mt_u16* y, const mt_u16* x, int n) {
    MT_GRID_STRIDE(i, n) y[i] = mt_f2bf(mt_bf2f(y[i]) + mt_bf2f(x[i]));
}

// scale_f32(const float *x, float *y, int32 n, float32 s, float32 b): y = x*s + b (y may alias x)
extern "C" __global__ void scale_f32(const float* x, float* y, int n, float s, float b) {
    MT_GRID_STRIDE(i, n) y[i] = fmaf(x[i], s, b);
}

// fill_f32(float *y, int32 n, float32 value)
extern "C" __global__ void fill_f32(float* y, int n, float value) {
    MT_GRID_STRIDE(i, n) y[i] = value;
}

// --------------------------------------------------------- activations
__device__ __forceinline__ float mt_silu(float x) { return x / (1.0f + expf(-x)); }
// ggml gelu (tanh approximation)
__device__ __forceinline__ float mt_gelu(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}
struct ActSilu { static __device__ __forceinline__ float f(float x) { return mt_silu(x); } };
struct ActGelu { static __device__ __forceinline__ float f(float x) { return mt_gelu(x); } };

// <silu|gelu>_f32(const float *x, float *y, int32 n)   (y may alias x)
#define MT_UNARY_ENTRY(name, ACT)                                                  \
    extern "C" __global__ void name##_f32(const float* x, float* y, int n) {      \
        MT_GRID_STRIDE(i, n) y[i] = ACT::f(x[i]);                                  \
    }
MT_UNARY_ENTRY(silu, ActSilu)
MT_UNARY_ENTRY(gelu, ActGelu)

// <swiglu|geglu>_f32(const float *gate, const float *up, float *y, int32 ne0, int32 n_rows,
//                    int32 gate_row_stride, int32 up_row_stride, int32 y_row_stride)
// y[r, i] = act(gate[r, i]) * up[r, i], act = silu (swiglu) or gelu-tanh (geglu).
// For a fused [2*ne0, n_rows] tensor pass gate = base, up = base + ne0, both strides 2*ne0.
#define MT_GLU_ENTRY(name, ACT)                                                              \
    extern "C" __global__ void name##_f32(const float* gate, const float* up, float* y,     \
                                          int ne0, int n_rows, int gate_row_stride,          \
                                          int up_row_stride, int y_row_stride) {             \
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
//                 int32 src_row_bytes, int32 dst_row_stride)
// dst row r (ne0 f32) = dequantized src row idx[r]. Types: all weight types of quant.cuh.
// Launch: 1-D grid-stride over n_idx * ne0 / CW.
template <typename W>
__device__ __forceinline__ void get_rows_impl(const mt_u8* __restrict__ src,
                                              const int* __restrict__ idx,
                                              float* __restrict__ dst, int ne0, int n_idx,
                                              int src_row_bytes, int dst_row_stride) {
    const int units = (ne0 / W::QK) * W::NCHUNK;
    const mt_i64 total = (mt_i64)units * n_idx;
    MT_GRID_STRIDE(i, total) {
        const int r = (int)(i / units);
        const int u = (int)(i - (mt_i64)r * units);
        const int ib = u / W::NCHUNK;
        const int c = u - ib * W::NCHUNK;
        const mt_u8* b = src + (mt_i64)idx[r] * src_row_bytes + (mt_i64)ib * W::BYTES;
        float v[W::CW];
        W::load(b, c, v);
        float* o = dst + (mt_i64)r * dst_row_stride + (mt_i64)ib * W::QK;
#pragma unroll
        for (int k = 0; k < W::CW; ++k) o[W::idx(c, k)] = v[k];
    }
}
#define MT_GET_ROWS_ENTRY(name, W)                                                            \
    extern "C" __global__ void get_rows_##name(const mt_u8* src, const int* idx, float* dst, \
                                               int ne0, int n_idx, int src_row_bytes,        \
                                               int dst_row_stride) {                         \
        get_rows_impl<W>(src, idx, dst, ne0, n_idx, src_row_bytes, dst_row_stride);          \
    }
MT_FOR_ALL_WTYPES(MT_GET_ROWS_ENTRY)

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
        mt_i64 r = i;
        const int i0 = (int)(r % ne0); r /= ne0;
        const int i1 = (int)(r % ne1); r /= ne1;
        const int i2 = (int)(r % ne2);
        const int i3 = (int)(r / ne2);
        const float v = S::load(src + (mt_i64)i0 * s0 + (mt_i64)i1 * s1 + (mt_i64)i2 * s2 +
                                (mt_i64)i3 * s3);
        D::store(dst + (mt_i64)i0 * d0 + (mt_i64)i1 * d1 + (mt_i64)i2 * d2 + (mt_i64)i3 * d3, v);
    }
}
// f16->f16 through f32 is exact (every f16 is an f32 that converts back unchanged).
#define MT_CPY_ENTRY(sname, S, dname, D)                                                      \
    extern "C" __global__ void cpy_##sname##_##dname(                                         \
        const S::T* src, D::T* dst, int ne0, int ne1, int ne2, int ne3, int s0, int s1,      \
        int s2, int s3, int d0, int d1, int d2, int d3) {                                     \
        cpy_impl<S, D>(src, dst, ne0, ne1, ne2, ne3, s0, s1, s2, s3, d0, d1, d2, d3);         \
    }
MT_CPY_ENTRY(f32, MtF32, f32, MtF32)
MT_CPY_ENTRY(f32, MtF32, f16, MtF16)
MT_CPY_ENTRY(f16, MtF16, f32, MtF32)
MT_CPY_ENTRY(f16, MtF16, f16, MtF16)
MT_CPY_ENTRY(f32, MtF32, bf16, MtBF16)
MT_CPY_ENTRY(bf16, MtBF16, f32, MtF32)

// f32_to_bf16(const float *x, uint16 *y, int32 n)  (round to nearest even, as ggml)
extern "C" __global__ void f32_to_bf16(const float* x, mt_u16* y, int n) {
    MT_GRID_STRIDE(i, n) y[i] = mt_f2bf(x[i]);
}
// bf16_to_f32(const uint16 *x, float *y, int32 n)
extern "C" __global__ void bf16_to_f32(const mt_u16* x, float* y, int n) {
    MT_GRID_STRIDE(i, n) y[i] = mt_bf2f(x[i]);
}
