// metatp: a transformer layer's attention input for one token in one launch: (RMS norm +) the
// q/k/v products, RoPE of q and k, and the K/V cache row write (fusion QKV_ROPE_KV). The row
// core (mt_matvec_rows, mt_rms_scale) is matvec.cu's, shared through matvec_core.cuh.
#include "matvec_core.cuh"

// qkv_rope_kv_<type>_<f32|f16|bf16>(const uint8 *wq, const uint8 *wk, const uint8 *wv,
//     int32 rbq, int32 rbk, int32 rbv, const float *x, int32 ne0, const float *norm_w /* or null */,
//     float32 eps, int32 norm, float *q, int32 q_head_stride, T *k_cache, T *v_cache,
//     const int32 *kv_row, int32 k_row_stride, int32 v_row_stride, int32 n_head, int32 n_head_kv,
//     int32 v_rows, int32 head_dim, int32 n_dims, int32 neox, const int32 *pos,
//     const float *freq_factors /* [n_dims/2] or null */, float32 freq_base, float32 freq_scale,
//     float32 attn_factor)
// One token of a transformer layer's attention input in one launch: x' as in matvec_multi,
// q = Wq x', k = Wk x', v = Wv x' (one weight type, rb* bytes per row); q and k (head_dim rows
// per head) rotated as rope_<norm|neox>_f32 rotates them at position pos[0]; q written to q
// (head h at q + h*q_head_stride), k and v converted to the cache type T and written to cache
// row kv_row[0] (k_cache + kv_row[0]*k_row_stride, n_head_kv*head_dim elements; v: v_rows).
// Work unit: a pair of rows of one weight, both computed by one thread row (NW = 2 in
// mt_matvec_rows, so the pair's rope finishes in registers): q/k NORMAL rows (2i, 2i+1) of a
// head, NEOX rows (i, i + n_dims/2) for i < n_dims/2 and (n_dims + 2m, n_dims + 2m + 1) for
// the unrotated rest; v rows (2i, 2i+1). Pairs are numbered q's, then k's, then v's.
// head_dim, n_dims (<= head_dim) and v_rows even. Launch: block (bx, by) as matvec,
// grid (ceil((n_head*head_dim + n_head_kv*head_dim + v_rows) / 2 / by)).
template <typename W, typename O>
__device__ __forceinline__ void mt_qkv_rope_kv(
    const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv, const float* x,
    int ne0, const float* norm_w, float eps, int norm, float* q, int q_head_stride,
    typename O::T* k_cache, typename O::T* v_cache, const int* kv_row, int k_row_stride,
    int v_row_stride, int n_head, int n_head_kv, int v_rows, int head_dim, int n_dims, int neox,
    const int* pos, const float* freq_factors, float freq_base, float freq_scale,
    float attn_factor) {
    const float s = norm ? mt_rms_scale(x, ne0, eps) : 1.0f;
    const int half = head_dim >> 1, rh = n_dims >> 1;
    const int nq = n_head * half, nk = n_head_kv * half;
    const int n_pairs = nq + nk + (v_rows >> 1);
    const int slot = blockIdx.x * blockDim.y + threadIdx.y;
    int j = 0, p = slot < n_pairs ? slot : 0;  // weight j (0 q, 1 k, 2 v), its pair p
    if (p >= nq) {
        p -= nq;
        j = 1;
        if (p >= nk) {
            p -= nk;
            j = 2;
        }
    }
    int h = 0, ia = 2 * p, ib = 2 * p + 1, i = 0;  // head h, its rows ia, ib (v: rows 2p, 2p+1)
    bool rot = false;
    if (j < 2) {
        h = p / half;
        i = p - h * half;
        rot = i < rh;
        ia = neox ? (rot ? i : n_dims + 2 * (i - rh)) : 2 * i;
        ib = neox && rot ? i + rh : ia + 1;
    }
    const int ra = h * head_dim + ia, rb = h * head_dim + ib;  // weight rows (v: h = 0)
    const mt_u8* w = j == 0 ? wq : (j == 1 ? wk : wv);
    const int row_bytes = j == 0 ? rbq : (j == 1 ? rbk : rbv);
    const mt_u8* ws[2] = {w + (mt_i64)ra * row_bytes, w + (mt_i64)rb * row_bytes};
    float acc[2][1];
    // row_bytes 0: the pair's row pointers are already in ws
    if (!mt_matvec_rows<W, 1, 2>(ws, x, ne0, n_pairs, 0, 1, 0, acc, blockIdx.x, norm ? norm_w : 0))
        return;
    float a = acc[0][0] * s, b = acc[1][0] * s;
    if (rot) {
        float theta = (float)pos[0] * powf(freq_base, -(float)(2 * i) / (float)n_dims);
        if (freq_factors != 0) theta = theta / freq_factors[i];
        theta = freq_scale * theta;
        float sn, cs;
        sincosf(theta, &sn, &cs);
        cs *= attn_factor;
        sn *= attn_factor;
        const float a0 = a;
        a = a0 * cs - b * sn;
        b = a0 * sn + b * cs;
    }
    if (j == 0) {
        float* qh = q + (mt_i64)h * q_head_stride;
        qh[ia] = a;
        qh[ib] = b;
        return;
    }
    const mt_i64 row = kv_row[0];
    typename O::T* dst = j == 1 ? k_cache + row * k_row_stride : v_cache + row * v_row_stride;
    O::store(dst + ra, a);
    O::store(dst + rb, b);
}

#define MT_QKV_ROPE_KV_ENTRY_C(name, W, cname, O)                                                 \
    extern "C" __global__ void __launch_bounds__(256) qkv_rope_kv_##name##_##cname(              \
        const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv,             \
        const float* x, int ne0, const float* norm_w, float eps, int norm, float* q,             \
        int q_head_stride, O::T* k_cache, O::T* v_cache, const int* kv_row, int k_row_stride,    \
        int v_row_stride, int n_head, int n_head_kv, int v_rows, int head_dim, int n_dims,       \
        int neox, const int* pos, const float* freq_factors, float freq_base, float freq_scale,  \
        float attn_factor) {                                                                     \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                               \
        mt_qkv_rope_kv<W, O>(wq, wk, wv, rbq, rbk, rbv, x, ne0, norm_w, eps, norm, q,            \
                             q_head_stride, k_cache, v_cache, kv_row, k_row_stride, v_row_stride, \
                             n_head, n_head_kv, v_rows, head_dim, n_dims, neox, pos,             \
                             freq_factors, freq_base, freq_scale, attn_factor);                  \
    }
#define MT_QKV_ROPE_KV_ENTRY(name, W)                  \
    MT_QKV_ROPE_KV_ENTRY_C(name, W, f32, MtF32)        \
    MT_QKV_ROPE_KV_ENTRY_C(name, W, f16, MtF16)        \
    MT_QKV_ROPE_KV_ENTRY_C(name, W, bf16, MtBF16)

MT_FOR_ALL_WTYPES(MT_QKV_ROPE_KV_ENTRY)
