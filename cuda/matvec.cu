// metatp: y = W x for few tokens (decode), reading ggml weights directly.
//
// Layout: W has n_rows rows (ggml ne[1] = out_features) of ne0 elements (ne[0] =
// in_features), row r at W + r*row_bytes; x is f32, token t at x + t*x_stride
// (ne0 elements); y is f32, token t at y + t*y_stride (n_rows elements).
// A per-device slice of a split weight is a pointer offset + the full row_bytes.
//
// One core (mt_matvec_rows) computes NW dot products (NW weights sharing x and the row
// index) for NT tokens; the entry points differ only in what they do with the sums:
//   matvec_<t>_t<NT>      y = W x (+ add)                         (plain, residual/bias add)
//   matvec_multi_<t>      y_j = W_j x, j < 3, one token            (q/k/v in one launch)
//   matvec_<act>_<t>      y = act(Wg x) * (Wu x), one token        (fused gate/up + GLU)
//   matvec_id_<t>         y[t, u] = W[ids[t, u]] x[t, u % n_b]     (MUL_MAT_ID, experts)
// matvec_multi and the GLU entries can RMS-normalise x first (x / rms(x) * nw, the
// RMS_NORM x weight that precedes them in a transformer layer): each block recomputes the
// norm of x (a few hundred floats) instead of a separate kernel writing and rereading it.
#include "quant.cuh"

// 1 / sqrt(mean(x^2) + eps) over x[0..ne0), reduced by the whole (2-D) block; every
// thread must call it. <= 256 threads.
__device__ __forceinline__ float mt_rms_scale(const float* __restrict__ x, int ne0, float eps) {
    __shared__ float part[8];
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nth = blockDim.x * blockDim.y;
    float s = 0.0f;
    for (int i = tid; i < ne0; i += nth) s = fmaf(x[i], x[i], s);
    s = mt_warp_sum(s);
    if ((tid & 31) == 0) part[tid >> 5] = s;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < (nth >> 5); ++w) t += part[w];
    __syncthreads();  // part is reused by the next call
    return 1.0f / sqrtf(t / (float)ne0 + eps);
}

// Block (bx, by): by rows per block, bx threads per row (bx a multiple of 32, bx*by <= 256).
// Each thread walks chunks (CW weights) of its row with stride bx; partial sums are
// reduced with warp shuffles, then across the row's warps through shared memory.
// Row = row_block * by + threadIdx.y. xw (or null) multiplies x element-wise on load.
// Returns true in the one thread per row that holds the finished sums in acc.
template <typename W, int NT, int NW>
__device__ __forceinline__ bool mt_matvec_rows(const mt_u8* const* w, const float* __restrict__ x,
                                               int ne0, int n_rows, int row_bytes, int n_tok,
                                               int x_stride, float (&acc)[NW][NT],
                                               int row_block, const float* __restrict__ xw) {
    const int row = row_block * blockDim.y + threadIdx.y;
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t] = 0.0f;

    if (row < n_rows) {
        const int units = (ne0 / W::QK) * W::NCHUNK;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            const int ib = u / W::NCHUNK;
            const int c = u - ib * W::NCHUNK;
            float v[NW][W::CW];
#pragma unroll
            for (int j = 0; j < NW; ++j)
                W::load(w[j] + (mt_i64)row * row_bytes + (mt_i64)ib * W::BYTES, c, v[j]);
            const float* xb = x + (mt_i64)ib * W::QK;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const float* xt = xb + (mt_i64)t * x_stride;
                    float xv[W::CW];
#pragma unroll
                    for (int k = 0; k < W::CW; ++k) xv[k] = __ldg(xt + W::idx(c, k));
                    if (xw != 0) {
                        const float* wb = xw + (mt_i64)ib * W::QK;
#pragma unroll
                        for (int k = 0; k < W::CW; ++k) xv[k] *= __ldg(wb + W::idx(c, k));
                    }
#pragma unroll
                    for (int j = 0; j < NW; ++j) {
                        float s = 0.0f;
#pragma unroll
                        for (int k = 0; k < W::CW; ++k) s = fmaf(v[j][k], xv[k], s);
                        acc[j][t] += s;
                    }
                }
            }
        }
    }

    return mt_rows_reduce<NW, NT>(acc, row, n_rows);
}

// matvec_<type>_t<NT>(const uint8 *w, const float *x, float *y, int32 ne0, int32 n_rows,
//                     int32 row_bytes, int32 n_tokens, int32 x_stride, int32 y_stride,
//                     const float *add /* or null */, int32 add_stride)
// y[t*y_stride + r] = sum_i W[r, i] x[t*x_stride + i]  (+ add[t*add_stride + r]).
// add_stride 0 broadcasts one row (a bias) over the tokens; y may alias add.
// NT in {1, 2, 4, 8} is the compile-time upper bound of n_tokens (use the smallest
// NT >= n_tokens). Launch: block (bx, by) with bx % 32 == 0 and bx*by <= 256,
// grid (ceil(n_rows / by)). ne0 must be a multiple of the type's block size.
template <typename W, int NT>
__device__ __forceinline__ void mt_matvec(const mt_u8* w, const float* x, float* y, int ne0,
                                          int n_rows, int row_bytes, int n_tok, int x_stride,
                                          int y_stride, const float* add, int add_stride) {
    const mt_u8* ws[1] = {w};
    float acc[1][NT];
    if (!mt_matvec_rows<W, NT, 1>(ws, x, ne0, n_rows, row_bytes, n_tok, x_stride, acc,
                                  blockIdx.x, 0))
        return;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            float r = acc[0][t];
            if (add != 0) r += add[(mt_i64)t * add_stride + row];
            y[(mt_i64)t * y_stride + row] = r;
        }
    }
}

#define MT_MATVEC_ENTRY_T(name, W, NT)                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                       \
        matvec_##name##_t##NT(const mt_u8* w, const float* x, float* y, int ne0,            \
                              int n_rows, int row_bytes, int n_tokens, int x_stride,        \
                              int y_stride, const float* add, int add_stride) {             \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                          \
        mt_matvec<W, NT>(w, x, y, ne0, n_rows, row_bytes, n_tokens, x_stride, y_stride, add, \
                         add_stride);                                                        \
    }
#define MT_MATVEC_ENTRY(name, W)      \
    MT_MATVEC_ENTRY_T(name, W, 1)     \
    MT_MATVEC_ENTRY_T(name, W, 2)     \
    MT_MATVEC_ENTRY_T(name, W, 4)     \
    MT_MATVEC_ENTRY_T(name, W, 8)

MT_FOR_ALL_WTYPES(MT_MATVEC_ENTRY)

// ------------------------------------------------------------------ several weights, one x
// matvec_multi_<type>(const uint8 *w0, const uint8 *w1, const uint8 *w2, float *y0, float *y1,
//     float *y2, int32 rows0, int32 rows1, int32 rows2, int32 rb0, int32 rb1, int32 rb2,
//     const float *x, int32 ne0, const float *norm_w /* or null */, float32 eps, int32 norm)
// One token: y_j = W_j (x') for j < 3 (unused jobs: rows_j = 0), W_j with rb_j bytes per row,
// all of one type and ne0. x' = x, or with norm != 0: x / sqrt(mean(x^2) + eps) * norm_w
// (norm_w null: no weight). Launch: block (bx, by) as matvec, grid (sum_j ceil(rows_j / by));
// the first ceil(rows0 / by) blocks do W0, the next W1, then W2.
template <typename W>
__device__ __forceinline__ void mt_matvec_multi(const mt_u8* w0, const mt_u8* w1, const mt_u8* w2,
                                                float* y0, float* y1, float* y2, int rows0,
                                                int rows1, int rows2, int rb0, int rb1, int rb2,
                                                const float* x, int ne0, const float* norm_w,
                                                float eps, int norm) {
    const float s = norm ? mt_rms_scale(x, ne0, eps) : 1.0f;
    const int by = blockDim.y;
    const int nb0 = (rows0 + by - 1) / by, nb1 = (rows1 + by - 1) / by;
    int b = blockIdx.x;
    const mt_u8* w = w0;
    float* y = y0;
    int rows = rows0, rb = rb0;
    if (b >= nb0 + nb1) {
        b -= nb0 + nb1;
        w = w2; y = y2; rows = rows2; rb = rb2;
    } else if (b >= nb0) {
        b -= nb0;
        w = w1; y = y1; rows = rows1; rb = rb1;
    }
    const mt_u8* ws[1] = {w};
    float acc[1][1];
    if (!mt_matvec_rows<W, 1, 1>(ws, x, ne0, rows, rb, 1, 0, acc, b, norm ? norm_w : 0)) return;
    y[b * by + threadIdx.y] = acc[0][0] * s;
}

#define MT_MATVEC_MULTI_ENTRY(name, W)                                                          \
    extern "C" __global__ void __launch_bounds__(256) matvec_multi_##name(                     \
        const mt_u8* w0, const mt_u8* w1, const mt_u8* w2, float* y0, float* y1, float* y2,     \
        int rows0, int rows1, int rows2, int rb0, int rb1, int rb2, const float* x, int ne0,    \
        const float* norm_w, float eps, int norm) {                                            \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        mt_matvec_multi<W>(w0, w1, w2, y0, y1, y2, rows0, rows1, rows2, rb0, rb1, rb2, x, ne0,  \
                           norm_w, eps, norm);                                                 \
    }

MT_FOR_ALL_WTYPES(MT_MATVEC_MULTI_ENTRY)

// ------------------------------------------------------------------ gate/up + GLU
// matvec_<swiglu|geglu>_<type>(const uint8 *wg, const uint8 *wu, const float *x, float *y,
//     int32 ne0, int32 n_rows, int32 row_bytes, const float *norm_w /* or null */, float32 eps,
//     int32 norm)
// One token: y[r] = act(Wg[r] . x') * (Wu[r] . x'), act = silu (swiglu) or gelu-tanh (geglu);
// x' as in matvec_multi. Both weights share type, shape and row_bytes. Launch as matvec.
struct GluSilu { static __device__ __forceinline__ float f(float v) { return mt_silu(v); } };
struct GluGelu { static __device__ __forceinline__ float f(float v) { return mt_gelu(v); } };

template <typename W, typename ACT>
__device__ __forceinline__ void mt_matvec_glu(const mt_u8* wg, const mt_u8* wu, const float* x,
                                              float* y, int ne0, int n_rows, int row_bytes,
                                              const float* norm_w, float eps, int norm) {
    const float s = norm ? mt_rms_scale(x, ne0, eps) : 1.0f;
    const mt_u8* ws[2] = {wg, wu};
    float acc[2][1];
    if (!mt_matvec_rows<W, 1, 2>(ws, x, ne0, n_rows, row_bytes, 1, 0, acc, blockIdx.x,
                                 norm ? norm_w : 0))
        return;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    y[row] = ACT::f(acc[0][0] * s) * (acc[1][0] * s);
}

#define MT_MATVEC_GLU_ENTRY(name, W)                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        matvec_swiglu_##name(const mt_u8* wg, const mt_u8* wu, const float* x, float* y,      \
                             int ne0, int n_rows, int row_bytes, const float* norm_w,         \
                             float eps, int norm) {                                           \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        mt_matvec_glu<W, GluSilu>(wg, wu, x, y, ne0, n_rows, row_bytes, norm_w, eps, norm);   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        matvec_geglu_##name(const mt_u8* wg, const mt_u8* wu, const float* x, float* y,       \
                            int ne0, int n_rows, int row_bytes, const float* norm_w,          \
                            float eps, int norm) {                                            \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                            \
        mt_matvec_glu<W, GluGelu>(wg, wu, x, y, ne0, n_rows, row_bytes, norm_w, eps, norm);   \
    }

MT_FOR_ALL_WTYPES(MT_MATVEC_GLU_ENTRY)

// ------------------------------------------------------------------ experts
// matvec_id_<type>(const uint8 *w, const float *x, float *y, const int32 *ids, int32 ne0,
//     int32 n_rows, int32 row_bytes, int32 expert_bytes, int32 n_b, int32 x_s1, int32 x_s2,
//     int32 y_s1, int32 y_s2, int32 ids_s0, int32 ids_s1)
// ggml MUL_MAT_ID: for token t and slot u, e = ids[u*ids_s0 + t*ids_s1],
// y[t*y_s2 + u*y_s1 + r] = W_e[r] . x[t*x_s2 + (u % n_b)*x_s1 + :], W_e = w + e*expert_bytes.
// Launch: block as matvec, grid (ceil(n_rows / by), n_used, n_tokens).
template <typename W>
__device__ __forceinline__ void mt_matvec_id(const mt_u8* w, const float* x, float* y,
                                             const int* ids, int ne0, int n_rows, int row_bytes,
                                             int expert_bytes, int n_b, int x_s1, int x_s2,
                                             int y_s1, int y_s2, int ids_s0, int ids_s1) {
    const int u = blockIdx.y, t = blockIdx.z;
    const int e = ids[(mt_i64)u * ids_s0 + (mt_i64)t * ids_s1];
    const mt_u8* ws[1] = {w + (mt_i64)e * expert_bytes};
    const float* xt = x + (mt_i64)t * x_s2 + (mt_i64)(u % n_b) * x_s1;
    float acc[1][1];
    if (!mt_matvec_rows<W, 1, 1>(ws, xt, ne0, n_rows, row_bytes, 1, 0, acc, blockIdx.x, 0)) return;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    y[(mt_i64)t * y_s2 + (mt_i64)u * y_s1 + row] = acc[0][0];
}

#define MT_MATVEC_ID_ENTRY(name, W)                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        matvec_id_##name(const mt_u8* w, const float* x, float* y, const int* ids, int ne0,    \
                         int n_rows, int row_bytes, int expert_bytes, int n_b, int x_s1,       \
                         int x_s2, int y_s1, int y_s2, int ids_s0, int ids_s1) {               \
        mt_pdl_wait(); mt_pdl_launch_dependents();                                             \
        mt_matvec_id<W>(w, x, y, ids, ne0, n_rows, row_bytes, expert_bytes, n_b, x_s1, x_s2,   \
                        y_s1, y_s2, ids_s0, ids_s1);                                           \
    }

MT_FOR_ALL_WTYPES(MT_MATVEC_ID_ENTRY)

// ------------------------------------------------------------------ norm + q/k/v + RoPE + KV write
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
