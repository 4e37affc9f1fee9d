// metatp: SET_ROWS — write f32 rows into a cache (f16, bf16, f32, or quantized: q8_0, q4_0,
// q4_1, q5_0, q5_1) at int32 row indices.
// The indices are read from device memory, so a captured CUDA graph writes each replay's
// token to its own cache row. A second (src2 -> dst2) pair with the same indices can ride
// in the same launch: the K and V rows of one layer are stored by one kernel.
#include "kvcache.cuh"

template <typename O>
__device__ __forceinline__ void set_rows_impl(const float* __restrict__ src,
                                              typename O::T* __restrict__ dst,
                                              const int* __restrict__ idx, int ne0, int n_rows,
                                              int src_row_stride, int dst_row_stride,
                                              const float* __restrict__ src2,
                                              typename O::T* __restrict__ dst2, int ne0_2,
                                              int src2_row_stride, int dst2_row_stride) {
    const int width = ne0 + ne0_2;
    const mt_i64 total = (mt_i64)width * n_rows;
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (mt_i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / width);
        const int c = (int)(i - (mt_i64)r * width);
        const mt_i64 row = idx[r];
        if (c < ne0) {
            O::store(dst + row * dst_row_stride + c, src[(mt_i64)r * src_row_stride + c]);
        } else {
            const int c2 = c - ne0;
            O::store(dst2 + row * dst2_row_stride + c2, src2[(mt_i64)r * src2_row_stride + c2]);
        }
    }
}

// set_rows_f32_<f16|bf16|f32>(const float *src, T *dst, const int32 *idx, int32 ne0,
//     int32 n_rows, int32 src_row_stride, int32 dst_row_stride, const float *src2 /* or null */,
//     T *dst2, int32 ne0_2 /* 0: none */, int32 src2_row_stride, int32 dst2_row_stride)
// dst row idx[r] (ne0 elements) = src row r; likewise dst2 / src2 with ne0_2 elements.
// Strides in elements of each array (f16/bf16 stored as uint16).
// Launch: 1-D grid-stride over (ne0 + ne0_2) * n_rows.
#define MT_SET_ROWS_ENTRY(name, O)                                                            \
    extern "C" __global__ void set_rows_f32_##name(                                          \
        const float* src, O::T* dst, const int* idx, int ne0, int n_rows, int src_row_stride, \
        int dst_row_stride, const float* src2, O::T* dst2, int ne0_2, int src2_row_stride,    \
        int dst2_row_stride) {                                                               \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                           \
        set_rows_impl<O>(src, dst, idx, ne0, n_rows, src_row_stride, dst_row_stride, src2,   \
                         dst2, ne0_2, src2_row_stride, dst2_row_stride);                     \
    }

MT_SET_ROWS_ENTRY(f16, MtF16)
MT_SET_ROWS_ENTRY(bf16, MtBF16)
MT_SET_ROWS_ENTRY(f32, MtF32)

// ------------------------------------------------------------------ quantized caches
// One warp per 32-element block: lane l holds value l, the warp reduces the block's scale
// and writes its bytes (gguf.quants / ggml reference rounding, bit for bit). Warp w of the
// grid-stride loop takes block w % (nb + nb2) of row w / (nb + nb2): the first nb blocks
// are dst's, the next nb2 dst2's. The loop bound is the same for every lane of a warp.
template <typename Q>
__device__ __forceinline__ void set_rows_q_impl(const float* __restrict__ src, mt_u8* __restrict__ dst,
                                                const int* __restrict__ idx, int ne0, int n_rows,
                                                int src_row_stride, int dst_row_bytes,
                                                const float* __restrict__ src2, mt_u8* __restrict__ dst2,
                                                int ne0_2, int src2_row_stride, int dst2_row_bytes) {
    const int nb = ne0 / Q::QK, nb2 = ne0_2 / Q::QK;
    const int width = nb + nb2;
    const int lane = threadIdx.x & 31;
    const mt_i64 total = (mt_i64)width * n_rows;
    const mt_i64 step = ((mt_i64)gridDim.x * blockDim.x) >> 5;
    for (mt_i64 w = ((mt_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += step) {
        const int r = (int)(w / width);
        const int c = (int)(w - (mt_i64)r * width);
        const mt_i64 row = idx[r];
        float x;
        mt_u8* b;
        if (c < nb) {
            x = src[(mt_i64)r * src_row_stride + c * Q::QK + lane];
            b = dst + row * dst_row_bytes + (mt_i64)c * Q::BYTES;
        } else {
            const int c2 = c - nb;
            x = src2[(mt_i64)r * src2_row_stride + c2 * Q::QK + lane];
            b = dst2 + row * dst2_row_bytes + (mt_i64)c2 * Q::BYTES;
        }
        Q::quantize(x, lane, b);
    }
}

// set_rows_f32_<q8_0|q4_0|q4_1|q5_0|q5_1>(const float *src, uint8 *dst, const int32 *idx,
//     int32 ne0, int32 n_rows, int32 src_row_stride, int32 dst_row_bytes,
//     const float *src2 /* or null */, uint8 *dst2, int32 ne0_2 /* 0: none */,
//     int32 src2_row_stride, int32 dst2_row_bytes)
// dst row idx[r] (ne0 elements = ne0/32 blocks) = src row r quantized; likewise dst2 / src2.
// ne0 and ne0_2 are multiples of 32; source strides in floats, destination strides in bytes
// (even: blocks are 2-byte aligned). Launch: 1-D grid-stride, blockDim % 32 == 0, one warp
// per block of ((ne0 + ne0_2) / 32) * n_rows.
#define MT_SET_ROWS_Q_ENTRY(name, Q)                                                          \
    extern "C" __global__ void set_rows_f32_##name(                                          \
        const float* src, mt_u8* dst, const int* idx, int ne0, int n_rows, int src_row_stride, \
        int dst_row_bytes, const float* src2, mt_u8* dst2, int ne0_2, int src2_row_stride,    \
        int dst2_row_bytes) {                                                                \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                           \
        set_rows_q_impl<Q>(src, dst, idx, ne0, n_rows, src_row_stride, dst_row_bytes, src2,  \
                           dst2, ne0_2, src2_row_stride, dst2_row_bytes);                    \
    }

MT_SET_ROWS_Q_ENTRY(q8_0, KvQ8_0)
MT_SET_ROWS_Q_ENTRY(q4_0, KvQ4_0)
MT_SET_ROWS_Q_ENTRY(q4_1, KvQ4_1)
MT_SET_ROWS_Q_ENTRY(q5_0, KvQ5_0)
MT_SET_ROWS_Q_ENTRY(q5_1, KvQ5_1)
