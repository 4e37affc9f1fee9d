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
// The row core and the norm live in matvec_core.cuh (qkv_rope.cu shares them).
#include "matvec_core.cuh"

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
