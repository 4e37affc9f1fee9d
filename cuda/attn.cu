// metatp: flash attention (decode split-KV + merge, and causal prefill tiled over queries).
//
// Q:    f32 [D, n_head, n_tokens], element (d, h, t) at q + h*q_s1 + t*q_s2.
// K, V: cache [D, n_head_kv, n_kv] (f16 / bf16 / f32, or quantized q8_0 / q4_0 / q4_1 / q5_0 /
//       q5_1), element (d, h, j) is element d of the head row at k + h*k_s1 + j*k_s2.
//       Quantized rows are whole 32-element blocks, dequantized in registers as they are read.
// mask: optional f32 [n_kv, n_tokens] additive mask (0 / -inf), element (j, t) at mask + t*mask_s1 + j.
// kv_len: optional int32 read from device memory: keys j >= *kv_len are skipped (they must
// be masked for every query anyway). It lets one launch (one captured CUDA graph) serve every
// KV length up to n_kv: the host updates *kv_len before each replay, no argument changes.
// out:  f32 [D, n_head, n_tokens] contiguous.
// Query head h reads KV head h / G, G = n_head / n_head_kv (ggml's broadcast rule).
// Score s = scale * (q . k); with softcap > 0, s = softcap * tanh(s / softcap); then + mask.
// causal != 0: key j is visible to query token t only when j <= t + causal_offset
// (causal_offset = n_kv - n_tokens when the queries are the last n_tokens positions).
// A query with no visible key gets 0 (not NaN).
// Strides are in elements of the storage (bytes for a quantized cache). All scalars are
// int32 / float32.
#include "kvcache.cuh"

extern __shared__ float mt_attn_smem[];

__device__ __forceinline__ float mt_attn_score(float dot, float scale, float softcap) {
    float s = dot * scale;
    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
    return s;
}

// ------------------------------------------------------------------ split-KV merge
// Rows g < ng (consecutive rows of the decode output) from the n_split partials of a decode launch:
// row g's acc at pa[g * n_split * D + s * D + d], its m and l at ml[g * n_split * 2 + 2 * s] and
// [.. + 1]; out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s (0 when the sum
// is 0), every sum in split-index order; threads d0, d0 + dstep, .. < D. The rows' sums run side by
// side (independent loads in flight together), each in the same order as alone. P is const float*
// (attn_merge_f32, NG = 1) or const volatile float* (the last block of a decode launch reading the
// other blocks' partials past its L1). Both use this code, so both give the same bits.
template <int NG, typename P>
__device__ __forceinline__ void mt_attn_merge_rows(P pa, P ml, float* __restrict__ o_rows, int ng, int D,
                                                   int n_split, int d0, int dstep) {
    const mt_i64 pa_row = (mt_i64)n_split * D, ml_row = (mt_i64)n_split * 2;
    float M[NG], inv[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) M[g] = MT_NEG_BIG;
    for (int s = 0; s < n_split; ++s) {
#pragma unroll
        for (int g = 0; g < NG; ++g)
            if (g < ng) M[g] = fmaxf(M[g], ml[g * ml_row + 2 * s]);
    }
    float L[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) L[g] = 0.0f;
    for (int s = 0; s < n_split; ++s) {
#pragma unroll
        for (int g = 0; g < NG; ++g)
            if (g < ng) L[g] += expf(ml[g * ml_row + 2 * s] - M[g]) * ml[g * ml_row + 2 * s + 1];
    }
#pragma unroll
    for (int g = 0; g < NG; ++g) inv[g] = L[g] > 0.0f ? 1.0f / L[g] : 0.0f;
    for (int d = d0; d < D; d += dstep) {
        float o[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) o[g] = 0.0f;
        for (int s = 0; s < n_split; ++s) {
#pragma unroll
            for (int g = 0; g < NG; ++g)
                if (g < ng) o[g] += expf(ml[g * ml_row + 2 * s] - M[g]) * pa[g * pa_row + (mt_i64)s * D + d];
        }
#pragma unroll
        for (int g = 0; g < NG; ++g)
            if (g < ng) o_rows[(mt_i64)g * D + d] = o[g] * inv[g];
    }
}

// The end of a split decode block that merges inside its launch: its partials are in `part`;
// it takes a ticket on the counter of its (token, head group), ticket[blockIdx.z * gridDim.y +
// blockIdx.y]; the block drawing the last one (n_split - 1) merges the group's rows and puts
// the counter back to 0 for the next launch (or CUDA-graph replay). No block waits for another,
// so block order does not matter. Rows row0 .. row0 + ng - 1 (token-major, D floats each).
template <int NG>
__device__ __forceinline__ void mt_attn_merge_if_last(const float* part, float* __restrict__ out, int* ticket,
                                                      int D, int n_head, int n_tokens, int n_split, mt_i64 row0,
                                                      int ng) {
    __shared__ int last_s;
    __threadfence();  // this block's partials are visible device-wide before its ticket
    __syncthreads();
    const int slot = blockIdx.z * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) last_s = atomicAdd(ticket + slot, 1) == n_split - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();  // ... and the other blocks' partials are read after theirs
    const volatile float* pv = part + row0 * n_split * D;
    const volatile float* mlv = part + (mt_i64)n_tokens * n_head * n_split * D + row0 * n_split * 2;
    mt_attn_merge_rows<NG>(pv, mlv, out + row0 * D, ng, D, n_split, (int)threadIdx.x, (int)blockDim.x);
    if (threadIdx.x == 0) atomicExch(ticket + slot, 0);
}

// ------------------------------------------------------------------ decode
// grid (n_split, n_head_kv * n_qgroup, n_tokens), block (nth): nth = max(64, D rounded up
// to 32) threads, nth >= D, D <= 256. One block: NG query heads of one KV head, one token,
// keys [split*chunk, split*chunk + chunk). Keys go in tiles of nth, one key per thread
// for q.k (K row read with 16-byte loads), an online softmax per head by one warp,
// then P.V with one output dim per thread.
// dynamic smem floats: NG*D (q) + NG*nth (scores) + 3*NG (m, l, alpha) (+ nth ints of cell ids
// with a cell list).
// cells / cell_off (or null): token t attends to the cache rows cells[cell_off[t] + i],
// i < cell_off[t + 1] - cell_off[t] (its own sequence's cells: no causal limit, n_kv and kv_len
// unused; a mask is read at the listed cells); the splits cut the token's list.
template <typename KT, typename VT, int NG>
__device__ __forceinline__ void attn_decode_impl(
    const float* __restrict__ q, const typename KT::T* __restrict__ k,
    const typename VT::T* __restrict__ v, const float* __restrict__ mask,
    const int* __restrict__ kv_len, float* __restrict__ out, float* __restrict__ part, int* ticket, int D,
    int n_head, int n_head_kv, int n_tokens, int n_kv, int q_s1, int q_s2, int k_s1, int k_s2,
    int v_s1, int v_s2, int mask_s1, int chunk, float scale, float softcap, int causal,
    int causal_offset, const int* __restrict__ cells = 0, const int* __restrict__ cell_off = 0) {
    const int nth = blockDim.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = nth >> 5;
    const int G = n_head / n_head_kv;
    const int n_qgroup = (G + NG - 1) / NG;
    const int kvh = blockIdx.y / n_qgroup;
    const int h0 = kvh * G + (blockIdx.y - kvh * n_qgroup) * NG;  // first query head
    const int ng = min(NG, kvh * G + G - h0);                      // heads in this block
    const int tok = blockIdx.z;
    const int split = blockIdx.x, n_split = gridDim.x;

    float* q_s = mt_attn_smem;       // [NG][D]
    float* s_s = q_s + NG * D;       // [NG][nth]
    float* m_s = s_s + NG * nth;     // [NG]
    float* l_s = m_s + NG;           // [NG]
    float* a_s = l_s + NG;           // [NG]
    int* c_s = (int*)(a_s + NG);     // [nth] the tile's cache rows (with a cell list)

    for (int e = tid; e < NG * D; e += nth) {
        const int g = e / D, d = e - g * D;
        q_s[e] = g < ng ? q[(mt_i64)tok * q_s2 + (mt_i64)(h0 + g) * q_s1 + d] : 0.0f;
    }
    if (tid < NG) {
        m_s[tid] = MT_NEG_BIG;
        l_s[tid] = 0.0f;
    }
    float acc[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) acc[g] = 0.0f;

    const int* tcells = 0;  // this token's cell list
    if (cells != 0) {
        tcells = cells + cell_off[tok];
        n_kv = cell_off[tok + 1] - cell_off[tok];
    } else if (kv_len != 0) {
        n_kv = max(0, min(n_kv, *kv_len));
    }
    const int start = split * chunk;
    int end = min(n_kv, start + chunk);
    if (causal) end = min(end, tok + causal_offset + 1);

    const typename KT::T* kh = k + (mt_i64)kvh * k_s1;
    const typename VT::T* vh = v + (mt_i64)kvh * v_s1;
    const int vw = (int)(16 / sizeof(typename KT::T));  // elements per 16 bytes (float types)
    const bool kvec = ((((mt_u64)kh) & 15u) == 0) && (k_s2 % vw == 0) && (D % 8 == 0);
    const int D8 = D & ~7;
    __syncthreads();

    for (int t0 = start; t0 < end; t0 += nth) {
        // ---- scores, one key per thread
        const int j = t0 + tid;
        if (tcells != 0) c_s[tid] = j < end ? tcells[j] : 0;
        if (j < end) {
            float dot[NG];
#pragma unroll
            for (int g = 0; g < NG; ++g) dot[g] = 0.0f;
            const typename KT::T* kr = kh + (mt_i64)(tcells != 0 ? c_s[tid] : j) * k_s2;
            for (int d = 0; d < D8; d += 8) {
                float kf[8];
                KT::get8(kr, d, kvec, kf);
#pragma unroll
                for (int g = 0; g < NG; ++g) {
                    if (g < ng) {
                        const float* qg = q_s + g * D + d;
#pragma unroll
                        for (int i = 0; i < 8; ++i) dot[g] = fmaf(qg[i], kf[i], dot[g]);
                    }
                }
            }
            for (int d = D8; d < D; ++d) {
                const float kf = KT::get(kr, d);
#pragma unroll
                for (int g = 0; g < NG; ++g)
                    if (g < ng) dot[g] = fmaf(q_s[g * D + d], kf, dot[g]);
            }
            const float mv = mask ? mask[(mt_i64)tok * mask_s1 + (tcells != 0 ? c_s[tid] : j)] : 0.0f;
#pragma unroll
            for (int g = 0; g < NG; ++g)
                if (g < ng) s_s[g * nth + tid] = mt_attn_score(dot[g], scale, softcap) + mv;
        } else {
#pragma unroll
            for (int g = 0; g < NG; ++g)
                if (g < ng) s_s[g * nth + tid] = -MT_INF;
        }
        __syncthreads();

        // ---- online softmax, one warp per head
        for (int g = warp; g < ng; g += nwarps) {
            float* sg = s_s + g * nth;
            float mx = -MT_INF;
            for (int i = lane; i < nth; i += 32) mx = fmaxf(mx, sg[i]);
            mx = mt_warp_max(mx);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int i = lane; i < nth; i += 32) {
                const float p = expf(sg[i] - m_new);
                sg[i] = p;
                sum += p;
            }
            sum = mt_warp_sum(sum);
            if (lane == 0) {
                const float alpha = expf(m_old - m_new);
                m_s[g] = m_new;
                l_s[g] = l_s[g] * alpha + sum;
                a_s[g] = alpha;
            }
        }
        __syncthreads();

        // ---- P.V, one output dim per thread
        if (tid < D) {
#pragma unroll
            for (int g = 0; g < NG; ++g)
                if (g < ng) acc[g] *= a_s[g];
            const int nk = min(nth, end - t0);
            const typename VT::T* vr = vh + (mt_i64)t0 * v_s2;
            for (int i = 0; i < nk; ++i) {
                const float vv = VT::get(tcells != 0 ? vh + (mt_i64)c_s[i] * v_s2 : vr + (mt_i64)i * v_s2, tid);
#pragma unroll
                for (int g = 0; g < NG; ++g)
                    if (g < ng) acc[g] = fmaf(s_s[g * nth + i], vv, acc[g]);
            }
        }
        __syncthreads();
    }

    const mt_i64 row0 = (mt_i64)tok * n_head + h0;
    if (tid < D) {
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            if (g < ng) {
                const mt_i64 row = row0 + g;
                if (n_split == 1) {
                    const float l = l_s[g];
                    out[row * D + tid] = l > 0.0f ? acc[g] / l : 0.0f;
                } else {
                    part[(row * n_split + split) * D + tid] = acc[g];
                    if (tid == 0) {
                        float* ml = part + (mt_i64)n_tokens * n_head * n_split * D;
                        ml[(row * n_split + split) * 2 + 0] = m_s[g];
                        ml[(row * n_split + split) * 2 + 1] = l_s[g];
                    }
                }
            }
        }
    }
    if (n_split > 1 && ticket != 0)
        mt_attn_merge_if_last<NG>(part, out, ticket, D, n_head, n_tokens, n_split, row0, ng);
}

// attn_decode_<kv>_g<NG>(const float *q, const KV *k, const KV *v, const float *mask /* or null */,
//     const int32 *kv_len /* or null */, float *out, float *part, int32 *ticket /* or null */,
//     int32 D, int32 n_head,
//     int32 n_head_kv, int32 n_tokens, int32 n_kv, int32 q_s1, int32 q_s2, int32 k_s1,
//     int32 k_s2, int32 v_s1, int32 v_s2, int32 mask_s1, int32 chunk, float32 scale,
//     float32 softcap, int32 causal, int32 causal_offset)
// kv in {f16, bf16, f32, q8_0, q4_0, q4_1, q5_0, q5_1} (f16/bf16 as uint16, quantized as
// uint8 blocks with strides in bytes and D % 32 == 0), K and V of that one type;
// NG in {1, 2, 4, 8} query heads per block.
// grid (n_split, n_head_kv * ceil(G/NG), n_tokens), block (nth) with nth % 32 == 0,
// nth >= max(D, 64), D <= 256; dynamic smem 4*(NG*D + NG*nth + 3*NG) bytes;
// chunk = keys per split (n_split * chunk >= n_kv). With n_split == 1 the result goes
// straight to out; otherwise partials go to part (floats: n_tokens*n_head*n_split*(D+2))
// and, with ticket null, attn_merge_f32 finishes; with ticket (int32 counters, one per
// (token, head group): n_tokens * gridDim.y, all 0 before the first launch) the last block of
// each group merges in split-index order (the same bits as attn_merge_f32) and puts its
// counter back to 0.
#define MT_DECODE_ENTRY(kvname, KV, NG)                                                       \
    extern "C" __global__ void __launch_bounds__(256) attn_decode_##kvname##_g##NG(          \
        const float* q, const KV::T* k, const KV::T* v, const float* mask, const int* kv_len, \
        float* out, float* part, int* ticket, int D, int n_head, int n_head_kv, int n_tokens,  \
        int n_kv, int q_s1, int q_s2, int k_s1, int k_s2, int v_s1, int v_s2, int mask_s1,     \
        int chunk, float scale, float softcap, int causal, int causal_offset) {               \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        attn_decode_impl<KV, KV, NG>(q, k, v, mask, kv_len, out, part, ticket, D, n_head, n_head_kv, \
                                 n_tokens, n_kv, q_s1, q_s2, k_s1, k_s2, v_s1, v_s2,         \
                                 mask_s1, chunk, scale, softcap, causal, causal_offset);     \
    }
#define MT_DECODE_ENTRIES(kvname, KV) \
    MT_DECODE_ENTRY(kvname, KV, 1)    \
    MT_DECODE_ENTRY(kvname, KV, 2)    \
    MT_DECODE_ENTRY(kvname, KV, 4)    \
    MT_DECODE_ENTRY(kvname, KV, 8)

MT_DECODE_ENTRIES(f16, KvF16)
MT_DECODE_ENTRIES(bf16, KvBF16)
MT_DECODE_ENTRIES(f32, KvF32)
MT_DECODE_ENTRIES(q8_0, KvQ8_0)
MT_DECODE_ENTRIES(q4_0, KvQ4_0)
MT_DECODE_ENTRIES(q4_1, KvQ4_1)
MT_DECODE_ENTRIES(q5_0, KvQ5_0)
MT_DECODE_ENTRIES(q5_1, KvQ5_1)

// attn_decode_cells_<kv>_g<NG>(const float *q, const KV *k, const KV *v, const int32 *cells,
//     const int32 *cell_off, const float *mask /* or null */, float *out, float *part,
//     int32 *ticket /* or null */, int32 D,
//     int32 n_head, int32 n_head_kv, int32 n_tokens, int32 q_s1, int32 q_s2, int32 k_s1,
//     int32 k_s2, int32 v_s1, int32 v_s2, int32 mask_s1, int32 chunk, float32 scale,
//     float32 softcap)
// Decode of many sequences, each token reading only its own cells: token t attends to the cache
// rows cells[cell_off[t] .. cell_off[t + 1]) (any rows, any order; an empty list gives 0).
// mask (optional): the dense additive mask the lists came from; a listed cell c of token t adds
// mask[t * mask_s1 + c] to its score (0 for the engine's masks: kept so any finite bias is exact).
// Launch as attn_decode_* with n_split * chunk >= the longest list, dynamic smem
// 4*(NG*D + NG*nth + 3*NG + nth) bytes.
#define MT_DECODE_CELLS_ENTRY(kvname, KV, NG)                                                     \
    extern "C" __global__ void __launch_bounds__(256) attn_decode_cells_##kvname##_g##NG(        \
        const float* q, const KV::T* k, const KV::T* v, const int* cells, const int* cell_off,    \
        const float* mask, float* out, float* part, int* ticket, int D, int n_head, int n_head_kv,  \
        int n_tokens, int q_s1, int q_s2, int k_s1, int k_s2, int v_s1, int v_s2, int mask_s1,     \
        int chunk, float scale, float softcap) {                                                   \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                                 \
        attn_decode_impl<KV, KV, NG>(q, k, v, mask, 0, out, part, ticket, D, n_head, n_head_kv, n_tokens, \
                                     0, q_s1, q_s2, k_s1, k_s2, v_s1, v_s2, mask_s1, chunk, scale, \
                                     softcap, 0, 0, cells, cell_off);                             \
    }
#define MT_DECODE_CELLS_ENTRIES(kvname, KV) \
    MT_DECODE_CELLS_ENTRY(kvname, KV, 1)    \
    MT_DECODE_CELLS_ENTRY(kvname, KV, 2)    \
    MT_DECODE_CELLS_ENTRY(kvname, KV, 4)    \
    MT_DECODE_CELLS_ENTRY(kvname, KV, 8)

MT_DECODE_CELLS_ENTRIES(f16, KvF16)
MT_DECODE_CELLS_ENTRIES(bf16, KvBF16)
MT_DECODE_CELLS_ENTRIES(f32, KvF32)
MT_DECODE_CELLS_ENTRIES(q8_0, KvQ8_0)
MT_DECODE_CELLS_ENTRIES(q4_0, KvQ4_0)
MT_DECODE_CELLS_ENTRIES(q4_1, KvQ4_1)
MT_DECODE_CELLS_ENTRIES(q5_0, KvQ5_0)
MT_DECODE_CELLS_ENTRIES(q5_1, KvQ5_1)

// attn_merge_f32(const float *part, float *out, int32 D, int32 n_head, int32 n_tokens,
//                int32 n_split)
// Combines the n_split partials (acc, m, l) of attn_decode_* with log-sum-exp weights:
// out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s (0 when the sum is 0).
// grid (n_head, n_tokens), block (bx), bx % 32 == 0 (any size; threads loop over D).
extern "C" __global__ void attn_merge_f32(const float* part, float* out, int D, int n_head,
                                          int n_tokens, int n_split) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    const mt_i64 row = (mt_i64)blockIdx.y * n_head + blockIdx.x;
    const float* ml = part + (mt_i64)n_tokens * n_head * n_split * D + row * n_split * 2;
    mt_attn_merge_rows<1>(part + row * n_split * D, ml, out + row * D, 1, D, n_split, (int)threadIdx.x,
                          (int)blockDim.x);
}

// ------------------------------------------------------------------ prefill
// grid (ceil(n_tokens*G / 16), n_head_kv), block (128). A block owns 16 "rows"
// (query token, head-in-group) pairs r = t*G + g of one KV head, so K/V tiles of 32 keys
// are read once per 16 rows. Scores: a warp per 4 rows x 32 keys (lane = key);
// online softmax per row by one warp; P.V with dims tid and tid+128 per thread. With a mask,
// a key tile no query of the block sees is skipped (no K/V read, no scores).
// dynamic smem floats: 16*D (q) + 32*(D+1) (K or V tile, padded) + 16*32 (P) + 3*16.
#define MT_PF_NR 16
#define MT_PF_BK 32
#define MT_PF_NTH 128
template <typename KT, typename VT>
__device__ __forceinline__ void attn_prefill_impl(
    const float* __restrict__ q, const typename KT::T* __restrict__ k,
    const typename VT::T* __restrict__ v, const float* __restrict__ mask,
    const int* __restrict__ kv_len, float* __restrict__ out, int D, int n_head, int n_head_kv,
    int n_tokens, int n_kv, int q_s1, int q_s2, int k_s1, int k_s2, int v_s1, int v_s2,
    int mask_s1, float scale, float softcap, int causal, int causal_offset) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = n_head / n_head_kv;
    const int kvh = blockIdx.y;
    const int r0 = blockIdx.x * MT_PF_NR;
    const int n_rows = n_tokens * G;
    const int Dp = D + 1;

    float* q_s = mt_attn_smem;                 // [NR][D]
    float* kv_s = q_s + MT_PF_NR * D;          // [BK][D+1]
    float* p_s = kv_s + MT_PF_BK * Dp;         // [NR][BK]
    float* m_s = p_s + MT_PF_NR * MT_PF_BK;    // [NR]
    float* l_s = m_s + MT_PF_NR;               // [NR]
    float* a_s = l_s + MT_PF_NR;               // [NR]

    for (int e = tid; e < MT_PF_NR * D; e += MT_PF_NTH) {
        const int r = e / D, d = e - r * D;
        const int rg = r0 + r;
        float val = 0.0f;
        if (rg < n_rows) {
            const int t = rg / G, g = rg - t * G;
            val = q[(mt_i64)t * q_s2 + (mt_i64)(kvh * G + g) * q_s1 + d];
        }
        q_s[e] = val;
    }
    if (tid < MT_PF_NR) {
        m_s[tid] = MT_NEG_BIG;
        l_s[tid] = 0.0f;
    }
    float acc[MT_PF_NR][2];
#pragma unroll
    for (int r = 0; r < MT_PF_NR; ++r) acc[r][0] = acc[r][1] = 0.0f;

    if (kv_len != 0) n_kv = max(0, min(n_kv, *kv_len));
    int kv_end = n_kv;
    if (causal) {
        const int last_tok = min(n_rows - 1, r0 + MT_PF_NR - 1) / G;
        kv_end = min(kv_end, last_tok + causal_offset + 1);
    }
    const typename KT::T* kh = k + (mt_i64)kvh * k_s1;
    const typename VT::T* vh = v + (mt_i64)kvh * v_s1;
    // the tile's query tokens (rows r0.. are (token, head-in-group) pairs)
    const int t_first = r0 / G, t_last = min(n_rows - 1, r0 + MT_PF_NR - 1) / G;
    __shared__ int visible_s;
    __syncthreads();

    for (int kb = 0; kb < kv_end; kb += MT_PF_BK) {
        // ---- with a mask: skip a key tile no query of this tile sees (the causal upper
        // triangle given as a mask, other sequences' cells in a step of several). Exact: a
        // masked key adds exp(-inf) = 0 and leaves the running maximum alone.
        if (mask) {
            if (tid == 0) visible_s = 0;
            __syncthreads();
            const int n_t = t_last - t_first + 1;
            for (int e = tid; e < n_t * MT_PF_BK; e += MT_PF_NTH) {
                const int t = t_first + e / MT_PF_BK, j = kb + (e & (MT_PF_BK - 1));
                if (j < kv_end && (!causal || j <= t + causal_offset) &&
                    mask[(mt_i64)t * mask_s1 + j] != -MT_INF)
                    visible_s = 1;
            }
            __syncthreads();
            const int visible = visible_s;
            __syncthreads();  // everyone has read the flag before thread 0 clears it again
            if (!visible) continue;
        }
        // ---- K tile -> smem (f32, rows padded to D+1 against bank conflicts)
        for (int e = tid; e < MT_PF_BK * D; e += MT_PF_NTH) {
            const int kk = e / D, d = e - kk * D;
            const int j = kb + kk;
            kv_s[kk * Dp + d] = j < kv_end ? KT::get(kh + (mt_i64)j * k_s2, d) : 0.0f;
        }
        __syncthreads();

        // ---- scores: warp w does rows w, w+4, w+8, w+12; lane = key
        {
            const int j = kb + lane;
            const float* kr = kv_s + lane * Dp;
            for (int r = warp; r < MT_PF_NR; r += MT_PF_NTH / 32) {
                const int rg = r0 + r;
                float s = -MT_INF;
                if (rg < n_rows && j < kv_end) {
                    const int t = rg / G;
                    if (!causal || j <= t + causal_offset) {
                        const float* qr = q_s + r * D;
                        float dot = 0.0f;
                        for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
                        s = mt_attn_score(dot, scale, softcap);
                        if (mask) s += mask[(mt_i64)t * mask_s1 + j];
                    }
                }
                // online softmax for row r over this tile (the warp holds all 32 keys)
                const float mx = mt_warp_max(s);
                const float m_old = m_s[r];
                const float m_new = fmaxf(m_old, mx);
                const float p = expf(s - m_new);
                const float sum = mt_warp_sum(p);
                p_s[r * MT_PF_BK + lane] = p;
                if (lane == 0) {
                    const float alpha = expf(m_old - m_new);
                    m_s[r] = m_new;
                    l_s[r] = l_s[r] * alpha + sum;
                    a_s[r] = alpha;
                }
            }
        }
        __syncthreads();

        // ---- V tile -> smem (K tile no longer needed)
        for (int e = tid; e < MT_PF_BK * D; e += MT_PF_NTH) {
            const int kk = e / D, d = e - kk * D;
            const int j = kb + kk;
            kv_s[kk * Dp + d] = j < kv_end ? VT::get(vh + (mt_i64)j * v_s2, d) : 0.0f;
        }
        __syncthreads();

        // ---- P.V
#pragma unroll
        for (int r = 0; r < MT_PF_NR; ++r) {
            const float a = a_s[r];
            acc[r][0] *= a;
            acc[r][1] *= a;
        }
        const int d0 = tid, d1 = tid + MT_PF_NTH;
        for (int kk = 0; kk < MT_PF_BK; ++kk) {
            const float v0 = d0 < D ? kv_s[kk * Dp + d0] : 0.0f;
            const float v1 = d1 < D ? kv_s[kk * Dp + d1] : 0.0f;
#pragma unroll
            for (int r = 0; r < MT_PF_NR; ++r) {
                const float p = p_s[r * MT_PF_BK + kk];
                acc[r][0] = fmaf(p, v0, acc[r][0]);
                acc[r][1] = fmaf(p, v1, acc[r][1]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < MT_PF_NR; ++r) {
        const int rg = r0 + r;
        if (rg < n_rows) {
            const int t = rg / G, g = rg - t * G;
            const float l = l_s[r];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* o = out + ((mt_i64)t * n_head + kvh * G + g) * D;
            if (tid < D) o[tid] = acc[r][0] * inv;
            if (tid + MT_PF_NTH < D) o[tid + MT_PF_NTH] = acc[r][1] * inv;
        }
    }
}

// attn_prefill_<kv>(const float *q, const KV *k, const KV *v, const float *mask /* or null */,
//     const int32 *kv_len /* or null */, float *out, int32 D, int32 n_head, int32 n_head_kv,
//     int32 n_tokens, int32 n_kv, int32 q_s1, int32 q_s2, int32 k_s1, int32 k_s2, int32 v_s1,
//     int32 v_s2, int32 mask_s1, float32 scale, float32 softcap, int32 causal,
//     int32 causal_offset)
// kv as for attn_decode_*. grid (ceil(n_tokens * G / 16), n_head_kv), block (128), D <= 256,
// dynamic smem 4*(16*D + 32*(D+1) + 16*32 + 48) bytes (> 48 KiB for D > 176: raise the
// kernel's max_dynamic_shared_size_bytes).
#define MT_PREFILL_ENTRY(kvname, KV)                                                          \
    extern "C" __global__ void __launch_bounds__(MT_PF_NTH) attn_prefill_##kvname(           \
        const float* q, const KV::T* k, const KV::T* v, const float* mask, const int* kv_len, \
        float* out, int D, int n_head, int n_head_kv, int n_tokens, int n_kv, int q_s1,        \
        int q_s2, int k_s1, int k_s2, int v_s1, int v_s2, int mask_s1, float scale,            \
        float softcap, int causal, int causal_offset) {                                       \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        attn_prefill_impl<KV, KV>(q, k, v, mask, kv_len, out, D, n_head, n_head_kv, n_tokens,     \
                              n_kv, q_s1, q_s2, k_s1, k_s2, v_s1, v_s2, mask_s1, scale,   \
                              softcap, causal, causal_offset);                                \
    }

MT_PREFILL_ENTRY(f16, KvF16)
MT_PREFILL_ENTRY(bf16, KvBF16)
MT_PREFILL_ENTRY(f32, KvF32)
MT_PREFILL_ENTRY(q8_0, KvQ8_0)
MT_PREFILL_ENTRY(q4_0, KvQ4_0)
MT_PREFILL_ENTRY(q4_1, KvQ4_1)
MT_PREFILL_ENTRY(q5_0, KvQ5_0)
MT_PREFILL_ENTRY(q5_1, KvQ5_1)

// ------------------------------------------------------------------ mask -> cell lists
// A step of several sequences gives FLASH_ATTN_EXT a dense mask (rows x span) that hides the
// other sequences' cells. These two kernels turn it into each row's cell list, in cell order,
// for attn_decode_cells_*: a key j of row r is listed when j < min(n_kv, *kv_len) and
// mask[r * mask_s1 + j] != -inf. Everything stays on the device (no host sync) and the buffers
// have fixed sizes (cells: n_rows * n_kv ints), so a captured CUDA graph replays them.

// The sum of v over the block (every thread gets it); nth % 32 == 0, nth <= 1024.
__device__ __forceinline__ int mt_attn_block_sum_i(int v, int* w_s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) w_s[warp] = v;
    __syncthreads();
    int s = 0;
    for (int w = 0; w < nwarps; ++w) s += w_s[w];
    __syncthreads();  // w_s may be reused by the caller
    return s;
}

__device__ __forceinline__ bool mt_attn_visible(const float* mrow, int j, int n) {
    return j < n && mrow[j] != -MT_INF;
}

// attn_mask_count(const float *mask, const int32 *kv_len /* or null */, int32 *counts,
//     int32 n_kv, int32 mask_s1)
// grid (n_rows), block (nth), nth % 32 == 0, nth <= 1024: counts[r] = row r's visible keys.
extern "C" __global__ void attn_mask_count(const float* mask, const int* kv_len, int* counts, int n_kv,
                                           int mask_s1) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ int w_s[32];
    const int row = blockIdx.x;
    const int n = kv_len != 0 ? max(0, min(n_kv, *kv_len)) : n_kv;
    const float* mrow = mask + (mt_i64)row * mask_s1;
    int c = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) c += mt_attn_visible(mrow, j, n) ? 1 : 0;
    c = mt_attn_block_sum_i(c, w_s);
    if (threadIdx.x == 0) counts[row] = c;
}

// attn_mask_cells(const float *mask, const int32 *kv_len /* or null */, const int32 *counts,
//     int32 *cells, int32 *cell_off, int32 n_kv, int32 mask_s1)
// After attn_mask_count (same grid): cell_off[r] = counts[0] + .. + counts[r - 1] (and
// cell_off[n_rows] the total), row r's visible keys in increasing order at cells[cell_off[r]..].
// grid (n_rows), block (nth), nth a power of two, 32 <= nth <= 1024.
extern "C" __global__ void attn_mask_cells(const float* mask, const int* kv_len, const int* counts, int* cells,
                                           int* cell_off, int n_kv, int mask_s1) {
    mt_pdl_wait(); mt_pdl_launch_dependents();
    __shared__ int w_s[32];
    __shared__ int s_s[1024];
    const int tid = threadIdx.x, nth = blockDim.x;
    const int row = blockIdx.x;
    const int n = kv_len != 0 ? max(0, min(n_kv, *kv_len)) : n_kv;
    const float* mrow = mask + (mt_i64)row * mask_s1;
    int before = 0;  // the rows before this one: where its list starts
    for (int i = tid; i < row; i += nth) before += counts[i];
    int o = mt_attn_block_sum_i(before, w_s);
    if (tid == 0) {
        cell_off[row] = o;
        if (row == gridDim.x - 1) cell_off[row + 1] = o + counts[row];
    }
    for (int t0 = 0; t0 < n; t0 += nth) {
        const int j = t0 + tid;
        const bool vis = mt_attn_visible(mrow, j, n);
        s_s[tid] = vis ? 1 : 0;
        __syncthreads();
        for (int d = 1; d < nth; d <<= 1) {  // inclusive scan of the tile's flags
            const int x = tid >= d ? s_s[tid - d] : 0;
            __syncthreads();
            s_s[tid] += x;
            __syncthreads();
        }
        if (vis) cells[o + s_s[tid] - 1] = j;
        o += s_s[nth - 1];
        __syncthreads();  // everyone has read s_s before the next tile writes it
    }
}
