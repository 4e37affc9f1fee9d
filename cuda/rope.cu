// metatp: rotary position embedding (ggml ROPE, modes NORMAL and NEOX), f32.
#include "quant.cuh"

// x, y: [head_dim, n_head, n_tokens]; element (d, h, t) at d + h*s1 + t*s2.
// pos: int32 [n_tokens], read from device memory (a captured CUDA graph replays with new
// positions). Only the first n_dims of each head rotate; the rest are copied.
// Pair i0 = 0, 2, .., n_dims-2 rotates by
//   theta = pos * freq_scale * freq_base^(-i0/n_dims) / freq_factors[i0/2]
// NORMAL rotates elements (i0, i0+1); NEOX rotates (i0/2, i0/2 + n_dims/2).
// cos/sin are multiplied by attn_factor (1.0 for plain RoPE). YaRN ramps are not applied.
// A second tensor (x2 -> y2, n_head2 heads, same positions and head size) can ride in the
// same launch: Q and K of one layer are rotated by one kernel.
template <bool NEOX>
__device__ __forceinline__ void rope_pair(const float* xr, float* yr, int i0, int ip, int n_dims,
                                          float p, const float* freq_factors, float freq_base,
                                          float freq_scale, float attn_factor) {
    if (i0 >= n_dims) {
        const float a = xr[i0], b = xr[i0 + 1];
        yr[i0] = a;
        yr[i0 + 1] = b;
        return;
    }
    const int ia = NEOX ? ip : i0;
    const int ib = NEOX ? ip + (n_dims >> 1) : i0 + 1;
    float a = xr[ia], b = xr[ib];
    mt_rope_pair(a, b, p, ip, n_dims, freq_factors, freq_base, freq_scale, attn_factor);
    yr[ia] = a;
    yr[ib] = b;
}

template <bool NEOX>
__device__ __forceinline__ void rope_impl(const float* x, float* y, const float* x2, float* y2,
                                          const int* pos, const float* freq_factors,
                                          int head_dim, int n_head, int n_head2, int n_tokens,
                                          int n_dims, int x_s1, int x_s2, int y_s1, int y_s2,
                                          int x2_s1, int x2_s2, int y2_s1, int y2_s2,
                                          float freq_base, float freq_scale, float attn_factor) {
    const int half = head_dim >> 1;
    const int heads = n_head + n_head2;
    const mt_i64 total = (mt_i64)half * heads * n_tokens;
    for (mt_i64 i = (mt_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (mt_i64)gridDim.x * blockDim.x) {
        const int ip = (int)(i % half);
        const mt_i64 ht = i / half;
        const int h = (int)(ht % heads);
        const int t = (int)(ht / heads);
        const float* xr;
        float* yr;
        if (h < n_head) {
            xr = x + (mt_i64)t * x_s2 + (mt_i64)h * x_s1;
            yr = y + (mt_i64)t * y_s2 + (mt_i64)h * y_s1;
        } else {
            xr = x2 + (mt_i64)t * x2_s2 + (mt_i64)(h - n_head) * x2_s1;
            yr = y2 + (mt_i64)t * y2_s2 + (mt_i64)(h - n_head) * y2_s1;
        }
        rope_pair<NEOX>(xr, yr, 2 * ip, ip, n_dims, (float)pos[t], freq_factors, freq_base,
                        freq_scale, attn_factor);
    }
}

// rope_norm_f32 / rope_neox_f32(const float *x, float *y, const float *x2, float *y2,
//     const int32 *pos, const float *freq_factors /* [n_dims/2] or null */, int32 head_dim,
//     int32 n_head, int32 n_head2 /* 0: no second tensor */, int32 n_tokens, int32 n_dims,
//     int32 x_s1, int32 x_s2, int32 y_s1, int32 y_s2, int32 x2_s1, int32 x2_s2, int32 y2_s1,
//     int32 y2_s2, float32 freq_base, float32 freq_scale, float32 attn_factor)
// Strides in elements; y may alias x (same strides). head_dim and n_dims even.
// Launch: 1-D grid-stride over head_dim/2 * (n_head + n_head2) * n_tokens pairs.
#define MT_ROPE_ENTRY(name, NEOX)                                                             \
    extern "C" __global__ void name(                                                         \
        const float* x, float* y, const float* x2, float* y2, const int* pos,                \
        const float* freq_factors, int head_dim, int n_head, int n_head2, int n_tokens,      \
        int n_dims, int x_s1, int x_s2, int y_s1, int y_s2, int x2_s1, int x2_s2, int y2_s1,  \
        int y2_s2, float freq_base, float freq_scale, float attn_factor) {                   \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                           \
        rope_impl<NEOX>(x, y, x2, y2, pos, freq_factors, head_dim, n_head, n_head2, n_tokens, \
                        n_dims, x_s1, x_s2, y_s1, y_s2, x2_s1, x2_s2, y2_s1, y2_s2,          \
                        freq_base, freq_scale, attn_factor);                                 \
    }

MT_ROPE_ENTRY(rope_norm_f32, false)
MT_ROPE_ENTRY(rope_neox_f32, true)
