// metatp: a transformer layer's attention input for one token in one launch: (RMS norm +) the
// q/k/v products, RoPE of q and k, and the K/V cache row write (fusion QKV_ROPE_KV). The row
// core (mt_matvec_rows, mt_rms_scale) is matvec.cu's, shared through matvec_core.cuh; the
// cache types and their block quantizers are kvcache.cuh's (the ones set_rows uses).
#include "matvec_core.cuh"
#include "kvcache.cuh"

// ------------------------------------------------------------------ cache types
// C::T the cache element (a quantized cache: bytes, row strides in bytes); C::QUANT; a float
// cache stores each value (C::store), a quantized one quantizes whole 32-value blocks
// (C::quantize(x, lane, block), one warp: lane l value l), bit for bit set_rows' blocks.
template <typename O>
struct QkvFloatCache {
    typedef typename O::T T;
    enum { QUANT = 0, QK = 32, BYTES = 0 };
    static __device__ __forceinline__ void store(T* p, float v) { O::store(p, v); }
    static __device__ __forceinline__ void quantize(float, int, mt_u8*) {}
};
template <typename Q>
struct QkvQuantCache {
    typedef mt_u8 T;
    enum { QUANT = 1, QK = Q::QK, BYTES = Q::BYTES };
    static __device__ __forceinline__ void store(T*, float) {}
    static __device__ __forceinline__ void quantize(float x, int lane, mt_u8* b) { Q::quantize(x, lane, b); }
};

template <typename A, typename B> struct MtSameType { enum { value = 0 }; };
template <typename A> struct MtSameType<A, A> { enum { value = 1 }; };

// A quantized cache's groups: the k row of KV head h is group h (head_dim / 32 blocks), the
// 32-value block g of the v row is group n_head_kv + g. The thread row that finishes a pair
// puts its two values in `stage` (f32: the k row, then the v row), fences, and takes a ticket
// on its group's counter; the warp that draws the group's last ticket quantizes its blocks
// from `stage` into cache row `row` and puts the counter back to 0 (the next launch and every
// CUDA-graph replay start from zero). No block waits for another: block order does not matter.
template <typename C>
__device__ __forceinline__ void mt_qkv_quantize_group(int group, const float* stage, typename C::T* k_cache,
                                                      typename C::T* v_cache, mt_i64 row, int k_row_stride,
                                                      int v_row_stride, int n_head_kv, int head_dim, int lane) {
    __threadfence();  // the other rows' values are read after their tickets
    const volatile float* sv = stage;
    const int k_elems = n_head_kv * head_dim;
    if (group < n_head_kv) {
        const int nb = head_dim / C::QK;
        for (int b = 0; b < nb; ++b) {
            const int e = group * head_dim + b * C::QK;
            C::quantize(sv[e + lane], lane, (mt_u8*)(k_cache + row * k_row_stride) + (mt_i64)(e / C::QK) * C::BYTES);
        }
    } else {
        const int g = group - n_head_kv;
        C::quantize(sv[k_elems + g * C::QK + lane], lane,
                    (mt_u8*)(v_cache + row * v_row_stride) + (mt_i64)g * C::BYTES);
    }
}

// qkv_rope_kv_<type>[_<v type>]_<cache>(const uint8 *wq, const uint8 *wk, const uint8 *wv,
//     int32 rbq, int32 rbk, int32 rbv, const float *x, int32 ne0, const float *norm_w /* or null */,
//     float32 eps, int32 norm, float *q, int32 q_head_stride, T *k_cache, T *v_cache,
//     const int32 *kv_row, int32 k_row_stride, int32 v_row_stride, int32 n_head, int32 n_head_kv,
//     int32 v_rows, int32 head_dim, int32 n_dims, int32 neox, const int32 *pos,
//     const float *freq_factors /* [n_dims/2] or null */, float32 freq_base, float32 freq_scale,
//     float32 attn_factor, float *stage /* quantized caches */, int32 *tickets /* quantized caches */)
// One token of a transformer layer's attention input in one launch: x' as in matvec_multi,
// q = Wq x', k = Wk x', v = Wv x' (Wq, Wk of one weight type, Wv of the same or of the <v type>;
// rb* bytes per row); q and k (head_dim rows per head) rotated as rope_<norm|neox>_f32 rotates
// them at position pos[0]; q written to q (head h at q + h*q_head_stride), k and v written to
// cache row kv_row[0] (k_cache + kv_row[0]*k_row_stride, n_head_kv*head_dim elements; v:
// v_rows) as the cache type stores them: converted (f32, f16, bf16; strides in elements), or
// quantized in blocks of 32 (q8_0, q4_0, q4_1, q5_0, q5_1; strides in bytes) through `stage`
// (n_head_kv*head_dim + v_rows floats) and `tickets` (n_head_kv + v_rows/32 int32 counters,
// all 0 before the first launch; every launch leaves them 0).
// Work unit: a pair of rows of one weight, both computed by one thread row (NW = 2 in
// mt_matvec_rows, so the pair's rope finishes in registers): q/k NORMAL rows (2i, 2i+1) of a
// head, NEOX rows (i, i + n_dims/2) for i < n_dims/2 and (n_dims + 2m, n_dims + 2m + 1) for
// the unrotated rest; v rows (2i, 2i+1). Pairs are numbered q's, then k's, then v's.
// head_dim, n_dims (<= head_dim) and v_rows even (multiples of 32 for a quantized cache).
// Launch: block (bx, by) as matvec, grid (ceil((n_head*head_dim + n_head_kv*head_dim + v_rows)
// / 2 / by)).
template <typename WQK, typename WV, typename C>
__device__ __forceinline__ void mt_qkv_rope_kv(
    const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv, const float* x,
    int ne0, const float* norm_w, float eps, int norm, float* q, int q_head_stride,
    typename C::T* k_cache, typename C::T* v_cache, const int* kv_row, int k_row_stride,
    int v_row_stride, int n_head, int n_head_kv, int v_rows, int head_dim, int n_dims, int neox,
    const int* pos, const float* freq_factors, float freq_base, float freq_scale,
    float attn_factor, float* stage, int* tickets) {
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
    // row_bytes 0: the pair's row pointers are already in ws. With a v type of its own every
    // thread runs both cores (each may synchronize the block), a row doing the work in one.
    bool holder;
    if (MtSameType<WQK, WV>::value) {
        holder = mt_matvec_rows<WQK, 1, 2>(ws, x, ne0, n_pairs, 0, 1, 0, acc, blockIdx.x, norm ? norm_w : 0);
    } else {
        float acc_v[2][1];
        const bool hq = mt_matvec_rows<WQK, 1, 2>(ws, x, ne0, j < 2 ? n_pairs : 0, 0, 1, 0, acc, blockIdx.x,
                                                  norm ? norm_w : 0);
        const bool hv = mt_matvec_rows<WV, 1, 2>(ws, x, ne0, j == 2 ? n_pairs : 0, 0, 1, 0, acc_v, blockIdx.x,
                                                 norm ? norm_w : 0);
        if (hv) {
            acc[0][0] = acc_v[0][0];
            acc[1][0] = acc_v[1][0];
        }
        holder = hq || hv;
    }
    int last_group = -1;  // the group whose last ticket this thread drew
    if (holder) {
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
        } else if (!C::QUANT) {
            const mt_i64 row = kv_row[0];
            typename C::T* dst = j == 1 ? k_cache + row * k_row_stride : v_cache + row * v_row_stride;
            C::store(dst + ra, a);
            C::store(dst + rb, b);
        } else {
            float* st = stage + (j == 1 ? 0 : n_head_kv * head_dim);
            st[ra] = a;
            st[rb] = b;
            __threadfence();  // the values are visible device-wide before the ticket
            const int group = j == 1 ? h : n_head_kv + p / (C::QK / 2);
            const int size = j == 1 ? half : C::QK / 2;
            if (atomicAdd(tickets + group, 1) == size - 1) last_group = group;
        }
    }
    if (!C::QUANT || threadIdx.x >= 32) return;  // the quantizing warp: the row's first (lane 0 holds)
    const int lane = threadIdx.x;
    const int group = mt_warp_max_i(last_group);  // lane 0's (the others hold -1)
    if (group < 0) return;
    mt_qkv_quantize_group<C>(group, stage, k_cache, v_cache, (mt_i64)kv_row[0], k_row_stride, v_row_stride,
                             n_head_kv, head_dim, lane);
    if (lane == 0) atomicExch(tickets + group, 0);
}

#define MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, cname, C)                                          \
    extern "C" __global__ void __launch_bounds__(256) qkv_rope_kv_##name##_##cname(              \
        const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv,             \
        const float* x, int ne0, const float* norm_w, float eps, int norm, float* q,             \
        int q_head_stride, C::T* k_cache, C::T* v_cache, const int* kv_row, int k_row_stride,    \
        int v_row_stride, int n_head, int n_head_kv, int v_rows, int head_dim, int n_dims,       \
        int neox, const int* pos, const float* freq_factors, float freq_base, float freq_scale,  \
        float attn_factor, float* stage, int* tickets) {                                         \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                               \
        mt_qkv_rope_kv<WQK, WV, C>(wq, wk, wv, rbq, rbk, rbv, x, ne0, norm_w, eps, norm, q,      \
                                   q_head_stride, k_cache, v_cache, kv_row, k_row_stride,         \
                                   v_row_stride, n_head, n_head_kv, v_rows, head_dim, n_dims,     \
                                   neox, pos, freq_factors, freq_base, freq_scale, attn_factor,   \
                                   stage, tickets);                                              \
    }
#define MT_QKV_ROPE_KV_CACHES(name, WQK, WV)                                        \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, f32, QkvFloatCache<MtF32>)                \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, f16, QkvFloatCache<MtF16>)                \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, bf16, QkvFloatCache<MtBF16>)              \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, q8_0, QkvQuantCache<KvQ8_0>)              \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, q4_0, QkvQuantCache<KvQ4_0>)              \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, q4_1, QkvQuantCache<KvQ4_1>)              \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, q5_0, QkvQuantCache<KvQ5_0>)              \
    MT_QKV_ROPE_KV_ENTRY_C(name, WQK, WV, q5_1, QkvQuantCache<KvQ5_1>)
#define MT_QKV_ROPE_KV_ENTRY(name, W) MT_QKV_ROPE_KV_CACHES(name, W, W)
#define MT_QKV_ROPE_KV_PAIR_ENTRY(qk, WQK, v, WV) MT_QKV_ROPE_KV_CACHES(qk##_##v, WQK, WV)

// q/k and v weights of one type: qkv_rope_kv_<type>_<cache>
MT_FOR_ALL_WTYPES(MT_QKV_ROPE_KV_ENTRY)

// (q/k type, v type) pairs llama.cpp's quantizer writes (llama-quant.cpp): qkv_rope_kv_<qk>_<v>_<cache>.
// One line a pair (kernels/qkv_rope.py reads this table); a pair not here is refused by the finder.
//   Q4_K_M / Q5_K_M: attn_v Q6_K on use_more_bits layers; Q4_K_S (and Q3_K_M's q4_k layers): Q5_K on the first.
// Waiting for their weight types in MT_FOR_ALL_WTYPES: (q3_k, q5_k) / (q3_k, q4_k) (Q3_K_M), and the
// fallbacks of rows not a multiple of 256, (q5_0, q8_0) (Q4_K_M) and (q5_1, q8_0) (Q5_K_M).
#define MT_QKV_MIXED_PAIRS(M) \
    M(q4_k, WQ4_K, q6_k, WQ6_K) \
    M(q5_k, WQ5_K, q6_k, WQ6_K) \
    M(q4_k, WQ4_K, q5_k, WQ5_K)

MT_QKV_MIXED_PAIRS(MT_QKV_ROPE_KV_PAIR_ENTRY)
