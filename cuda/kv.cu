// metatp: SET_ROWS — write f32 rows into a cache (f16, bf16 or f32) at int32 row indices.
#include "quant.cuh"

template <typename O>
__device__ __forceinline__ void set_rows_impl(const float* __restrict__ src,
                                              typename O::T* __restrict__ dst,
                                              const int* __restrict__ idx, int ne0, int n_rows,
                                              int src_row_stride, int dst_row_stride) {
    const mt_i64 total = (mt_i64)ne0 * n_rows;
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (mt_i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / ne0);
        const int c = (int)(i - (mt_i64)r * ne0);
        const float v = src[(mt_i64)r * src_row_stride + c];
        O::store(dst + (mt_i64)idx[r] * dst_row_stride + c, v);
    }
}

// set_rows_f32_<f16|bf16|f32>(const float *src, T *dst, const int32 *idx, int32 ne0,
//                             int32 n_rows, int32 src_row_stride, int32 dst_row_stride)
// dst row idx[r] (ne0 elements) = src row r. Strides in elements of each array
// (f16/bf16 stored as uint16). Launch: 1-D grid-stride over ne0 * n_rows.
#define MT_SET_ROWS_ENTRY(name, O)                                                            \
    extern "C" __global__ void set_rows_f32_##name(const float* src, O::T* dst, const int* idx, \
                                                   int ne0, int n_rows, int src_row_stride,     \
                                                   int dst_row_stride) {                        \
        set_rows_impl<O>(src, dst, idx, ne0, n_rows, src_row_stride, dst_row_stride);           \
    }

MT_SET_ROWS_ENTRY(f16, MtF16)
MT_SET_ROWS_ENTRY(bf16, MtBF16)
MT_SET_ROWS_ENTRY(f32, MtF32)
