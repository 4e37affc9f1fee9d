/* Compiled kernels for the numpy backend's few-token steps (decode): a matrix product over
 * int8-coded weights, rope, attention, gated activations and the simulated all-reduce.
 *
 * Every entry point takes one pointer to an argument struct (mirrored by ctypes.Structure in
 * backends/cpu_kernels.py): Python builds it once per plan, so a call costs ~0.2 us instead of
 * the ~3 us ctypes spends converting a dozen scalar arguments.
 *
 * qmatmul:
 * Why: a decode step streams every weight once. As float32 that is 4 bytes a weight and the
 * step is bound by memory bandwidth; kept as int8 codes with one float32 scale (and offset)
 * per block of 16 or 32 it is ~1.25 bytes (~0.75 for types whose codes fit a nibble: those are
 * stored two a byte), and the codes are turned into floats in registers.
 * Activations stay float32, so the result equals the float32 product of the dequantized
 * weights up to summation order.
 *
 *   y[t][r] = sum_b scale[r][b] * sum_i q[r][b*B+i] * x[t][b*B+i]  +  sum_b offset[r][b] * xsum[t][b]
 *
 * Written with GCC vector extensions: -march=native turns them into AVX-512, AVX2 or NEON.
 * Rows are shared among OpenMP threads; tokens are taken four at a time so a row's codes are
 * converted once per group.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));

enum { UNIT = 16, MAX_GROUP = 4, CHAINS = 4 };

/* IEEE half -> float, exactly (for builds without a conversion instruction) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);                 /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);         /* normal */
    } else if (man == 0) {
        bits = sign;                                             /* zero */
    } else {                                                     /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { m <<= 1; e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 int8 codes -> 16 floats. GCC scalarizes this conversion when written generically
   (__builtin_convertvector or a loop: 16 scalar converts), so each ISA gets its intrinsics. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16f load_codes(const int8_t *p) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 nibbles (the low or high halves of 16 bytes) minus `bias` -> 16 floats */
static inline v16f load_nibbles(const uint8_t *p, int high, int bias) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (high) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return (v16f)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(bias)));
}
/* 16 IEEE halves or bfloat16s -> 16 floats (exact) */
static inline v16f load_halves(const uint16_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return (v16f)_mm512_cvtph_ps(h);
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline v16f load_codes(const int8_t *p) {
    union { __m256 h[2]; v16f v; } u;
    u.h[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    u.h[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    return u.v;
}
static inline v16f load_nibbles(const uint8_t *p, int high, int bias) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (high) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m256i bias8 = _mm256_set1_epi32(bias);
    union { __m256 h[2]; v16f v; } u;
    u.h[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), bias8));
    u.h[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), bias8));
    return u.v;
}
static inline v16f load_halves(const uint16_t *p, int bf16) {
    union { __m256 h[2]; v16f v; } u;
    for (int i = 0; i < 2; i++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(p + 8 * i));
#if defined(__F16C__)
        u.h[i] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
#else
        u.h[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        if (!bf16) for (int j = 0; j < 8; j++) u.v[8 * i + j] = half_to_float(p[8 * i + j]);
#endif
    }
    return u.v;
}
#elif defined(__ARM_NEON)
#include <arm_neon.h>
static inline v16f load_codes(const int8_t *p) {
    const int8x16_t b = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    union { float32x4_t q[4]; v16f v; } u;
    u.q[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    u.q[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    u.q[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    u.q[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    return u.v;
}
static inline v16f load_nibbles(const uint8_t *p, int high, int bias) {
    uint8x16_t b = vld1q_u8(p);
    b = high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(0x0F));
    const int16x8_t lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(b)));
    const int16x8_t hi = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(b)));
    const int32x4_t bias4 = vdupq_n_s32(bias);
    union { float32x4_t q[4]; v16f v; } u;
    u.q[0] = vcvtq_f32_s32(vsubq_s32(vmovl_s16(vget_low_s16(lo)), bias4));
    u.q[1] = vcvtq_f32_s32(vsubq_s32(vmovl_s16(vget_high_s16(lo)), bias4));
    u.q[2] = vcvtq_f32_s32(vsubq_s32(vmovl_s16(vget_low_s16(hi)), bias4));
    u.q[3] = vcvtq_f32_s32(vsubq_s32(vmovl_s16(vget_high_s16(hi)), bias4));
    return u.v;
}
static inline v16f load_halves(const uint16_t *p, int bf16) {
    union { float32x4_t q[4]; v16f v; } u;
    for (int i = 0; i < 4; i++) {
        const uint16x4_t h = vld1_u16(p + 4 * i);
        u.q[i] = bf16 ? vreinterpretq_f32_u32(vshll_n_u16(h, 16)) : vcvt_f32_f16(vreinterpret_f16_u16(h));
    }
    return u.v;
}
#else
static inline v16f load_codes(const int8_t *p) {
    v16f v;
    for (int i = 0; i < UNIT; i++) v[i] = (float)p[i];
    return v;
}
static inline v16f load_nibbles(const uint8_t *p, int high, int bias) {
    v16f v;
    for (int i = 0; i < UNIT; i++) v[i] = (float)(((p[i] >> (high ? 4 : 0)) & 0x0F) - bias);
    return v;
}
static inline v16f load_halves(const uint16_t *p, int bf16) {
    v16f v;
    for (int i = 0; i < UNIT; i++) {
        if (bf16) {
            const uint32_t bits = (uint32_t)p[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            v[i] = f;
        } else {
            v[i] = half_to_float(p[i]);
        }
    }
    return v;
}
#endif

/* Unit k (16 codes) of a row: int8 codes, or (bits 4) the low/high nibbles of 16 bytes, a
 * 32-element group keeping elements 0..15 low and 16..31 high. */
static inline __attribute__((always_inline)) v16f unit_codes(const void *q, int64_t k, int bits, int bias) {
    if (bits == 4) return load_nibbles((const uint8_t *)q + (k >> 1) * UNIT, (int)(k & 1), bias);
    if (bits == 16) return load_halves((const uint16_t *)q + k * UNIT, bias);   /* bias: 1 = bfloat16 */
    return load_codes((const int8_t *)q + k * UNIT);
}

static inline v16f load_f32(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Horizontal sum as a tree (16 -> 8 -> 4 -> 1): a row pays this once, and a chain of 16
   dependent scalar adds costs more than the row's arithmetic on short rows. */
static inline float hsum(v16f v) {
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const v8f a = lo + hi;
    v4f l4, h4;
    memcpy(&l4, &a, sizeof l4);
    memcpy(&h4, (const char *)&a + sizeof l4, sizeof h4);
    const v4f b = l4 + h4;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* One row against `nt` tokens (nt is a constant at every call site, so the loops unroll). */
static inline __attribute__((always_inline)) void row_group(
        const void *q, int bits, int bias, const float *scale, int64_t units, int shift,
        const float *x, int64_t ldx, int nt, float *res) {
    if (nt == 1 && shift == 1) {
        /* one token, blocks of 32: sum each block's two units unscaled, then scale once per
           block (3 floating-point operations per 32 codes instead of 4) */
        v16f acc1[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc1[c] = (v16f){0};
        const int64_t nb = units / 2;
        int64_t b = 0;
        for (; b + CHAINS <= nb; b += CHAINS) {
            for (int c = 0; c < CHAINS; c++) {
                const int64_t bb = b + c;
                v16f p = unit_codes(q, 2 * bb, bits, bias) * load_f32(x + 2 * bb * UNIT);
                p += unit_codes(q, 2 * bb + 1, bits, bias) * load_f32(x + (2 * bb + 1) * UNIT);
                acc1[c] += scale[bb] * p;
            }
        }
        for (; b < nb; b++) {
            v16f p = unit_codes(q, 2 * b, bits, bias) * load_f32(x + 2 * b * UNIT);
            p += unit_codes(q, 2 * b + 1, bits, bias) * load_f32(x + (2 * b + 1) * UNIT);
            acc1[0] += scale[b] * p;
        }
        res[0] = hsum((acc1[0] + acc1[1]) + (acc1[2] + acc1[3]));
        return;
    }
    v16f acc[MAX_GROUP][CHAINS];
    for (int t = 0; t < nt; t++)
        for (int c = 0; c < CHAINS; c++) acc[t][c] = (v16f){0};
    int64_t u = 0;
    for (; u + CHAINS <= units; u += CHAINS) {
        for (int c = 0; c < CHAINS; c++) {
            const int64_t k = u + c;
            const v16f w = unit_codes(q, k, bits, bias) * scale[k >> shift];
            for (int t = 0; t < nt; t++) acc[t][c] += w * load_f32(x + t * ldx + k * UNIT);
        }
    }
    for (; u < units; u++) {
        const v16f w = unit_codes(q, u, bits, bias) * scale[u >> shift];
        for (int t = 0; t < nt; t++) acc[t][0] += w * load_f32(x + t * ldx + u * UNIT);
    }
    for (int t = 0; t < nt; t++) res[t] = hsum((acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]));
}

typedef struct {
    /* bits 8: int8 codes; 4: nibbles, code = nibble - bias; 16: halves, bias 1 = bfloat16 */
    int64_t rows, k, block, bits, bias;
    const void *q;
    const float *scale, *offset;   /* offset may be NULL */
    const float *x;
    int64_t ldx, ntok;
    float *y;
    int64_t ldy;
} QMatmulArgs;

/* Several independent products in one parallel region (e.g. one node's slices on every
 * simulated device): the threads share out all their rows, so a group pays one fork/join. */
typedef struct {
    int64_t n;
    const QMatmulArgs *const *items;
    int64_t nthreads;
} QMatmulGroup;

static int qmm_check(const QMatmulArgs *a) {
    if (a->block != 16 && a->block != 32) return -1;
    if (a->k <= 0 || a->k % a->block != 0 || a->rows < 0 || a->ntok < 1) return -2;
    if (!(a->bits == 8 || (a->bits == 4 && a->k % 32 == 0 && a->bias >= 0 && a->bias <= 15)
          || (a->bits == 16 && (a->bias == 0 || a->bias == 1)))) return -5;
    return 0;
}

/* Per token, per block: the sum of x that the block's offset multiplies. */
static void qmm_xsum(const QMatmulArgs *a, float *xsum) {
    const int64_t nb = a->k / a->block;
    for (int64_t t = 0; t < a->ntok; t++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < a->block; i++) s += a->x[t * a->ldx + b * a->block + i];
            xsum[t * nb + b] = s;
        }
}

/* Nibble codes are read without their bias (one instruction less per 16 codes); the bias comes
 * back per row as - bias * sum_b scale[b] * xsum[b]. */
#define ROW_GROUP(NT) \
    (a->bits == 4 ? row_group(qr, 4, 0, sr, units, shift, xt, ldx, NT, res) \
     : a->bits == 16 ? row_group(qr, 16, (int)a->bias, sr, units, shift, xt, ldx, NT, res) \
                     : row_group(qr, 8, 0, sr, units, shift, xt, ldx, NT, res))

static int needs_xsum(const QMatmulArgs *a) {
    return a->offset != NULL || (a->bits == 4 && a->bias != 0);
}

static void qmm_row(const QMatmulArgs *a, const float *xsum, int64_t r) {
    const int64_t k = a->k, nb = k / a->block, units = k / UNIT, ldx = a->ldx, ntok = a->ntok;
    const int shift = a->block == 32 ? 1 : 0;
    const float bias = a->bits == 4 ? (float)a->bias : 0.0f;
    const void *qr = (const uint8_t *)a->q + r * (k * a->bits / 8);
    const float *sr = a->scale + r * nb;
    for (int64_t t0 = 0; t0 < ntok; t0 += MAX_GROUP) {
        const float *xt = a->x + t0 * ldx;
        float res[MAX_GROUP];
        const int64_t left = ntok - t0;
        const int nt = left < MAX_GROUP ? (int)left : MAX_GROUP;
        switch (nt) {
            case 1: ROW_GROUP(1); break;
            case 2: ROW_GROUP(2); break;
            case 3: ROW_GROUP(3); break;
            default: ROW_GROUP(4); break;
        }
        if (a->offset) {
            const float *orow = a->offset + r * nb;
            for (int t = 0; t < nt; t++) {
                const float *xs = xsum + (t0 + t) * nb;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t b = 0; b < nb; b++) s += orow[b] * xs[b];
                res[t] += s;
            }
        }
        if (bias != 0.0f) {
            for (int t = 0; t < nt; t++) {
                const float *xs = xsum + (t0 + t) * nb;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t b = 0; b < nb; b++) s += sr[b] * xs[b];
                res[t] -= bias * s;
            }
        }
        for (int t = 0; t < nt; t++) a->y[(t0 + t) * a->ldy + r] = res[t];
    }
}

enum { MAX_ITEMS = 64 };

/* Returns 0, or a negative code for arguments the kernel does not take. */
int metatp_qmatmul(const QMatmulGroup *g) {
    const int64_t n = g->n;
    if (n < 1 || n > MAX_ITEMS) return -4;
    int64_t first_row[MAX_ITEMS + 1], xsum_at[MAX_ITEMS + 1], work = 0;
    first_row[0] = xsum_at[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const QMatmulArgs *a = g->items[i];
        const int rc = qmm_check(a);
        if (rc) return rc;
        first_row[i + 1] = first_row[i] + a->rows;
        xsum_at[i + 1] = xsum_at[i] + (needs_xsum(a) ? a->k / a->block * a->ntok : 0);
        work += a->rows * a->k * a->ntok;
    }
    float *xsum = NULL;
    if (xsum_at[n]) {
        xsum = (float *)malloc(sizeof(float) * (size_t)xsum_at[n]);
        if (!xsum) return -3;
        for (int64_t i = 0; i < n; i++)
            if (needs_xsum(g->items[i])) qmm_xsum(g->items[i], xsum + xsum_at[i]);
    }
    const int nthreads = work < (int64_t)1 << 16 ? 1 : (int)g->nthreads;   /* small: not worth waking threads */
    const int64_t total = first_row[n];

#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t gr = 0; gr < total; gr++) {
        int64_t i = 0;
        while (gr >= first_row[i + 1]) i++;
        qmm_row(g->items[i], xsum ? xsum + xsum_at[i] : NULL, gr - first_row[i]);
    }
    free(xsum);
    return 0;
}

/* ------------------------------------------------------------------ rope
 * Rotary embedding of x (T, H, D) into out, pairs (i, i+n_dims/2) for NEOX else (2i, 2i+1);
 * dims past n_dims are copied. cs: cos then sin tables, each (T, n_dims/2) contiguous.
 * Strides are in floats; the last dim is contiguous. x may be out (pairs are read first). */
typedef struct {
    int64_t T, H, D, n_dims, neox;
    const float *x;
    int64_t x_st, x_sh;
    float *out;
    int64_t o_st, o_sh;
    const float *cs;
} RopeArgs;

int metatp_rope(const RopeArgs *a) {
    const int64_t T = a->T, H = a->H, D = a->D, n_dims = a->n_dims, x_st = a->x_st, x_sh = a->x_sh;
    const int64_t o_st = a->o_st, o_sh = a->o_sh;
    const int neox = (int)a->neox;
    const float *x = a->x, *cs = a->cs;
    float *out = a->out;
    if (n_dims <= 0 || n_dims % 2 || n_dims > D) return -1;
    const int64_t half = n_dims / 2;
    const float *cos_t = cs, *sin_t = cs + T * half;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + t * x_st + h * x_sh;
            float *orow = out + t * o_st + h * o_sh;
            const int64_t step = neox ? 1 : 2, other = neox ? half : 1;
            for (int64_t i = 0; i < half; i++) {
                const int64_t ia = i * step, ib = ia + other;
                const float a = xr[ia], b = xr[ib];
                orow[ia] = a * c[i] - b * s[i];
                orow[ib] = a * s[i] + b * c[i];
            }
            if (orow != xr)
                for (int64_t i = n_dims; i < D; i++) orow[i] = xr[i];
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ attention
 * Softmax attention of a few queries over a KV cache, one (head, query) row at a time.
 * q (H, T, D): q[h*q_sh + t*q_st + d]; k/v (Hkv, n_kv, D|Dv): k[g*k_sh + j*k_sj + d];
 * mask (T, n_kv) additive or NULL: mask[t*m_st + j]; sinks (H) or NULL;
 * out (T, H, Dv): out[t*o_st + h*o_sh + d]. Query head h reads kv head h / (H/Hkv).
 * softcap > 0: s = softcap*tanh(s/softcap) before the mask. scratch: n_kv floats. */
#include <math.h>

typedef struct {
    int64_t T, H, Hkv, D, Dv, n_kv;   /* n_kv: the visible cache rows, set before each call */
    const float *q;
    int64_t q_sh, q_st;
    const float *k;
    int64_t k_sh, k_sj;
    const float *v;
    int64_t v_sh, v_sj;
    const float *mask;
    int64_t m_st;
    float scale, softcap;
    const float *sinks;
    float *out;
    int64_t o_st, o_sh;
    float *scratch;
} AttentionArgs;

int metatp_attention(const AttentionArgs *a) {
    const int64_t T = a->T, H = a->H, Hkv = a->Hkv, D = a->D, Dv = a->Dv, n_kv = a->n_kv;
    const int64_t q_sh = a->q_sh, q_st = a->q_st, k_sh = a->k_sh, k_sj = a->k_sj;
    const int64_t v_sh = a->v_sh, v_sj = a->v_sj, m_st = a->m_st, o_st = a->o_st, o_sh = a->o_sh;
    const float *q = a->q, *k = a->k, *v = a->v, *mask = a->mask, *sinks = a->sinks;
    const float scale = a->scale, softcap = a->softcap;
    float *out = a->out, *scratch = a->scratch;
    if (Hkv <= 0 || H % Hkv || n_kv <= 0) return -1;
    const int64_t g = H / Hkv;
    for (int64_t h = 0; h < H; h++) {
        const float *kh = k + (h / g) * k_sh, *vh = v + (h / g) * v_sh;
        for (int64_t t = 0; t < T; t++) {
            const float *qr = q + h * q_sh + t * q_st;
            const float *mr = mask ? mask + t * m_st : NULL;
            float m = -INFINITY;
            for (int64_t j = 0; j < n_kv; j++) {
                const float *kr = kh + j * k_sj;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qr[d] * kr[d];
                s *= scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                if (mr) s += mr[j];
                scratch[j] = s;
                if (s > m) m = s;
            }
            if (sinks && sinks[h] > m) m = sinks[h];
            float denom = sinks ? expf(sinks[h] - m) : 0.0f;
            for (int64_t j = 0; j < n_kv; j++) {
                const float p = expf(scratch[j] - m);
                scratch[j] = p;
                denom += p;
            }
            float *orow = out + t * o_st + h * o_sh;
            for (int64_t d = 0; d < Dv; d++) orow[d] = 0.0f;
            for (int64_t j = 0; j < n_kv; j++) {
                const float p = scratch[j] / denom;
                if (p == 0.0f) continue;
                const float *vr = vh + j * v_sj;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) orow[d] += p * vr[d];
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ gated activation
 * out[t][i] = act(a[t][i]) * b[t][i] for rows of n floats (row strides in floats):
 * act 0 = SiLU (x / (1 + exp(-x))), 1 = GELU with the tanh approximation. */
typedef struct {
    int64_t T, n, act;
    const float *a;
    int64_t a_st;
    const float *b;
    int64_t b_st;
    float *out;
    int64_t o_st;
} GluArgs;

int metatp_glu(const GluArgs *g) {
    if (g->act != 0 && g->act != 1) return -1;
    for (int64_t t = 0; t < g->T; t++) {
        const float *a = g->a + t * g->a_st, *b = g->b + t * g->b_st;
        float *o = g->out + t * g->o_st;
        if (g->act == 0) {
            for (int64_t i = 0; i < g->n; i++) o[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
        } else {
            const float c = 0.7978845608028654f;
            for (int64_t i = 0; i < g->n; i++) {
                const float x = a[i];
                o[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * b[i];
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ simulated all-reduce
 * Sum n equal-length buffers in place with the bits of llama.cpp's butterfly (the schedule is
 * backends/collectives/schedule.py butterfly_schedule): zero the inactive ones, fold the devices past
 * the largest power of two p2, then pairwise sums at distance p2/2, ..., 1 into the lower half,
 * then every buffer receives buffer 0's result. */
typedef struct {
    int64_t n, count;
    float *const *bufs;
    const uint8_t *active;   /* n flags */
} AllreduceArgs;

static void add_into(float *dst, const float *src, int64_t count) {
    for (int64_t i = 0; i < count; i++) dst[i] += src[i];
}

int metatp_allreduce(const AllreduceArgs *a) {
    const int64_t n = a->n, count = a->count;
    float *const *bufs = a->bufs;
    if (n < 1) return -1;
    for (int64_t j = 0; j < n; j++)
        if (!a->active[j]) memset(bufs[j], 0, sizeof(float) * (size_t)count);
    int64_t p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    for (int64_t j = p2; j < n; j++) add_into(bufs[j - p2], bufs[j], count);
    for (int64_t off = p2 / 2; off >= 1; off /= 2)
        for (int64_t j = 0; j < off; j++) add_into(bufs[j], bufs[j + off], count);
    for (int64_t j = 1; j < n; j++) memcpy(bufs[j], bufs[0], sizeof(float) * (size_t)count);
    return 0;
}

/* ------------------------------------------------------------------ dequantize
 * out[r][i] = scale[r][i/B] * q[r][i] + offset[r][i/B], rounded twice (a product, then a sum)
 * exactly as gguf's float32 dequantizers do — no fused multiply-add — so the values are
 * bit-identical to theirs. Rows are shared among threads. Used to feed BLAS for long prompts
 * from int8 codes, so the float32 weights need not be kept. */
typedef struct {
    int64_t rows, k, block, bits, bias;   /* codes as in QMatmulArgs */
    const void *q;
    const float *scale, *offset;   /* offset may be NULL */
    float *out;
    int64_t ldo, nthreads;
} DequantArgs;

__attribute__((optimize("fp-contract=off")))
int metatp_dequant(const DequantArgs *a) {
    if (a->block != 16 && a->block != 32) return -1;
    if (a->k <= 0 || a->k % a->block != 0 || a->rows < 0) return -2;
    if (!(a->bits == 8 || (a->bits == 4 && a->k % 32 == 0) || a->bits == 16)) return -5;
    const int64_t k = a->k, B = a->block, nb = k / B, row_bytes = k * a->bits / 8;
    const int nthreads = a->rows * k < (int64_t)1 << 16 ? 1 : (int)a->nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < a->rows; r++) {
        const uint8_t *q = (const uint8_t *)a->q + r * row_bytes;
        const float *s = a->scale + r * nb, *o = a->offset ? a->offset + r * nb : NULL;
        float *out = a->out + r * a->ldo;
        const int shift = B == 32 ? 1 : 0, bits = (int)a->bits, bias = (int)a->bias;
        for (int64_t u = 0; u < k / UNIT; u++) {    /* 16 codes at a time, as the matmul reads them */
            v16f v = unit_codes(q, u, bits, bias) * s[u >> shift];
            if (o) v = v + o[u >> shift];
            memcpy(out + u * UNIT, &v, sizeof v);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ set rows
 * dst[ids[t]] = src[t] for T rows of n floats (the KV-cache write of a step); row strides in
 * floats. An id outside [0, dst_rows) is refused (-1) before anything is written. */
typedef struct {
    int64_t T, n;
    const float *src;
    int64_t src_st;
    float *dst;
    int64_t dst_st, dst_rows;
    const int32_t *ids;
} SetRowsArgs;

int metatp_set_rows(const SetRowsArgs *a) {
    for (int64_t t = 0; t < a->T; t++)
        if (a->ids[t] < 0 || a->ids[t] >= a->dst_rows) return -1;
    for (int64_t t = 0; t < a->T; t++)
        memcpy(a->dst + a->ids[t] * a->dst_st, a->src + t * a->src_st, sizeof(float) * (size_t)a->n);
    return 0;
}
