// metatp: a transformer layer's attention input for one token in one launch: (RMS norm +) the
// q/k/v products, RoPE of q and k, and the K/V cache row write (fusion QKV_ROPE_KV). The row
// core (mt_matvec_rows, mt_rms_scale) is matvec.cu's, shared through matvec_core.cuh; the
// cache types and their block quantizers are kvcache.cuh's (the ones set_rows uses).
#include "matvec_core.cuh"
#include "kvcache.cuh"

// ------------------------------------------------------------------ cache types
// The cache type is a kernel argument (one kernel per weight type or pair, not per cache type:
// the row products are the expensive code to compile): a code of this table (kernels/qkv_rope.py
// reads it), tested warp-uniformly where a value is stored and where a group is quantized. A
// float cache stores each value (strides in elements); a quantized one quantizes whole 32-value
// blocks through kvcache.cuh's quantizers, bit for bit set_rows' blocks (strides in bytes).
#define MT_QKV_CACHE_CODES(M) \
    M(0, f32) \
    M(1, f16) \
    M(2, bf16) \
    M(3, q8_0) \
    M(4, q4_0) \
    M(5, q4_1) \
    M(6, q5_0) \
    M(7, q5_1)

#define MT_QKV_CACHE_ENUM(n, c) MT_QKV_CACHE_##c = n,
enum { MT_QKV_CACHE_CODES(MT_QKV_CACHE_ENUM) MT_QKV_N_CACHE_CODES };
#define MT_QKV_QK 32  // values per block of every quantized cache type

__device__ __forceinline__ bool mt_qkv_known_cache(int code) { return code >= 0 && code < MT_QKV_N_CACHE_CODES; }
__device__ __forceinline__ bool mt_qkv_quant_cache(int code) {
    return code >= MT_QKV_CACHE_q8_0 && code < MT_QKV_N_CACHE_CODES;
}
// bytes of one storage element of a float cache (a quantized cache's strides are in bytes: 1)
__device__ __forceinline__ int mt_qkv_elem_bytes(int code) {
    return code == MT_QKV_CACHE_f32 ? 4 : (code == MT_QKV_CACHE_f16 || code == MT_QKV_CACHE_bf16 ? 2 : 1);
}
// value v as element i of float cache row `row` (a float code)
__device__ __forceinline__ void mt_qkv_store_float(mt_u8* row, int code, int i, float v) {
    switch (code) {
    case MT_QKV_CACHE_f32: MtF32::store((float*)row + i, v); break;
    case MT_QKV_CACHE_f16: MtF16::store((mt_u16*)row + i, v); break;
    case MT_QKV_CACHE_bf16: MtBF16::store((mt_u16*)row + i, v); break;
    default: break;
    }
}
// bytes of one block of a quantized cache (a quantized code)
__device__ __forceinline__ int mt_qkv_block_bytes(int code) {
    switch (code) {
    case MT_QKV_CACHE_q8_0: return KvQ8_0::BYTES;
    case MT_QKV_CACHE_q4_0: return KvQ4_0::BYTES;
    case MT_QKV_CACHE_q4_1: return KvQ4_1::BYTES;
    case MT_QKV_CACHE_q5_0: return KvQ5_0::BYTES;
    default: return KvQ5_1::BYTES;
    }
}
// one warp (lane l holds value l) writes the block at b (a quantized code; warp-uniform)
__device__ __forceinline__ void mt_qkv_quantize_block(int code, float x, int lane, mt_u8* b) {
    switch (code) {
    case MT_QKV_CACHE_q8_0: KvQ8_0::quantize(x, lane, b); break;
    case MT_QKV_CACHE_q4_0: KvQ4_0::quantize(x, lane, b); break;
    case MT_QKV_CACHE_q4_1: KvQ4_1::quantize(x, lane, b); break;
    case MT_QKV_CACHE_q5_0: KvQ5_0::quantize(x, lane, b); break;
    case MT_QKV_CACHE_q5_1: KvQ5_1::quantize(x, lane, b); break;
    default: break;
    }
}

template <typename A, typename B> struct MtSameType { enum { value = 0 }; };
template <typename A> struct MtSameType<A, A> { enum { value = 1 }; };

// A quantized cache's groups: the k row of KV head h is group h (head_dim / 32 blocks), the
// 32-value block g of the v row is group n_head_kv + g. The thread row that finishes a pair
// puts its two values in `stage` (f32: the k row, then the v row), fences, and takes a ticket
// on its group's counter; the warp that draws the group's last ticket quantizes its blocks
// from `stage` into cache row `row` and puts the counter back to 0 (the next launch and every
// CUDA-graph replay start from zero). No block waits for another: block order does not matter.
__device__ __forceinline__ void mt_qkv_quantize_group(int code, int group, const float* stage, mt_u8* k_cache,
                                                      mt_u8* v_cache, mt_i64 row, int k_row_stride,
                                                      int v_row_stride, int n_head_kv, int head_dim, int lane) {
    __threadfence();  // the other rows' values are read after their tickets
    const volatile float* sv = stage;
    const int k_elems = n_head_kv * head_dim;
    const int bytes = mt_qkv_block_bytes(code);
    if (group < n_head_kv) {
        const int nb = head_dim / MT_QKV_QK;
        for (int b = 0; b < nb; ++b) {
            const int e = group * head_dim + b * MT_QKV_QK;
            mt_qkv_quantize_block(code, sv[e + lane], lane,
                                  k_cache + row * k_row_stride + (mt_i64)(e / MT_QKV_QK) * bytes);
        }
    } else {
        const int g = group - n_head_kv;
        mt_qkv_quantize_block(code, sv[k_elems + g * MT_QKV_QK + lane], lane,
                              v_cache + row * v_row_stride + (mt_i64)g * bytes);
    }
}

// qkv_rope_kv_<type>[_<v type>](const uint8 *wq, const uint8 *wk, const uint8 *wv,
//     int32 rbq, int32 rbk, int32 rbv, const float *x, int32 ne0, const float *norm_w /* or null */,
//     float32 eps, int32 norm, float *q, int32 q_head_stride, uint8 *k_cache, uint8 *v_cache,
//     int32 cache_type /* MT_QKV_CACHE_CODES */, const int32 *kv_row, int32 k_row_stride,
//     int32 v_row_stride, int32 n_head, int32 n_head_kv, int32 v_rows, int32 head_dim, int32 n_dims, int32 neox, const int32 *pos,
//     const float *freq_factors /* [n_dims/2] or null */, float32 freq_base, float32 freq_scale,
//     float32 attn_factor, float *stage /* quantized caches */, int32 *tickets /* quantized caches */)
// One token of a transformer layer's attention input in one launch: x' as in matvec_multi,
// q = Wq x', k = Wk x', v = Wv x' (Wq, Wk of one weight type, Wv of the same or of the <v type>;
// rb* bytes per row); q and k (head_dim rows per head) rotated as rope_<norm|neox>_f32 rotates
// them at position pos[0]; q written to q (head h at q + h*q_head_stride), k and v written to
// cache row kv_row[0] (k_cache + kv_row[0]*k_row_stride, n_head_kv*head_dim elements; v:
// v_rows) as the cache type (the code `cache_type`) stores them: converted (f32, f16, bf16;
// strides in elements), or quantized in blocks of 32 (q8_0, q4_0, q4_1, q5_0, q5_1; strides in
// bytes) through `stage` (n_head_kv*head_dim + v_rows floats) and `tickets` (n_head_kv +
// v_rows/32 int32 counters, all 0 before the first launch; every launch leaves them 0). A code
// not in the table writes nothing to the caches and NaN to every q value (never a silent no-op;
// the launcher refuses such a code before launching).
// Work unit: a pair of rows of one weight, both computed by one thread row (NW = 2 in
// mt_matvec_rows, so the pair's rope finishes in registers): q/k NORMAL rows (2i, 2i+1) of a
// head, NEOX rows (i, i + n_dims/2) for i < n_dims/2 and (n_dims + 2m, n_dims + 2m + 1) for
// the unrotated rest; v rows (2i, 2i+1). Pairs are numbered q's, then k's, then v's.
// head_dim, n_dims (<= head_dim) and v_rows even (multiples of 32 for a quantized cache).
// Launch: block (bx, by) as matvec, grid (ceil((n_head*head_dim + n_head_kv*head_dim + v_rows)
// / 2 / by)).
template <typename WQK, typename WV>
__device__ __forceinline__ void mt_qkv_rope_kv(
    const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv, const float* x,
    int ne0, const float* norm_w, float eps, int norm, float* q, int q_head_stride,
    mt_u8* k_cache, mt_u8* v_cache, int cache_type, const int* kv_row, int k_row_stride,
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
    const bool quant = mt_qkv_quant_cache(cache_type);  // kernel arguments: uniform in the grid
    int last_group = -1;  // the group whose last ticket this thread drew
    if (holder) {
        float a = acc[0][0] * s, b = acc[1][0] * s;
        if (rot) mt_rope_pair(a, b, (float)pos[0], i, n_dims, freq_factors, freq_base, freq_scale, attn_factor);
        if (!mt_qkv_known_cache(cache_type)) {  // no cache written: q says so
            a = __int_as_float(0x7fc00000);
            b = a;
        }
        if (j == 0) {
            float* qh = q + (mt_i64)h * q_head_stride;
            qh[ia] = a;
            qh[ib] = b;
        } else if (!quant) {
            const mt_i64 row = kv_row[0];
            mt_u8* dst = j == 1 ? k_cache + row * k_row_stride * mt_qkv_elem_bytes(cache_type)
                                : v_cache + row * v_row_stride * mt_qkv_elem_bytes(cache_type);
            mt_qkv_store_float(dst, cache_type, ra, a);
            mt_qkv_store_float(dst, cache_type, rb, b);
        } else {
            float* st = stage + (j == 1 ? 0 : n_head_kv * head_dim);
            st[ra] = a;
            st[rb] = b;
            __threadfence();  // the values are visible device-wide before the ticket
            const int group = j == 1 ? h : n_head_kv + p / (MT_QKV_QK / 2);
            const int size = j == 1 ? half : MT_QKV_QK / 2;
            if (atomicAdd(tickets + group, 1) == size - 1) last_group = group;
        }
    }
    if (!quant || threadIdx.x >= 32) return;  // the quantizing warp: the row's first (lane 0 holds)
    const int lane = threadIdx.x;
    const int group = mt_warp_max_i(last_group);  // lane 0's (the others hold -1)
    if (group < 0) return;
    mt_qkv_quantize_group(cache_type, group, stage, k_cache, v_cache, (mt_i64)kv_row[0], k_row_stride, v_row_stride,
                          n_head_kv, head_dim, lane);
    if (lane == 0) atomicExch(tickets + group, 0);
}

#define MT_QKV_ROPE_KV_ENTRY_PAIR(name, WQK, WV)                                                  \
    extern "C" __global__ void __launch_bounds__(256) qkv_rope_kv_##name(                          \
        const mt_u8* wq, const mt_u8* wk, const mt_u8* wv, int rbq, int rbk, int rbv,             \
        const float* x, int ne0, const float* norm_w, float eps, int norm, float* q,             \
        int q_head_stride, mt_u8* k_cache, mt_u8* v_cache, int cache_type, const int* kv_row,    \
        int k_row_stride, int v_row_stride, int n_head, int n_head_kv, int v_rows, int head_dim, \
        int n_dims, int neox, const int* pos, const float* freq_factors, float freq_base,        \
        float freq_scale, float attn_factor, float* stage, int* tickets) {                       \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                               \
        mt_qkv_rope_kv<WQK, WV>(wq, wk, wv, rbq, rbk, rbv, x, ne0, norm_w, eps, norm, q,         \
                                q_head_stride, k_cache, v_cache, cache_type, kv_row, k_row_stride, \
                                v_row_stride, n_head, n_head_kv, v_rows, head_dim, n_dims, neox,   \
                                pos, freq_factors, freq_base, freq_scale, attn_factor, stage,      \
                                tickets);                                                        \
    }
#define MT_QKV_ROPE_KV_ENTRY(name, W) MT_QKV_ROPE_KV_ENTRY_PAIR(name, W, W)
#define MT_QKV_ROPE_KV_PAIR_ENTRY(qk, WQK, v, WV) MT_QKV_ROPE_KV_ENTRY_PAIR(qk##_##v, WQK, WV)

// q/k and v weights of one type: qkv_rope_kv_<type>
MT_FOR_ALL_WTYPES(MT_QKV_ROPE_KV_ENTRY)

// (q/k type, v type) pairs llama.cpp's quantizer writes: qkv_rope_kv_<qk>_<v>. Read in
// src/llama-quant.cpp: llama_tensor_get_type_impl's attn_v rules per ftype (attn_q / attn_k keep
// the ftype's type for these ftypes), and tensor_type_fallback for a row (n_embd, the same for q, k
// and v) not a multiple of 256: Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0.
// One line a pair, with the ftypes that write it (kernels/qkv_rope.py reads this table); a pair not
// here is refused by the finder (its layers run matvec_multi, rope and set_rows).
#define MT_QKV_MIXED_PAIRS(M) \
    M(q4_k, WQ4_K, q6_k, WQ6_K) /* Q4_K_M: attn_v of the use_more_bits layers */ \
    M(q5_k, WQ5_K, q6_k, WQ6_K) /* Q5_K_M: attn_v of the use_more_bits layers */ \
    M(q4_k, WQ4_K, q5_k, WQ5_K) /* Q4_K_S: attn_v of the first 4 layers; a 70B's Q4_K_M / Q4_K_S others */ \
    M(q3_k, WQ3_K, q5_k, WQ5_K) /* Q3_K_M: attn_v of the first 2 layers (a 70B's: all); Q3_K_L: all */ \
    M(q3_k, WQ3_K, q4_k, WQ4_K) /* Q3_K_M: attn_v of the other layers */ \
    M(q2_k, WQ2_K, q4_k, WQ4_K) /* Q2_K, Q2_K_S with n_gqa >= 4 */ \
    M(q2_k, WQ2_K, q3_k, WQ3_K) /* Q2_K with n_gqa < 4 */ \
    M(q2_k, WQ2_K, q5_k, WQ5_K) /* Q2_K, Q2_K_S of a 70B (its Q3_K / Q4_K attn_v -> Q5_K) */ \
    M(q5_0, WQ5_0, q8_0, WQ8_0) /* fallback of (q4_k, q6_k): Q4_K_M */ \
    M(q5_1, WQ5_1, q8_0, WQ8_0) /* fallback of (q5_k, q6_k): Q5_K_M */ \
    M(q5_0, WQ5_0, q5_1, WQ5_1) /* fallback of (q4_k, q5_k): Q4_K_S */ \
    M(q4_0, WQ4_0, q5_1, WQ5_1) /* fallback of (q3_k, q5_k), (q2_k, q5_k): Q3_K_M, Q3_K_L, a 70B's Q2_K */ \
    M(q4_0, WQ4_0, q5_0, WQ5_0) /* fallback of (q3_k, q4_k), (q2_k, q4_k): Q3_K_M, Q2_K, Q2_K_S */

MT_QKV_MIXED_PAIRS(MT_QKV_ROPE_KV_PAIR_ENTRY)
