// metatp: dequantize rows of a ggml weight (any supported type) to f32 or f16.
// Used by the prefill path (dequantize, then cupy.matmul / cuBLAS).
#include "quant.cuh"

// One thread per chunk (CW elements), grid-stride over n_rows * chunks_per_row.
template <typename W, typename O>
__device__ __forceinline__ void dequant_rows(const mt_u8* __restrict__ src,
                                             typename O::T* __restrict__ dst, int ne0,
                                             int n_rows, int src_row_bytes, int dst_row_stride) {
    const int units = (ne0 / W::QK) * W::NCHUNK;
    const mt_i64 total = (mt_i64)units * n_rows;
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (mt_i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / units);
        const int u = (int)(i - (mt_i64)r * units);
        const int ib = u / W::NCHUNK;
        const int c = u - ib * W::NCHUNK;
        const mt_u8* b = src + (mt_i64)r * src_row_bytes + (mt_i64)ib * W::BYTES;
        float v[W::CW];
        W::load(b, c, v);
        typename O::T* o = dst + (mt_i64)r * dst_row_stride + (mt_i64)ib * W::QK;
#pragma unroll
        for (int k = 0; k < W::CW; ++k) O::store(o + W::idx(c, k), v[k]);
    }
}

// dequant_<type>_f32(const uint8 *src, float *dst, int32 ne0, int32 n_rows,
//                    int32 src_row_bytes, int32 dst_row_stride /* elements */)
// dequant_<type>_f16(const uint8 *src, uint16 *dst /* f16 bits */, same ints)
// ne0: elements per row (multiple of the block size); row r of src starts at
// src + r*src_row_bytes, row r of dst at dst + r*dst_row_stride.
// Launch: 1-D, any grid/block (grid-stride); types f32 f16 bf16 q8_0 q4_0 q4_1 q4_k q5_k q6_k.
#define MT_DEQUANT_ENTRY(name, W)                                                          \
    extern "C" __global__ void dequant_##name##_f32(const mt_u8* src, float* dst, int ne0, \
                                                    int n_rows, int src_row_bytes,         \
                                                    int dst_row_stride) {                  \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                         \
        dequant_rows<W, MtF32>(src, dst, ne0, n_rows, src_row_bytes, dst_row_stride);      \
    }                                                                                      \
    extern "C" __global__ void dequant_##name##_f16(const mt_u8* src, mt_u16* dst, int ne0, \
                                                    int n_rows, int src_row_bytes,          \
                                                    int dst_row_stride) {                   \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                          \
        dequant_rows<W, MtF16>(src, dst, ne0, n_rows, src_row_bytes, dst_row_stride);       \
    }

MT_FOR_ALL_WTYPES(MT_DEQUANT_ENTRY)
