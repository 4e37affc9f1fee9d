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
 * Written with GCC vector extensions (-march=native turns them into AVX-512 or NEON) and, for
 * AVX2, with 8-float intrinsics. Chunks of CHUNK_ROWS rows are shared among OpenMP threads; a
 * chunk is computed in register tiles of R rows x T tokens, so a row's codes are converted once
 * for T tokens and a token's x is read once for R rows, with software prefetch a few rows ahead.
 *
 * q8_matmul (numerics="llamacpp"): activations rounded to Q8 blocks as llama.cpp rounds them,
 * integer dot products with the codes. Weights of 4- or 8-bit codes in blocks of 32 come in the
 * row-group layout (see "the row-group layout" below): 8 rows a 32-bit lane.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v16f __attribute__((vector_size(64)));

enum { UNIT = 16 };

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

/* Rows per scheduling chunk of the matrix products (the threads share out chunks), and how many
 * rows ahead a tile prefetches: a row is only a few cache lines, too short a stream for the
 * hardware prefetcher to learn when a tile reads several rows side by side. */
enum { CHUNK_ROWS = 4, PREFETCH_ROWS = 8 };

static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off);
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Sums whose order depends only on n: one out-of-line body (no clones, no auto-vectorizer) for
 * every caller. A reduction inlined into each tile shape was vectorized differently per shape (and
 * may peel for alignment), so a token's result changed with the step's token count. */
__attribute__((noinline, noclone, optimize("no-tree-vectorize")))
static float dot_f32(const float *a, const float *b, int64_t n) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f va, vb;
        memcpy(&va, a + i, sizeof va);
        memcpy(&vb, b + i, sizeof vb);
        acc += va * vb;
    }
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

__attribute__((noinline, noclone, optimize("no-tree-vectorize")))
static float sum_f32(const float *a, int64_t n) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f va;
        memcpy(&va, a + i, sizeof va);
        acc += va;
    }
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i];
    return s;
}

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
            xsum[t * nb + b] = sum_f32(a->x + t * a->ldx + b * a->block, a->block);
        }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 has 8-float registers: GCC moves a 16-float vector type between its halves through the
 * stack (several times slower), so on this ISA the tile holds each 16-lane accumulator as two
 * __m256 (lanes 0..7, 8..15) and unpacks codes straight into them. Same sums as the v16f code. */
static inline __attribute__((always_inline)) void bytes16_to_f32(__m128i b, int is_signed, __m256 *lo, __m256 *hi) {
    const __m128i h = _mm_srli_si128(b, 8);
    *lo = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    *hi = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
}

static inline __attribute__((always_inline)) void halves8_to_f32(const uint16_t *p, int bf16, __m256 *out) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
#if defined(__F16C__)
    *out = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
#else
    if (bf16) {
        *out = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        float f[8];
        for (int j = 0; j < 8; j++) f[j] = half_to_float(p[j]);
        *out = _mm256_loadu_ps(f);
    }
#endif
}

/* Unit k (16 codes) as two 8-float halves; nibbles without their bias (see qmm_store). */
static inline __attribute__((always_inline)) void unit_pair(const void *q, int64_t k, int bits, int bias, __m256 u[2]) {
    if (bits == 4) {
        __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + (k >> 1) * UNIT));
        if (k & 1) b = _mm_srli_epi16(b, 4);
        bytes16_to_f32(_mm_and_si128(b, _mm_set1_epi8(0x0F)), 0, &u[0], &u[1]);
    } else if (bits == 16) {
        halves8_to_f32((const uint16_t *)q + k * UNIT, bias, &u[0]);
        halves8_to_f32((const uint16_t *)q + k * UNIT + 8, bias, &u[1]);
    } else {
        bytes16_to_f32(_mm_loadu_si128((const __m128i *)((const int8_t *)q + k * UNIT)), 1, &u[0], &u[1]);
    }
}

/* Block b of 32 codes (units 2b, 2b+1) as four halves; 16 nibble bytes are read once. */
static inline __attribute__((always_inline)) void block_pairs(const void *q, int64_t b, int bits, int bias, __m256 u[4]) {
    if (bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * UNIT)), m = _mm_set1_epi8(0x0F);
        bytes16_to_f32(_mm_and_si128(v, m), 0, &u[0], &u[1]);
        bytes16_to_f32(_mm_and_si128(_mm_srli_epi16(v, 4), m), 0, &u[2], &u[3]);
    } else {
        unit_pair(q, 2 * b, bits, bias, &u[0]);
        unit_pair(q, 2 * b + 1, bits, bias, &u[2]);
    }
}

static inline float hsum_pair(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((always_inline)) void qmm_tile(
        const QMatmulArgs *a, int64_t r0, int R, int64_t t0, int T, int bits, int bias, int shift, float *res) {
    const int64_t k = a->k, nb = k / a->block, units = k / UNIT, ldx = a->ldx;
    const int64_t rowbytes = k * bits / 8;
    const uint8_t *q0 = (const uint8_t *)a->q + r0 * rowbytes;
    const float *s0 = a->scale + r0 * nb;
    const float *x0 = a->x + t0 * ldx;
    const uint8_t *pf = q0 + PREFETCH_ROWS * rowbytes;
    prefetch_span(s0 + PREFETCH_ROWS * nb, R * nb * (int64_t)sizeof(float));
    if (a->offset) prefetch_span(a->offset + (r0 + PREFETCH_ROWS) * nb, R * nb * (int64_t)sizeof(float));
    __m256 acc[4][4][2];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
    if (shift == 1) {
        const int64_t step = R * bits * 4;
        for (int64_t b = 0; b < units / 2; b++) {
            for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + b * step + off);
            for (int i = 0; i < R; i++) {
                __m256 u[4];
                block_pairs(q0 + i * rowbytes, b, bits, bias, u);
                const __m256 sc = _mm256_broadcast_ss(s0 + i * nb + b);
                for (int t = 0; t < T; t++) {
                    const float *xt = x0 + t * ldx + 2 * b * UNIT;
                    __m256 p0 = _mm256_mul_ps(u[0], _mm256_loadu_ps(xt));
                    __m256 p1 = _mm256_mul_ps(u[1], _mm256_loadu_ps(xt + 8));
                    p0 = _mm256_fmadd_ps(u[2], _mm256_loadu_ps(xt + 16), p0);
                    p1 = _mm256_fmadd_ps(u[3], _mm256_loadu_ps(xt + 24), p1);
                    acc[i][t][0] = _mm256_fmadd_ps(sc, p0, acc[i][t][0]);
                    acc[i][t][1] = _mm256_fmadd_ps(sc, p1, acc[i][t][1]);
                }
            }
        }
    } else {
        const int64_t step = R * bits * 2;
        for (int64_t u = 0; u < units; u++) {
            for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + u * step + off);
            for (int i = 0; i < R; i++) {
                __m256 w[2];
                unit_pair(q0 + i * rowbytes, u, bits, bias, w);
                const __m256 sc = _mm256_broadcast_ss(s0 + i * nb + u);
                w[0] = _mm256_mul_ps(w[0], sc);
                w[1] = _mm256_mul_ps(w[1], sc);
                for (int t = 0; t < T; t++) {
                    const float *xt = x0 + t * ldx + u * UNIT;
                    acc[i][t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xt), acc[i][t][0]);
                    acc[i][t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), acc[i][t][1]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) res[i * T + t] = hsum_pair(acc[i][t][0], acc[i][t][1]);
}
#else
/* R rows (from r0) x T tokens (from t0) of one item, for one code format (constants at every
 * call site, so the loops unroll and the accumulators stay in registers): a unit's codes are
 * converted once for all T tokens and a token's x is read for all R rows. Each (row, token) sum
 * is one v16f accumulator taking the blocks in order, whatever the tile shape or the step's other
 * tokens (batch invariance): blocks of 32 sum their two units unscaled and scale once per block,
 * blocks of 16 scale each unit. res[i * T + t]. */
static inline __attribute__((always_inline)) void qmm_tile(
        const QMatmulArgs *a, int64_t r0, int R, int64_t t0, int T, int bits, int bias, int shift, float *res) {
    const int64_t k = a->k, nb = k / a->block, units = k / UNIT, ldx = a->ldx;
    const int64_t rowbytes = k * bits / 8;
    const uint8_t *q0 = (const uint8_t *)a->q + r0 * rowbytes;
    const float *s0 = a->scale + r0 * nb;
    const float *x0 = a->x + t0 * ldx;
    const uint8_t *pf = q0 + PREFETCH_ROWS * rowbytes;
    prefetch_span(s0 + PREFETCH_ROWS * nb, R * nb * (int64_t)sizeof(float));
    if (a->offset) prefetch_span(a->offset + (r0 + PREFETCH_ROWS) * nb, R * nb * (int64_t)sizeof(float));
    v16f acc[4][4];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = (v16f){0};
    if (shift == 1) {
        const int64_t step = R * bits * 4;                 /* the tile's code bytes per block */
        for (int64_t b = 0; b < units / 2; b++) {
            for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + b * step + off);
            for (int i = 0; i < R; i++) {
                const void *q = q0 + i * rowbytes;
                const v16f u0 = unit_codes(q, 2 * b, bits, bias), u1 = unit_codes(q, 2 * b + 1, bits, bias);
                const float sc = s0[i * nb + b];
                for (int t = 0; t < T; t++) {
                    const float *xt = x0 + t * ldx + 2 * b * UNIT;
                    v16f p = u0 * load_f32(xt);
                    p += u1 * load_f32(xt + UNIT);
                    acc[i][t] += sc * p;
                }
            }
        }
    } else {
        const int64_t step = R * bits * 2;                 /* the tile's code bytes per unit */
        for (int64_t u = 0; u < units; u++) {
            for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + u * step + off);
            for (int i = 0; i < R; i++) {
                const v16f w = unit_codes(q0 + i * rowbytes, u, bits, bias) * s0[i * nb + u];
                for (int t = 0; t < T; t++) acc[i][t] += w * load_f32(x0 + t * ldx + u * UNIT);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) res[i * T + t] = hsum(acc[i][t]);
}
#endif

static int needs_xsum(const QMatmulArgs *a) {
    return a->offset != NULL || (a->bits == 4 && a->bias != 0);
}

/* The tile's results plus the offset term and the nibble bias (nibbles are read without their
 * bias, one instruction less per 16 codes; it comes back as - bias * sum_b scale[b] * xsum[b]),
 * per row and token in block order, into y. */
static __attribute__((noinline, noclone)) void qmm_store(const QMatmulArgs *a, const float *xsum, int64_t r0, int R, int64_t t0, int T,
                             const float *res) {
    const int64_t nb = a->k / a->block;
    const float bias = a->bits == 4 ? (float)a->bias : 0.0f;
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) {
            float v = res[i * T + t];
            const float *xs = xsum ? xsum + (t0 + t) * nb : NULL;
            if (a->offset) {
                v += dot_f32(a->offset + (r0 + i) * nb, xs, nb);
            }
            if (bias != 0.0f) {
                v = fmaf(-bias, dot_f32(a->scale + (r0 + i) * nb, xs, nb), v);
            }
            a->y[(t0 + t) * a->ldy + r0 + i] = v;
        }
}

/* Rows r0 .. r0+nr of an item against all its tokens: four tokens a tile, fewer tokens with
 * more rows a tile (the accumulators of a tile fill the vector registers); leftover rows one at
 * a time. */
static inline __attribute__((always_inline)) void qmm_chunk_fmt(
        const QMatmulArgs *a, const float *xsum, int64_t r0, int64_t nr, int bits, int bias, int shift) {
    float res[16];
#define QMM_TILES(T, R) do { \
        int64_t i = 0; \
        for (; i + (R) <= nr; i += (R)) { \
            qmm_tile(a, r0 + i, (R), t0, (T), bits, bias, shift, res); \
            qmm_store(a, xsum, r0 + i, (R), t0, (T), res); \
        } \
        for (; i < nr; i++) { \
            qmm_tile(a, r0 + i, 1, t0, (T), bits, bias, shift, res); \
            qmm_store(a, xsum, r0 + i, 1, t0, (T), res); \
        } \
    } while (0)
    for (int64_t t0 = 0; t0 < a->ntok;) {
        const int64_t left = a->ntok - t0;
        if (left >= 4) { QMM_TILES(4, 1); t0 += 4; }
        else if (left == 3) { QMM_TILES(3, 1); t0 += 3; }
        else if (left == 2) { QMM_TILES(2, 2); t0 += 2; }
        else { QMM_TILES(1, 4); t0 += 1; }
    }
#undef QMM_TILES
}

/* One chunk of rows, dispatched on the code format: int8, nibbles (read without their bias),
 * halves or bfloat16s; blocks of 32 or 16. */
static void qmm_chunk(const QMatmulArgs *a, const float *xsum, int64_t r0, int64_t nr) {
    const int shift = a->block == 32 ? 1 : 0;
#define QMM_FMT(B, BIAS) do { \
        if (shift) qmm_chunk_fmt(a, xsum, r0, nr, (B), (BIAS), 1); \
        else qmm_chunk_fmt(a, xsum, r0, nr, (B), (BIAS), 0); \
    } while (0)
    if (a->bits == 4) QMM_FMT(4, 0);
    else if (a->bits == 16 && a->bias) QMM_FMT(16, 1);
    else if (a->bits == 16) QMM_FMT(16, 0);
    else QMM_FMT(8, 0);
#undef QMM_FMT
}

enum { MAX_ITEMS = 64 };

/* Returns 0, or a negative code for arguments the kernel does not take. */
int metatp_qmatmul(const QMatmulGroup *g) {
    const int64_t n = g->n;
    if (n < 1 || n > MAX_ITEMS) return -4;
    int64_t first_chunk[MAX_ITEMS + 1], xsum_at[MAX_ITEMS + 1], work = 0;
    first_chunk[0] = xsum_at[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const QMatmulArgs *a = g->items[i];
        const int rc = qmm_check(a);
        if (rc) return rc;
        first_chunk[i + 1] = first_chunk[i] + (a->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
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
    const int64_t total = first_chunk[n];

#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t c = 0; c < total; c++) {
        int64_t i = 0;
        while (c >= first_chunk[i + 1]) i++;
        const QMatmulArgs *a = g->items[i];
        const int64_t r0 = (c - first_chunk[i]) * CHUNK_ROWS, left = a->rows - r0;
        qmm_chunk(a, xsum && needs_xsum(a) ? xsum + xsum_at[i] : NULL, r0, left < CHUNK_ROWS ? left : CHUNK_ROWS);
    }
    free(xsum);
    return 0;
}

/* ------------------------------------------------------------------ Q8 activations (numerics="llamacpp")
 * Why: the float kernel above converts every weight code to a float and multiplies float
 * activations; llama.cpp instead rounds each activation row to int8 blocks once per step and takes
 * integer dot products, 4-8x more multiply-adds per instruction. These kernels do the same, with
 * llama.cpp's rounding, so the "llamacpp" numerics mode is both the closer one and the faster one.
 *
 * Activation formats (one row of K floats, as ggml-quants / the x86 quantizer round them):
 *   kind 0, Q8_0 (for Q4_0, Q5_0, Q8_0 weights): blocks of 32, amax = max|x|, d = amax/127,
 *     q = round-half-even(x * (127/amax)), the scale kept as f16(d);
 *   kind 1, Q8_1 (Q4_1, Q5_1): as Q8_0, plus s = f16(d * sum q) (d unrounded), which the
 *     weight's per-block offset multiplies;
 *   kind 2, Q8_K (K-quants): blocks of 256, max = the element of largest |x| (the first one),
 *     iscale = -127/max, q = min(127, round-half-even(iscale * x)), d = 1/iscale in float32; the
 *     offset term uses d * (sum of q over the weight's sub-block).
 * Every kind also keeps the integer sum of q per 16 elements.
 *
 * Weight codes are the AffineWeight codes (int8, or nibbles with a bias; not half floats), so
 *   y[t][r] = sum_b scale[r][b] * dx[t][b] * isum(r, t, b)  +  sum_b offset[r][b] * xs[t][b]
 * with isum an exact int32 dot product of codes per block (16 or 32 elements) and xs the Q8_1 s
 * or d * sum(q) as above. Three builds of the block dot product, chosen at compile time:
 * AVX512-VNNI / AVX-VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd) and portable C. */

enum { Q8_0 = 0, Q8_1 = 1, Q8_K = 2, QK = 256 };

/* float -> IEEE half bits, round to nearest even (as F16C and numpy's astype(float16) do); exact
 * in every build */
static inline uint16_t float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = x & 0x80000000u, ax = x & 0x7FFFFFFFu;
    uint32_t h;
    if (ax >= 0x7F800000u) {                               /* inf / nan */
        h = ax > 0x7F800000u ? 0x7E00u : 0x7C00u;
    } else if (ax >= 0x477FF000u) {                        /* rounds to >= 65536: inf */
        h = 0x7C00u;
    } else if (ax >= 0x38800000u) {                        /* a normal half */
        const uint32_t m = ax + 0xFFFu + ((ax >> 13) & 1u); /* round the 13 dropped bits, ties to even */
        h = (m - 0x38000000u) >> 13;
    } else {                                               /* a subnormal half (or zero) */
        const int e = (int)(ax >> 23);
        if (e < 102) {
            h = 0;
        } else {
            const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
            const int shift = 126 - e;                     /* 14..24 */
            const uint32_t half_ulp = 1u << (shift - 1), rest = mant & ((1u << shift) - 1u);
            h = mant >> shift;
            if (rest > half_ulp || (rest == half_ulp && (h & 1u))) h++;
        }
    }
    return (uint16_t)(h | (sign >> 16));
}

/* float -> IEEE half -> float */
static inline float round_to_half(float f) {
    return half_to_float(float_to_half_bits(f));
}

/* For the tests: out[i] = round_to_half(x[i]). */
typedef struct {
    int64_t n;
    const float *x;
    float *out;
} HalfArgs;

int metatp_round_half(const HalfArgs *a) {
    for (int64_t i = 0; i < a->n; i++) a->out[i] = round_to_half(a->x[i]);
    return 0;
}

typedef struct {
    int64_t kind, ntok, k;
    const float *x;
    int64_t ldx;
    int8_t *q;         /* ntok * k codes */
    float *d;          /* ntok * (k/32) scales (kind 0, 1) or ntok * (k/256) (kind 2) */
    float *s;          /* kind 1: ntok * (k/32) f16(d * sum q); else unused (may be NULL) */
    int32_t *isum;     /* ntok * (k/16) integer sums of q */
} Q8QuantArgs;

static int q8_check_quant(int64_t kind, int64_t k) {
    if (kind == Q8_K) return k > 0 && k % QK == 0 ? 0 : -2;
    return (kind == Q8_0 || kind == Q8_1) && k > 0 && k % 32 == 0 ? 0 : -2;
}

static void q8_quantize_row(int64_t kind, int64_t k, const float *x, int8_t *q, float *d, float *s, int32_t *isum) {
    if (kind == Q8_K) {
        for (int64_t b = 0; b < k / QK; b++) {
            const float *xb = x + b * QK;
            int8_t *qb = q + b * QK;
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < QK; j++) {
                const float ax = fabsf(xb[j]);
                if (ax > amax) { amax = ax; max = xb[j]; }
            }
            if (amax == 0.0f) {
                d[b] = 0.0f;
                memset(qb, 0, QK);
            } else {
                const float iscale = -127.0f / max;
                for (int j = 0; j < QK; j++) {
                    const int v = (int)rintf(iscale * xb[j]);
                    qb[j] = (int8_t)(v < 127 ? v : 127);
                }
                d[b] = 1.0f / iscale;
            }
        }
    } else {
        for (int64_t b = 0; b < k / 32; b++) {
            const float *xb = x + b * 32;
            int8_t *qb = q + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float db = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) {
                qb[j] = (int8_t)rintf(xb[j] * id);
                sum += qb[j];
            }
            d[b] = round_to_half(db);
            if (kind == Q8_1) s[b] = round_to_half(db * (float)sum);
        }
    }
    for (int64_t u = 0; u < k / 16; u++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) sum += q[u * 16 + j];
        isum[u] = sum;
    }
}

int metatp_q8_quantize(const Q8QuantArgs *a) {
    if (q8_check_quant(a->kind, a->k) || a->ntok < 0 || (a->kind == Q8_1 && !a->s)) return -2;
    const int64_t k = a->k, nd = a->kind == Q8_K ? k / QK : k / 32;
    for (int64_t t = 0; t < a->ntok; t++)
        q8_quantize_row(a->kind, k, a->x + t * a->ldx, a->q + t * k, a->d + t * nd,
                        a->s ? a->s + t * (k / 32) : NULL, a->isum + t * (k / 16));
    return 0;
}

/* ---- the block dot product: 32 weight codes against 32 activation codes.
 * Weight codes come as 32 bytes: unsigned (nibbles with bias 0) or signed (everything else).
 * The result keeps the two 16-element halves apart (K-quants with blocks of 16 scale them
 * separately). */
#if ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)) && defined(__AVX2__) && defined(__FMA__)
#define Q8_ISA "avx-vnni"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#undef Q8_ISA
#define Q8_ISA "avx512-vnni"
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#endif
#define Q8_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_ISA "avx2"
#define Q8_SIMD 1
#else
#define Q8_ISA "portable"
#define Q8_SIMD 0
#endif

const char *metatp_isa(void) { return Q8_ISA; }

#if Q8_SIMD
/* 32 codes of block b of a row, as bytes (nibbles unpacked, a nonzero nibble bias subtracted) */
static inline __attribute__((always_inline)) __m256i q8_weight32(const void *qrow, int64_t b, int bits, int bias) {
    if (bits == 4) {        /* one 256-bit mask over (high nibbles shifted down | low nibbles) */
        const __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)qrow + b * 16));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
        return bias ? _mm256_sub_epi8(w, _mm256_set1_epi8((char)bias)) : w;
    }
    return _mm256_loadu_si256((const __m256i *)((const int8_t *)qrow + b * 32));
}

/* int32 x 8: lanes 0..3 sum elements 0..15, lanes 4..7 elements 16..31. `wu` holds unsigned
 * bytes (the weight, or |weight| when `signed_w`, whose sign then moves onto x). */
static inline __m256i q8_dot32(__m256i wu, __m256i w, __m256i x, int signed_w) {
    if (signed_w) x = _mm256_sign_epi8(x, w);
#ifdef DPBUSD
    return DPBUSD(_mm256_setzero_si256(), wu, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), _mm256_set1_epi16(1));
#endif
}

static inline float q8_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
/* portable: codes of block b unpacked into 32 signed bytes */
static inline void q8_weight32_c(const void *qrow, int64_t b, int bits, int bias, int8_t *w) {
    if (bits == 4) {
        const uint8_t *p = (const uint8_t *)qrow + b * 16;
        for (int i = 0; i < 16; i++) {
            w[i] = (int8_t)((p[i] & 0x0F) - bias);
            w[i + 16] = (int8_t)((p[i] >> 4) - bias);
        }
    } else {
        memcpy(w, (const int8_t *)qrow + b * 32, 32);
    }
}
#endif

/* The two 16-element integer sums of block b (the test entry point and the portable build). */
static inline void q8_block_isums(const void *qrow, int64_t b, int bits, int bias, const int8_t *x, int32_t out[2]) {
#if Q8_SIMD
    const __m256i w = q8_weight32(qrow, b, bits, bias);
    const int signed_w = !(bits == 4 && bias == 0);
    const __m256i iv = q8_dot32(signed_w ? _mm256_abs_epi8(w) : w, w,
                                _mm256_loadu_si256((const __m256i *)(x + b * 32)), signed_w);
    int32_t l[8];
    memcpy(l, &iv, sizeof l);
    out[0] = l[0] + l[1] + l[2] + l[3];
    out[1] = l[4] + l[5] + l[6] + l[7];
#else
    int8_t w[32];
    q8_weight32_c(qrow, b, bits, bias, w);
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 16; i++) {
        s0 += (int32_t)w[i] * x[b * 32 + i];
        s1 += (int32_t)w[i + 16] * x[b * 32 + 16 + i];
    }
    out[0] = s0;
    out[1] = s1;
#endif
}

typedef struct {
    int64_t rows, k, block, bits, bias;   /* codes as in QMatmulArgs (bits 8 or 4) */
    const void *q;
    const float *scale, *offset;          /* offset may be NULL; IEEE halves with half_scales */
    const float *x;
    int64_t ldx, ntok;
    float *y;
    int64_t ldy;
    int64_t kind;                         /* Q8_0, Q8_1 or Q8_K: how x is rounded */
    int64_t group;                        /* 1: rows one after another; 8: the row-group layout */
    int64_t half_scales;                  /* group 8: scale and offset are IEEE halves */
} Q8MatmulArgs;

typedef struct {
    int64_t n;
    const Q8MatmulArgs *const *items;
    int64_t nthreads;
} Q8MatmulGroup;

/* An item's quantized activations (shared by items that read the same x the same way). */
typedef struct {
    int8_t *q;
    float *d, *s, *xs;     /* xs: ntok * nb offset multipliers (NULL without an offset) */
    int32_t *isum;
} Q8Act;

/* Is this a layout the kernels read: row-major (group 1, float scales), or the row-group layout
 * (group 8: 4- or 8-bit codes, blocks of 32, whole groups; scales float or halves)? */
static int layout_ok(int64_t group, int64_t half_scales, int64_t bits, int64_t block, int64_t rows) {
    if (group == 1) return !half_scales;
    return group == 8 && (bits == 4 || bits == 8) && block == 32 && rows % 8 == 0;
}

static int q8_check(const Q8MatmulArgs *a) {
    if (!layout_ok(a->group, a->half_scales, a->bits, a->block, a->rows)) return -6;
    if (a->block != 16 && a->block != 32) return -1;
    if (a->k <= 0 || a->k % 32 || a->rows < 0 || a->ntok < 1) return -2;
    if (q8_check_quant(a->kind, a->k)) return -2;
    if (a->block == 16 && a->kind != Q8_K) return -1;
    if (!(a->bits == 8 || (a->bits == 4 && a->bias >= 0 && a->bias <= 15))) return -5;
    return 0;
}


#if Q8_SIMD
/* R rows (from r0) x T tokens (from t0) of one item for one weight format; every argument but
 * the pointers is a constant at each call site, so the loops unroll and the accumulators stay in
 * registers. One block's codes are unpacked once for all T tokens and one token's codes are read
 * for all R rows. Each (row, token) sum is one 8-lane accumulator taking the blocks in order, so
 * neither the tile shape nor the step's other tokens change a result (batch invariance); R rows
 * give the FMA unit R * T independent chains. res[i * T + t]. */
static inline __attribute__((always_inline)) void q8_tile(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
        int bits, int signed_w, int block32, int dshift, float *res) {
    const int64_t k = a->k, nb32 = k / 32, nbw = k / a->block, nd = dshift ? k / QK : nb32;
    const int64_t rowbytes = k * bits / 8;
    const int bias = (int)a->bias;
    const uint8_t *q0 = (const uint8_t *)a->q + r0 * rowbytes;
    const float *s0 = a->scale + r0 * nbw;
    const uint8_t *pf = q0 + PREFETCH_ROWS * rowbytes;
    prefetch_span(s0 + PREFETCH_ROWS * nbw, R * nbw * (int64_t)sizeof(float));
    if (a->offset) prefetch_span(a->offset + (r0 + PREFETCH_ROWS) * nbw, R * nbw * (int64_t)sizeof(float));
    const int64_t step = R * bits * 4;          /* the tile's code bytes per block */
    __m256 acc[4][4];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb32; b++) {
        for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + b * step + off);
        for (int i = 0; i < R; i++) {
            const __m256i w = q8_weight32(q0 + i * rowbytes, b, bits, signed_w && bits == 4 ? bias : 0);
            const __m256i wu = signed_w ? _mm256_abs_epi8(w) : w;
            const float *sw = s0 + i * nbw;
            const __m256 sv = block32 ? _mm256_set1_ps(sw[b])
                                      : _mm256_set_m128(_mm_set1_ps(sw[2 * b + 1]), _mm_set1_ps(sw[2 * b]));
            for (int t = 0; t < T; t++) {
                const int8_t *xq = x->q + (t0 + t) * k + b * 32;
                const __m256i iv = q8_dot32(wu, w, _mm256_loadu_si256((const __m256i *)xq), signed_w);
                const __m256 f = _mm256_mul_ps(sv, _mm256_set1_ps(x->d[(t0 + t) * nd + (b >> dshift)]));
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), f, acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) res[i * T + t] = q8_hsum8(acc[i][t]);
}
#else
/* portable: one (row, token) at a time, the same block order */
static inline void q8_tile(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
                           int bits, int signed_w, int block32, int dshift, float *res) {
    (void)signed_w;
    const int64_t k = a->k, nb32 = k / 32, nbw = k / a->block, nd = dshift ? k / QK : nb32;
    for (int i = 0; i < R; i++) {
        const void *qrow = (const uint8_t *)a->q + (r0 + i) * (k * bits / 8);
        const float *sw = a->scale + (r0 + i) * nbw;
        for (int t = 0; t < T; t++) {
            const int8_t *xq = x->q + (t0 + t) * k;
            const float *dx = x->d + (t0 + t) * nd;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb32; b++) {
                int32_t is[2];
                q8_block_isums(qrow, b, bits, (int)a->bias, xq, is);
                const float db = dx[b >> dshift];
                if (block32) sum += sw[b] * db * (float)(is[0] + is[1]);
                else sum += sw[2 * b] * db * (float)is[0] + sw[2 * b + 1] * db * (float)is[1];
            }
            res[i * T + t] = sum;
        }
    }
}
#endif

/* The tile's results plus the offset term (per row and token, in block order), into y. */
static __attribute__((noinline, noclone)) void q8_store(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
                            const float *res) {
    const int64_t nbw = a->k / a->block;
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) {
            float v = res[i * T + t];
            if (a->offset) {
                v += dot_f32(a->offset + (r0 + i) * nbw, x->xs + (t0 + t) * nbw, nbw);
            }
            a->y[(t0 + t) * a->ldy + r0 + i] = v;
        }
}

/* Rows r0 .. r0+nr of an item against all its tokens: tokens four at a time (two rows a tile),
 * fewer tokens with more rows a tile; rows left over one at a time. */
static inline __attribute__((always_inline)) void q8_chunk_fmt(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int64_t nr,
        int bits, int signed_w, int block32, int dshift) {
    float res[16];
#define Q8_TILES(T, R) do { \
        int64_t i = 0; \
        for (; i + (R) <= nr; i += (R)) { \
            q8_tile(a, x, r0 + i, (R), t0, (T), bits, signed_w, block32, dshift, res); \
            q8_store(a, x, r0 + i, (R), t0, (T), res); \
        } \
        for (; i < nr; i++) { \
            q8_tile(a, x, r0 + i, 1, t0, (T), bits, signed_w, block32, dshift, res); \
            q8_store(a, x, r0 + i, 1, t0, (T), res); \
        } \
    } while (0)
    for (int64_t t0 = 0; t0 < a->ntok;) {
        const int64_t left = a->ntok - t0;
        if (left >= 4) { Q8_TILES(4, 2); t0 += 4; }
        else if (left == 3) { Q8_TILES(3, 2); t0 += 3; }
        else if (left == 2) { Q8_TILES(2, 4); t0 += 2; }
        else { Q8_TILES(1, 4); t0 += 1; }
    }
#undef Q8_TILES
}

/* One chunk of rows, dispatched on the weight format (the combinations the GGUF types give:
 * 8-bit codes; nibbles with or without a bias; blocks of 32 or 16 weights; activation scales
 * per 32 or per 256). */
static void q8_chunk(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int64_t nr) {
    const int bits = (int)a->bits, block32 = a->block == 32, dshift = a->kind == Q8_K ? 3 : 0;
    const int signed_w = !(bits == 4 && a->bias == 0);
#define Q8_FMT(B, S) do { \
        if (block32 && !dshift) q8_chunk_fmt(a, x, r0, nr, (B), (S), 1, 0); \
        else if (block32) q8_chunk_fmt(a, x, r0, nr, (B), (S), 1, 3); \
        else q8_chunk_fmt(a, x, r0, nr, (B), (S), 0, 3); \
    } while (0)
    if (bits == 8) Q8_FMT(8, 1);
    else if (signed_w) Q8_FMT(4, 1);
    else Q8_FMT(4, 0);
#undef Q8_FMT
}

/* ---- the row-group layout (group 8; 4- or 8-bit codes, blocks of 32)
 * Rows come in groups of 8. Group g's block b is 32 * bits bytes at q + (g * nb + b) * 32 * bits:
 * 8-bit codes, eight 32-byte words, word j holding codes 4j .. 4j+3 of each of the group's rows
 * in turn (bytes r*4 .. r*4+3: row 8g+r); nibbles, four words, word j holding nibble bytes
 * 4j .. 4j+3 of each row (low nibbles: elements 4j..4j+3; high: 16+4j..16+4j+3). Scales (and
 * offsets) are 8 a (group, block): scale[(g * nb + b) * 8 + r].
 * Why: with a row in each 32-bit lane, one byte-multiply instruction serves 8 rows, and the
 * integer sums land one row a lane, so the scales apply to 8 rows with one multiply, no
 * horizontal sums, and a group's bytes are one sequential stream (one prefetch stream, not 8).
 * llama.cpp repacks weights for the same reasons (its q4_0_8x8 layouts). */
#if Q8_SIMD
/* A group's block as 8 words of unsigned bytes `u` (nibbles; |code| for 8-bit codes, whose
 * signs are in `w`) in the order q8x8_isum takes them. */
static inline __attribute__((always_inline)) void q8x8_unpack(const uint8_t *gb, int bits, __m256i u[8], __m256i w[8]) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(gb + 32 * j));
            u[j] = _mm256_abs_epi8(w[j]);
        }
        return;
    }
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 32 * j));
        u[j] = _mm256_and_si256(v, m);
        u[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    }
}

/* The exact int32 sums of one group's block against 32 activation codes, one row a lane:
 * sum_i code[r][i] * x[i], less bias * sum_i x[i] for nibbles. Word j of `u` meets codes 4j..4j+3
 * of x (the nibbles' high words: 16+4(j-4)..). Unsigned nibbles (<= 15) times codes (|x| <= 127)
 * add up in 16-bit lanes: 8 byte pairs sum to at most 8 * 2 * 15 * 127 = 30480, no saturation;
 * 8-bit codes (pairs up to 2 * 127 * 127) widen to 32 bits after each word. */
static inline __attribute__((always_inline)) __m256i q8x8_isum(const __m256i u[8], const __m256i w[8], int bits,
                                                               const int8_t *xb, int32_t bias_xsum) {
    int32_t xw[8];
    memcpy(xw, xb, 32);
    __m256i iv = _mm256_setzero_si256();
    if (bits == 8) {
        for (int j = 0; j < 8; j++) {
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xw[j]), w[j]);
#ifdef DPBUSD
            iv = DPBUSD(iv, u[j], xs);
#else
            iv = _mm256_add_epi32(iv, _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], xs), _mm256_set1_epi16(1)));
#endif
        }
        return iv;
    }
#ifdef DPBUSD
    for (int j = 0; j < 8; j++) iv = DPBUSD(iv, u[j], _mm256_set1_epi32(xw[j]));
#else
    __m256i p = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(xw[0]));
    for (int j = 1; j < 8; j++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(xw[j])));
    iv = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
    return bias_xsum ? _mm256_sub_epi32(iv, _mm256_set1_epi32(bias_xsum)) : iv;
}
#else
static inline void q8x8_isum_c(const uint8_t *gb, int bits, const int8_t *xb, int32_t bias_xsum, int32_t out[8]) {
    for (int r = 0; r < 8; r++) {
        int32_t s = 0;
        if (bits == 8) {
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++) s += (int32_t)(int8_t)gb[32 * j + 4 * r + c] * xb[4 * j + c];
        } else {
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 4; c++) {
                    const uint8_t byte = gb[32 * j + 4 * r + c];
                    s += (int32_t)(byte & 0x0F) * xb[4 * j + c] + (int32_t)(byte >> 4) * xb[16 + 4 * j + c];
                }
        }
        out[r] = s - bias_xsum;
    }
}
#endif

/* Scale (or offset) i of a row-group weight: float32, or an IEEE half (types whose scales are
 * halves in the GGUF file keep them so: the same values in half the bytes). */
static inline float scale_at(const uint8_t *p, int64_t i, int half) {
    if (half) {
        uint16_t h;
        memcpy(&h, p + 2 * i, sizeof h);
        return half_to_float(h);
    }
    float f;
    memcpy(&f, p + 4 * i, sizeof f);
    return f;
}

#if Q8_SIMD
static inline __attribute__((always_inline)) __m256 q8x8_scales(const uint8_t *p, int half) {
    if (!half) return _mm256_loadu_ps((const float *)p);
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int r = 0; r < 8; r++) f[r] = scale_at(p, r, 1);
    return _mm256_loadu_ps(f);
#endif
}
#endif

/* The integer sum of x's codes over block b times the nibble bias (0 without one). */
static inline int32_t q8x8_bias_xsum(const Q8Act *x, int64_t t, int64_t k, int64_t b, int bias) {
    if (!bias) return 0;
    const int32_t *is = x->isum + t * (k / 16) + 2 * b;
    return bias * (is[0] + is[1]);
}

/* Group g (rows 8g .. 8g+7) against tokens t0 .. t0+T-1: per token, one 8-lane accumulator for
 * the scaled integer sums and one for the offset term, each taking the blocks in order, so a
 * (row, token) result depends on neither T nor the group's other rows (batch invariance). */
static inline __attribute__((always_inline)) void q8x8_tile(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int T, int bits, int dshift, int has_off,
        int half) {
    const int64_t k = a->k, nb = k / 32, nd = dshift ? k / QK : nb, gbytes = 32 * bits;
    const int bias = (int)a->bias;
    const uint8_t *q = (const uint8_t *)a->q + g * nb * gbytes;
    const int64_t sb = half ? 2 : 4;      /* bytes a scale */
    const uint8_t *s = (const uint8_t *)a->scale + g * nb * 8 * sb;
    const uint8_t *m = has_off ? (const uint8_t *)a->offset + g * nb * 8 * sb : NULL;
#if Q8_SIMD
    __m256 acc[4], off[4];
    for (int t = 0; t < T; t++) acc[t] = off[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t off = 0; off < gbytes; off += 64) __builtin_prefetch(q + (b + 16) * gbytes + off);
        if (!(b & (half ? 3 : 1))) {
            __builtin_prefetch(s + (b + 16) * 8 * sb);
            if (has_off) __builtin_prefetch(m + (b + 16) * 8 * sb);
        }
        __m256i u[8], w[8];
        q8x8_unpack(q + b * gbytes, bits, u, w);
        const __m256 sv = q8x8_scales(s + b * 8 * sb, half);
        const __m256 mv = has_off ? q8x8_scales(m + b * 8 * sb, half) : _mm256_setzero_ps();
        for (int t = 0; t < T; t++) {
            const int64_t tt = t0 + t;
            const __m256i iv = q8x8_isum(u, w, bits, x->q + tt * k + b * 32, q8x8_bias_xsum(x, tt, k, b, bias));
            const __m256 f = _mm256_mul_ps(sv, _mm256_set1_ps(x->d[tt * nd + (b >> dshift)]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), f, acc[t]);
            if (has_off) off[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x->xs[tt * nb + b]), off[t]);
        }
    }
    for (int t = 0; t < T; t++) {
        float v[8];
        _mm256_storeu_ps(v, has_off ? _mm256_add_ps(acc[t], off[t]) : acc[t]);
        float *y = a->y + (t0 + t) * a->ldy + g * 8;
        memcpy(y, v, sizeof v);
    }
#else
    for (int t = 0; t < T; t++) {
        const int64_t tt = t0 + t;
        float acc[8] = {0}, off[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t is[8];
            q8x8_isum_c(q + b * gbytes, bits, x->q + tt * k + b * 32, q8x8_bias_xsum(x, tt, k, b, bias), is);
            const float db = x->d[tt * nd + (b >> dshift)];
            for (int r = 0; r < 8; r++) {
                acc[r] += (float)is[r] * (scale_at(s, b * 8 + r, half) * db);
                if (has_off) off[r] += scale_at(m, b * 8 + r, half) * x->xs[tt * nb + b];
            }
        }
        for (int r = 0; r < 8; r++) a->y[tt * a->ldy + g * 8 + r] = has_off ? acc[r] + off[r] : acc[r];
    }
#endif
}

static inline __attribute__((always_inline)) void q8x8_group_fmt(const Q8MatmulArgs *a, const Q8Act *x, int64_t g,
                                                                 int bits, int dshift, int has_off, int half) {
    for (int64_t t0 = 0; t0 < a->ntok;) {
        const int64_t left = a->ntok - t0;
        const int T = left >= 4 ? 4 : (int)left;
        if (T == 4) q8x8_tile(a, x, g, t0, 4, bits, dshift, has_off, half);
        else if (T == 3) q8x8_tile(a, x, g, t0, 3, bits, dshift, has_off, half);
        else if (T == 2) q8x8_tile(a, x, g, t0, 2, bits, dshift, has_off, half);
        else q8x8_tile(a, x, g, t0, 1, bits, dshift, has_off, half);
        t0 += T;
    }
}

static void q8x8_group(const Q8MatmulArgs *a, const Q8Act *x, int64_t g) {
    const int dshift = a->kind == Q8_K ? 3 : 0;
    /* the formats the GGUF types give: Q8_0 (8-bit, half scales); Q4_0 / Q4_1 (nibbles, half
     * scales, with a bias or an offset); Q4_K (nibbles, float scales and offsets, Q8_K x) */
    if (a->bits == 8) {
        if (a->half_scales && !a->offset && !dshift) q8x8_group_fmt(a, x, g, 8, 0, 0, 1);
        else q8x8_group_fmt(a, x, g, 8, dshift, a->offset != NULL, (int)a->half_scales);
    } else if (a->half_scales && !dshift) {
        if (a->offset) q8x8_group_fmt(a, x, g, 4, 0, 1, 1); else q8x8_group_fmt(a, x, g, 4, 0, 0, 1);
    } else if (dshift && a->offset && !a->half_scales) {
        q8x8_group_fmt(a, x, g, 4, 3, 1, 0);
    } else {
        q8x8_group_fmt(a, x, g, 4, dshift, a->offset != NULL, (int)a->half_scales);
    }
}

/* Bytes of one item's quantized activations in the call's scratch. */
static size_t q8_act_bytes(const Q8MatmulArgs *a) {
    const int64_t k = a->k, n = a->ntok;
    return (size_t)(n * k) + sizeof(float) * (size_t)(n * (k / 32) * 2 + n * (k / a->block))
           + sizeof(int32_t) * (size_t)(n * (k / 16)) + 64;
}

/* Quantize item i's activations into the scratch at *at, or reuse those of an earlier item
 * that reads the same rows the same way (Q, K and V read one normed x). */
static void q8_prepare_act(const Q8MatmulGroup *g, int64_t i, Q8Act *acts, char **at) {
    const Q8MatmulArgs *a = g->items[i];
    for (int64_t j = 0; j < i; j++) {
        const Q8MatmulArgs *b = g->items[j];
        if (b->x == a->x && b->ldx == a->ldx && b->ntok == a->ntok && b->k == a->k && b->kind == a->kind
            && b->block == a->block && (b->offset != NULL) == (a->offset != NULL)) {
            acts[i] = acts[j];
            return;
        }
    }
    const int64_t k = a->k, n = a->ntok, nbw = k / a->block, nd = a->kind == Q8_K ? k / QK : k / 32;
    char *p = *at;
    Q8Act *x = &acts[i];
    x->d = (float *)p; p += sizeof(float) * (size_t)(n * (k / 32));
    x->s = (float *)p; p += sizeof(float) * (size_t)(n * (k / 32));
    x->xs = (float *)p; p += sizeof(float) * (size_t)(n * nbw);
    x->isum = (int32_t *)p; p += sizeof(int32_t) * (size_t)(n * (k / 16));
    x->q = (int8_t *)p; p += (size_t)(n * k);
    *at = (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    for (int64_t t = 0; t < n; t++)
        q8_quantize_row(a->kind, k, a->x + t * a->ldx, x->q + t * k, x->d + t * nd, x->s + t * (k / 32),
                        x->isum + t * (k / 16));
    if (!a->offset) {
        x->xs = NULL;
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < nbw; b++) {
            float v;
            if (a->kind == Q8_1) {
                v = x->s[t * (k / 32) + b];                              /* llama.cpp's f16 s */
            } else {
                const int32_t *is = x->isum + t * (k / 16);
                const int32_t sum = a->block == 16 ? is[b] : is[2 * b] + is[2 * b + 1];
                v = x->d[t * nd + b * a->block / QK] * (float)sum;
            }
            x->xs[t * nbw + b] = v;
        }
}

int metatp_q8_matmul(const Q8MatmulGroup *g) {
    const int64_t n = g->n;
    if (n < 1 || n > MAX_ITEMS) return -4;
    int64_t first_chunk[MAX_ITEMS + 1], work = 0;
    size_t bytes = 64;
    first_chunk[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const Q8MatmulArgs *a = g->items[i];
        const int rc = q8_check(a);
        if (rc) return rc;
        first_chunk[i + 1] = first_chunk[i] + (a->group == 8 ? a->rows / 8 : (a->rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
        work += a->rows * a->k * a->ntok;
        bytes += q8_act_bytes(a);
    }
    char *scratch = (char *)malloc(bytes);
    if (!scratch) return -3;
    Q8Act acts[MAX_ITEMS];
    char *at = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (int64_t i = 0; i < n; i++) q8_prepare_act(g, i, acts, &at);
    const int nthreads = work < (int64_t)1 << 17 ? 1 : (int)g->nthreads;
    const int64_t total = first_chunk[n];
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t c = 0; c < total; c++) {
        int64_t i = 0;
        while (c >= first_chunk[i + 1]) i++;
        const Q8MatmulArgs *a = g->items[i];
        if (a->group == 8) {
            q8x8_group(a, &acts[i], c - first_chunk[i]);
            continue;
        }
        const int64_t r0 = (c - first_chunk[i]) * CHUNK_ROWS, left = a->rows - r0;
        q8_chunk(a, &acts[i], r0, left < CHUNK_ROWS ? left : CHUNK_ROWS);
    }
    free(scratch);
    return 0;
}

/* For the tests: the exact int32 sums per (token, row, 16-element half-block) of item g->items[0]
 * against activations already quantized by metatp_q8_quantize (codes in `xq`, ntok * k). */
typedef struct {
    const Q8MatmulArgs *w;
    const int8_t *xq;
    int32_t *out;          /* ntok * rows * (k/16) */
} Q8IsumArgs;

int metatp_q8_isums(const Q8IsumArgs *a) {
    const Q8MatmulArgs *w = a->w;
    const int64_t k = w->k;
    if (w->k <= 0 || w->k % 32 || !(w->bits == 8 || w->bits == 4)) return -2;
    if (w->group != 1) {
        if (!layout_ok(w->group, w->half_scales, w->bits, w->block, w->rows)) return -6;
        const int64_t nb = k / 32, gbytes = 32 * w->bits;
        const int bits = (int)w->bits;
        for (int64_t t = 0; t < w->ntok; t++)
            for (int64_t g = 0; g < w->rows / 8; g++)
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *xb = a->xq + t * k + b * 32;
                    int32_t xsum = 0;
                    for (int i = 0; i < 32; i++) xsum += xb[i];
                    const uint8_t *gb = (const uint8_t *)w->q + (g * nb + b) * gbytes;
                    int32_t is[8];
#if Q8_SIMD
                    __m256i uv[8], wv[8];
                    q8x8_unpack(gb, bits, uv, wv);
                    _mm256_storeu_si256((__m256i *)is, q8x8_isum(uv, wv, bits, xb, (int32_t)w->bias * xsum));
#else
                    q8x8_isum_c(gb, bits, xb, (int32_t)w->bias * xsum, is);
#endif
                    for (int r = 0; r < 8; r++) a->out[(t * w->rows + g * 8 + r) * nb + b] = is[r];
                }
        return 0;
    }
    for (int64_t t = 0; t < w->ntok; t++)
        for (int64_t r = 0; r < w->rows; r++) {
            const void *qrow = (const uint8_t *)w->q + r * (k * w->bits / 8);
            for (int64_t b = 0; b < k / 32; b++)
                q8_block_isums(qrow, b, (int)w->bits, (int)w->bias, a->xq + t * k,
                               a->out + (t * w->rows + r) * (k / 16) + 2 * b);
        }
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

/* ------------------------------------------------------------------ KV cache types
 * A cache row is stored as float32, IEEE half, bfloat16 or llama.cpp blocks of 32 (ids are
 * GGML type ids). Rows are written with llama.cpp's reference rounding (gguf.quants, the numpy
 * oracle: round-half-away for q8_0, truncation after +x.5 for the 4/5-bit types, round to
 * nearest even for f16 and bf16) and read back with gguf's dequantization, both without
 * fused multiply-adds so the bits are gguf's. */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_BF16 = 30 };

/* bytes of one row of n values of a cache type (n whole blocks), or -1 for a type not taken */
static int64_t kv_row_bytes(int64_t type, int64_t n) {
    switch (type) {
        case T_F32: return 4 * n;
        case T_F16: case T_BF16: return 2 * n;
        default: break;
    }
    if (n % 32) return -1;
    switch (type) {
        case T_Q8_0: return n / 32 * 34;
        case T_Q4_0: return n / 32 * 18;
        case T_Q4_1: return n / 32 * 20;
        case T_Q5_0: return n / 32 * 22;
        case T_Q5_1: return n / 32 * 24;
        default: return -1;
    }
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t h; memcpy(&h, p, sizeof h); return h; }
static inline void wr16(uint8_t *p, uint16_t h) { memcpy(p, &h, sizeof h); }

/* The 4- and 5-bit types: q0 = nibble (| high bit << 4); Q4_0/Q5_0 (q0 - 8|16) * d, Q4_1/Q5_1
 * d * q0 + m rounded twice (a product, then a sum) as gguf does: no FMA here. */
__attribute__((optimize("fp-contract=off")))
static void kv_dequant_nibbles(int64_t type, const uint8_t *p, int64_t n, float *out) {
    const int five = type == T_Q5_0 || type == T_Q5_1, one = type == T_Q4_1 || type == T_Q5_1;
    const int bsz = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    const int bias = one ? 0 : five ? 16 : 8;
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = p + bsz * b, *qs = blk + 2 + 2 * one + 4 * five;
        const float d = half_to_float(rd16(blk)), m = one ? half_to_float(rd16(blk + 2)) : 0.0f;
        uint32_t qh = 0;
        if (five) memcpy(&qh, blk + 2 + 2 * one, sizeof qh);
        float *o = out + 32 * b;
        if (one) {
            for (int j = 0; j < 16; j++) {
                o[j] = (float)((qs[j] & 0x0F) | (int)((qh >> j) & 1u) << 4) * d + m;
                o[j + 16] = (float)((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) * d + m;
            }
        } else {
            for (int j = 0; j < 16; j++) {
                o[j] = (float)(((qs[j] & 0x0F) | (int)((qh >> j) & 1u) << 4) - bias) * d;
                o[j + 16] = (float)(((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - bias) * d;
            }
        }
    }
}

/* n values of a cache row -> floats (gguf's dequantize_blocks, bit for bit: the other types
 * take one product per value, so nothing can be fused) */
static inline void kv_dequant_row(int64_t type, const uint8_t *p, int64_t n, float *out) {
    if (type == T_F16 || type == T_BF16) {
        const uint16_t *h = (const uint16_t *)p;
        int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
        for (; i + 8 <= n; i += 8) {          /* 8-float registers (see qmm_tile) */
            __m256 v;
            halves8_to_f32(h + i, type == T_BF16, &v);
            _mm256_storeu_ps(out + i, v);
        }
#else
        for (; i + UNIT <= n; i += UNIT) {
            const v16f v = load_halves(h + i, type == T_BF16);
            memcpy(out + i, &v, sizeof v);
        }
#endif
        for (; i < n; i++) {
            if (type == T_F16) {
                out[i] = half_to_float(h[i]);
            } else {
                const uint32_t bits = (uint32_t)h[i] << 16;
                memcpy(out + i, &bits, sizeof bits);
            }
        }
        return;
    }
    if (type != T_Q8_0) {
        kv_dequant_nibbles(type, p, n, out);
        return;
    }
    for (int64_t b = 0; b < n / 32; b++) {        /* Q8_0; plain loops: gcc vectorizes them best */
        const uint8_t *blk = p + 34 * b;
        const int8_t *qs = (const int8_t *)blk + 2;
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))     /* builds that include immintrin.h */
        const float d = _cvtsh_ss(rd16(blk));      /* the same value, one instruction */
#else
        const float d = half_to_float(rd16(blk));
#endif
        for (int j = 0; j < 32; j++) out[32 * b + j] = (float)qs[j] * d;
    }
}

/* n floats -> one cache row (gguf's quantize_blocks, bit for bit: float32 arithmetic, no FMA) */
__attribute__((optimize("fp-contract=off")))
static void kv_quant_row(int64_t type, const float *x, int64_t n, uint8_t *p) {
    if (type == T_F16 || type == T_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            if (type == T_F16) {
                h = float_to_half_bits(x[i]);
            } else {                        /* ggml_compute_fp32_to_bf16: quiet nan, nearest even */
                uint32_t u;
                memcpy(&u, x + i, sizeof u);
                if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = (u & 0xFFFF0000u) | (64u << 16);
                h = (uint16_t)(((uint64_t)u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            }
            wr16(p + 2 * i, h);
        }
        return;
    }
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        if (type == T_Q8_0) {
            uint8_t *blk = p + 34 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            wr16(blk, float_to_half_bits(d));
            for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)roundf(xb[j] * id);
            continue;
        }
        const int five = type == T_Q5_0 || type == T_Q5_1, one = type == T_Q4_1 || type == T_Q5_1;
        const int qmax = five ? 31 : 15;
        float d, mn = 0.0f, add;
        if (one) {                                  /* d = (max - min) / qmax, q = (x - min) / d */
            float mx = xb[0];
            mn = xb[0];
            for (int j = 1; j < 32; j++) { mx = xb[j] > mx ? xb[j] : mx; mn = xb[j] < mn ? xb[j] : mn; }
            d = (mx - mn) / (float)qmax;
            add = 0.5f;
        } else {                                    /* d = (signed max |x|) / -(qmax + 1) / 2 */
            float amax = 0.0f, mx = 0.0f;
            for (int j = 0; j < 32; j++)
                if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); mx = xb[j]; }
            d = mx / (five ? -16.0f : -8.0f);
            add = five ? 16.5f : 8.5f;
        }
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int q[32];
        for (int j = 0; j < 32; j++) {
            const float v = one ? (xb[j] - mn) * id + add : xb[j] * id + add;
            const int c = (int)truncf(v);
            q[j] = c < 0 ? 0 : c > qmax ? qmax : c;
        }
        uint8_t *blk = p + (int64_t)(type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24) * b;
        uint8_t *at = blk;
        wr16(at, float_to_half_bits(d));
        at += 2;
        if (one) { wr16(at, float_to_half_bits(mn)); at += 2; }
        if (five) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; j++) qh |= (uint32_t)(q[j] >> 4) << j;
            memcpy(at, &qh, sizeof qh);
            at += 4;
        }
        for (int j = 0; j < 16; j++) at[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
    }
}

/* For the tests: rows of floats -> cache rows, and back. */
typedef struct {
    int64_t type, rows, n;
    const float *x;
    uint8_t *q;
    float *out;       /* NULL: quantize x into q; else dequantize q into out */
} KvConvertArgs;

int metatp_kv_convert(const KvConvertArgs *a) {
    const int64_t rb = kv_row_bytes(a->type, a->n);
    if (rb < 0 || a->type == T_F32) return -1;
    for (int64_t r = 0; r < a->rows; r++) {
        if (a->out) kv_dequant_row(a->type, a->q + r * rb, a->n, a->out + r * a->n);
        else kv_quant_row(a->type, a->x + r * a->n, a->n, a->q + r * rb);
    }
    return 0;
}

/* ------------------------------------------------------------------ attention
 * Softmax attention of a few queries over a KV cache, at memory speed: decode reads the whole
 * cache every step (at a depth of 1536 tokens as many bytes as the weights), so
 *  - every K and V row is read (and, for a 16-bit or quantized cache, dequantized) once per step
 *    per KV head: all the query rows that share a KV head (its query heads x the step's tokens,
 *    GQA) are scored against a row while it is in L1;
 *  - the cache is streamed in blocks of KV_BLOCK rows with an online softmax (running max m,
 *    running sum l, output rescaled when m grows), so nothing of length n_kv is kept;
 *  - the KV length is cut into chunks of ATTN_CHUNK rows at absolute multiples of ATTN_CHUNK;
 *    the OpenMP threads share the (KV head, chunk) units; each unit leaves (m, l, unnormalized
 *    output) per query row, merged afterwards in chunk order with a log-sum-exp.
 * Batch invariance: chunks and blocks sit at fixed cache positions (not derived from n_kv, T or
 * the thread count), a query row whose mask hides a whole chunk is skipped there, a hidden block
 * leaves a row's state exactly as it was, and every row's arithmetic is its own; so a row's output
 * depends only on its query, its visible cells and their positions modulo ATTN_CHUNK. A sequence
 * whose first cell is a multiple of ATTN_CHUNK gets the same bits alone or among others.
 * q (H, T, D) float32: q[h*q_sh + t*q_st + d]; k/v (Hkv, n_kv, D|Dv) cache rows of type k_type/
 * v_type at byte strides: row (g, j) at k + g*k_sh + j*k_sj; mask (T, n_kv) additive or NULL:
 * mask[t*m_st + j]; sinks (H) or NULL; out (T, H, Dv): out[t*o_st + h*o_sh + d]. Query head h
 * reads kv head h / (H/Hkv). softcap > 0: s = softcap*tanh(s/softcap) before the mask.
 * scratch: Hkv * max_chunks * (H/Hkv) * T * (Dv + 2) + nthreads * (H/Hkv) * T * KV_BLOCK floats,
 * max_chunks >= ceil(n_kv / ATTN_CHUNK). */

enum { KV_BLOCK = 64, ATTN_CHUNK = 128, KV_PREFETCH = 16 };

int metatp_attn_chunk(void) { return ATTN_CHUNK; }

typedef float v8f_a __attribute__((vector_size(32), aligned(4)));   /* unaligned 8-float loads */

/* Float loads of a (dequantized) cache row. */
static inline v8f kv_load8(const float *row, int64_t d) {
    return *(const v8f_a *)(row + d);
}
static inline float kv_load1(const float *row, int64_t d) {
    return row[d];
}

/* Cache row j of a head as floats: the row itself for float32, else dequantized into buf. */
static inline const float *kv_row(int64_t type, const uint8_t *head, int64_t j, int64_t stride, int64_t n,
                                  float *buf) {
    const uint8_t *p = head + j * stride;
    if (type == T_F32) return (const float *)p;
    kv_dequant_row(type, p, n, buf);
    return buf;
}

static inline float hsum8(v8f v) {
    v4f l, h;
    memcpy(&l, &v, sizeof l);
    memcpy(&h, (const char *)&v + sizeof l, sizeof h);
    const v4f b = l + h;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef struct {
    int64_t T, H, Hkv, D, Dv, n_kv;   /* n_kv: the visible cache rows, set before each call */
    const float *q;
    int64_t q_sh, q_st;
    const void *k;
    int64_t k_sh, k_sj, k_type;       /* byte strides */
    const void *v;
    int64_t v_sh, v_sj, v_type;
    const float *mask;
    int64_t m_st;
    float scale, softcap;
    const float *sinks;
    float *out;
    int64_t o_st, o_sh;
    float *scratch;
    int64_t max_chunks, nthreads;
} AttentionArgs;

/* out[e] = q . k_e over the first D8 (a multiple of 8) elements, for eight rows k_e: one
 * accumulator per row, then one transpose-and-add (each row's lanes are summed among themselves
 * in a fixed tree, whatever the other rows hold). */
static inline void dot8_rows(const float *q, const float *const k[8], int64_t D8, float out[8]) {
    v8f acc[8];
    for (int e = 0; e < 8; e++) acc[e] = (v8f){0};
    for (int64_t d = 0; d < D8; d += 8) {
        const v8f qv = *(const v8f_a *)(q + d);
        for (int e = 0; e < 8; e++) acc[e] += qv * kv_load8(k[e], d);
    }
#if defined(__AVX2__) || defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]), t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]), t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, sum);
#else
    for (int e = 0; e < 8; e++) {      /* the same tree as above, lane by lane */
        const v8f v = acc[e];
        out[e] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for 8 floats, |rel error| < 2e-7 (Cephes' expf: x = n ln2 + r, a degree-5 polynomial
 * in r, 2^n in the exponent bits). x is clamped to [-87.3, 88.7] (finite, normal results): the
 * callers need nothing below (attention zeroes it) or above (SiLU's 1 + exp(-x) is then as good as
 * infinite). Why: glibc's scalar expf, one call an element, was ~3 ms of a decode step at depth
 * 1536 (attention's softmax) and 0.3 ms at any depth (SiLU). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* sr[j] = exp(sr[j] - m) for j < n8 (a multiple of 8: the padding past a block's n cells holds
 * -inf), and the sum of the first n in cell order. Scores of -inf (masked cells) give exact
 * zeros, and a sum in cell order does not change when exact zeros come between its terms: a
 * sequence's cells give the same bits wherever they sit in a block, and whatever else the block
 * holds (batch invariance; a sum in 8 lanes would depend on each cell's position mod 8). Why
 * vectorized: the scalar expf here was ~3 ms of a decode step at depth 1536 (one call a score). */
static float softmax8(float *sr, int64_t n, int64_t n8, float m) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f);
    for (int64_t j = 0; j < n8; j += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sr + j), mv);
        /* below lo (and -inf): 0; NaN stays NaN (x - x), as expf would keep it */
        const __m256 e = _mm256_and_ps(_mm256_add_ps(exp8(x), _mm256_sub_ps(x, x)), _mm256_cmp_ps(x, lo, _CMP_NLT_UQ));
        _mm256_storeu_ps(sr + j, e);
    }
#else
    for (int64_t j = 0; j < n8; j++) {
        const float x = sr[j] - m;
        sr[j] = x < -87.3f ? 0.0f : expf(x);
    }
#endif
    float l = 0.0f;
    for (int64_t j = 0; j < n; j++) l += sr[j];
    return l;
}

/* One unit: KV head g, cache rows [j0, j1) (one chunk), the G = gsize*T query rows of that head
 * that see any of those rows. part: G rows of (m, l, acc[Dv]); sbuf: G * KV_BLOCK scores. */
static void attn_unit(const AttentionArgs *a, int64_t g, int64_t j0, int64_t j1, float *part, float *sbuf) {
    const int64_t T = a->T, D = a->D, Dv = a->Dv, gsize = a->H / a->Hkv, G = gsize * T, P = Dv + 2;
    const uint8_t *kh = (const uint8_t *)a->k + g * a->k_sh, *vh = (const uint8_t *)a->v + g * a->v_sh;
    const float scale = a->scale, softcap = a->softcap;
    const int64_t D8 = D - D % 8, Dv8 = Dv - Dv % 8, Dv32 = Dv - Dv % 32, vst = Dv + 16, kst = D + 16;
    const int64_t krow_bytes = kv_row_bytes(a->k_type, D), vrow_bytes = kv_row_bytes(a->v_type, Dv);
    float kbuf[8 * kst];              /* dequantized K rows of a group of eight */
    float *vblock = (float *)malloc(sizeof(float) * (size_t)(KV_BLOCK * vst));     /* dequantized V rows */
    const float *vrows[KV_BLOCK];
    int64_t rows[G], na = 0;
    unsigned char seen[T];
    for (int64_t t = 0; t < T; t++) {           /* does query t see anything in this chunk? */
        seen[t] = a->mask == NULL;
        for (int64_t j = j0; j < j1 && !seen[t]; j++) seen[t] = a->mask[t * a->m_st + j] != -INFINITY;
    }
    for (int64_t r = 0; r < G; r++) {
        float *pr = part + r * P;
        pr[0] = -INFINITY;                      /* an unseen chunk: skipped by the merge */
        pr[1] = 0.0f;
        if (!seen[r % T]) continue;
        rows[na++] = r;
        for (int64_t d = 0; d < Dv; d++) pr[2 + d] = 0.0f;
    }
    if (na == 0 || !vblock) {
        free(vblock);
        return;
    }
    for (int64_t b0 = j0; b0 < j1; b0 += KV_BLOCK) {
        const int64_t nb = j1 - b0 < KV_BLOCK ? j1 - b0 : KV_BLOCK, nb8 = (nb + 7) & ~(int64_t)7;
        /* scores of the block, eight K rows at a time (each read once for all the unit's query
           rows; eight accumulators hide the FMA latency and are summed by one transpose). A
           missing row of the last group repeats the first and its lanes are dropped, so every
           score is computed the same way wherever the visible cells end. */
        for (int64_t j8 = 0; j8 < nb; j8 += 8) {
            const float *kr[8];
            /* one head's rows are strided by the other heads' rows: streams too short and sparse
               for the hardware prefetcher (in a decode step attention ran at ~3 GB/s) */
            for (int64_t e = 0; e < 8; e++) {
                const int64_t jp = b0 + j8 + KV_PREFETCH + e;
                if (jp < j1 + KV_PREFETCH) {
                    prefetch_span(kh + jp * a->k_sj, krow_bytes);
                    prefetch_span(vh + jp * a->v_sj, vrow_bytes);
                }
            }
            for (int e = 0; e < 8; e++) {
                const int64_t jj = j8 + e < nb ? j8 + e : j8;
                kr[e] = j8 + e < nb || e == 0 ? kv_row(a->k_type, kh, b0 + jj, a->k_sj, D, kbuf + e * kst) : kr[0];
            }
            for (int64_t ia = 0; ia < na; ia++) {
                const int64_t r = rows[ia], i = r / T, t = r % T, h = g * gsize + i;
                const float *qr = a->q + h * a->q_sh + t * a->q_st;
                float sc8[8];
                dot8_rows(qr, kr, D8, sc8);
#if defined(__AVX2__)
                if (D8 == D && softcap <= 0.0f) {
                    /* scale and mask 8 scores at once; the last group of a block takes its mask
                       through a padded copy, so every score goes the same way (no other path) */
                    __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(sc8), _mm256_set1_ps(scale));
                    if (a->mask) {
                        const float *mrow = a->mask + t * a->m_st + b0 + j8;
                        float m8[8] = {0};
                        memcpy(m8, mrow, sizeof(float) * (size_t)(nb - j8 < 8 ? nb - j8 : 8));
                        sv = _mm256_add_ps(sv, _mm256_loadu_ps(m8));
                    }
                    _mm256_storeu_ps(sbuf + ia * KV_BLOCK + j8, sv);      /* lanes past nb: padding */
                    continue;
                }
#endif
                for (int e = 0; e < 8 && j8 + e < nb; e++) {
                    float sc = sc8[e];
                    for (int64_t d = D8; d < D; d++) sc += qr[d] * kv_load1(kr[e], d);
                    sc *= scale;
                    if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                    if (a->mask) sc += a->mask[t * a->m_st + b0 + j8 + e];
                    sbuf[ia * KV_BLOCK + j8 + e] = sc;
                }
            }
        }
        /* online softmax: new running max, rescale, probabilities in place; a block the row
           cannot see changes nothing (its probabilities are exact zeros) */
        for (int64_t ia = 0; ia < na; ia++) {
            float *pr = part + rows[ia] * P, *sr = sbuf + ia * KV_BLOCK;
            for (int64_t jj = nb; jj < nb8; jj++) sr[jj] = -INFINITY;      /* whole vectors: see softmax8 */
            float bm = -INFINITY;
            for (int64_t jj = 0; jj < nb; jj++) bm = sr[jj] > bm ? sr[jj] : bm;
            const float m_new = bm > pr[0] ? bm : pr[0];
            if (m_new == -INFINITY) {                       /* nothing visible yet */
                for (int64_t jj = 0; jj < nb; jj++) sr[jj] = 0.0f;
                continue;
            }
            if (m_new > pr[0]) {
                const float alpha = pr[0] == -INFINITY ? 0.0f : expf(pr[0] - m_new);
                pr[1] *= alpha;
                for (int64_t d = 0; d < Dv; d++) pr[2 + d] *= alpha;
                pr[0] = m_new;
            }
            pr[1] += softmax8(sr, nb, nb8, m_new);
        }
        /* weighted V: the block's V rows read (dequantized) once for all the unit's query rows
           (skipped when no row gives them weight: another sequence's cells cost no V reads); each
           query row then sums them in row order with its accumulator in registers */
        for (int64_t jj = 0; jj < nb; jj++) {
            int any = 0;
            for (int64_t ia = 0; ia < na && !any; ia++) any = sbuf[ia * KV_BLOCK + jj] != 0.0f;
            vrows[jj] = any ? kv_row(a->v_type, vh, b0 + jj, a->v_sj, Dv, vblock + jj * vst) : NULL;
        }
        for (int64_t ia = 0; ia < na; ia++) {
            const float *sr = sbuf + ia * KV_BLOCK;
            float *acc = part + rows[ia] * P + 2;
            int64_t d = 0;
            for (; d < Dv32; d += 32) {
                v8f a0 = *(v8f_a *)(acc + d), a1 = *(v8f_a *)(acc + d + 8);
                v8f a2 = *(v8f_a *)(acc + d + 16), a3 = *(v8f_a *)(acc + d + 24);
                for (int64_t jj = 0; jj < nb; jj++) {
                    const float p = sr[jj];
                    if (p == 0.0f) continue;
                    const float *vr = vrows[jj];
                    const v8f pv = (v8f){p, p, p, p, p, p, p, p};
                    a0 += pv * kv_load8(vr, d);
                    a1 += pv * kv_load8(vr, d + 8);
                    a2 += pv * kv_load8(vr, d + 16);
                    a3 += pv * kv_load8(vr, d + 24);
                }
                *(v8f_a *)(acc + d) = a0;
                *(v8f_a *)(acc + d + 8) = a1;
                *(v8f_a *)(acc + d + 16) = a2;
                *(v8f_a *)(acc + d + 24) = a3;
            }
            for (; d < Dv8; d += 8) {
                v8f a0 = *(v8f_a *)(acc + d);
                for (int64_t jj = 0; jj < nb; jj++) {
                    const float p = sr[jj];
                    if (p == 0.0f) continue;
                    a0 += (v8f){p, p, p, p, p, p, p, p} * kv_load8(vrows[jj], d);
                }
                *(v8f_a *)(acc + d) = a0;
            }
            for (; d < Dv; d++) {
                float a1 = acc[d];
                for (int64_t jj = 0; jj < nb; jj++)
                    if (sr[jj] != 0.0f) a1 += sr[jj] * kv_load1(vrows[jj], d);
                acc[d] = a1;
            }
        }
    }
    free(vblock);
}

#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

int metatp_attention(const AttentionArgs *a) {
    const int64_t T = a->T, H = a->H, Hkv = a->Hkv, Dv = a->Dv, n_kv = a->n_kv;
    if (Hkv <= 0 || H % Hkv || n_kv <= 0 || T <= 0 || a->nthreads < 1) return -1;
    if (kv_row_bytes(a->k_type, a->D) < 0 || kv_row_bytes(a->v_type, Dv) < 0) return -5;
    const int64_t gsize = H / Hkv, G = gsize * T, P = Dv + 2;
    const int64_t nch = (n_kv + ATTN_CHUNK - 1) / ATTN_CHUNK, units = Hkv * nch;
    if (nch > a->max_chunks) return -2;
    /* threads change who computes a unit, never what it computes */
    const int nthreads = a->nthreads > 1 && n_kv * Hkv * G >= 4096 && units > 1 ? (int)a->nthreads : 1;
    float *parts = a->scratch, *sbufs = a->scratch + Hkv * a->max_chunks * G * P;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *sbuf = sbufs + (int64_t)THREAD_NUM() * G * KV_BLOCK;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int64_t g = u / nch, c = u % nch, j0 = c * ATTN_CHUNK;
            const int64_t j1 = j0 + ATTN_CHUNK < n_kv ? j0 + ATTN_CHUNK : n_kv;
            attn_unit(a, g, j0, j1, parts + u * G * P, sbuf);
        }
        /* merge the chunks of each query row in chunk order (log-sum-exp), add the sink, normalize */
#pragma omp for schedule(static)
        for (int64_t gr = 0; gr < Hkv * G; gr++) {
            const int64_t g = gr / G, r = gr % G, i = r / T, t = r % T, h = g * gsize + i;
            float m = a->sinks ? a->sinks[h] : -INFINITY;
            for (int64_t c = 0; c < nch; c++) {
                const float mc = parts[((g * nch + c) * G + r) * P];
                m = mc > m ? mc : m;
            }
            float *orow = a->out + t * a->o_st + h * a->o_sh;
            for (int64_t d = 0; d < Dv; d++) orow[d] = 0.0f;
            if (m == -INFINITY) continue;
            float l = a->sinks ? expf(a->sinks[h] - m) : 0.0f;
            for (int64_t c = 0; c < nch; c++) {
                const float *pc = parts + ((g * nch + c) * G + r) * P;
                if (pc[0] == -INFINITY) continue;
                const float w = expf(pc[0] - m);
                l += w * pc[1];
                for (int64_t d = 0; d < Dv; d++) orow[d] += w * pc[2 + d];
            }
            const float inv = 1.0f / l;
            for (int64_t d = 0; d < Dv; d++) orow[d] *= inv;
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


static void silu_mul_row(const float *a, const float *b, float *o, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
    }
#endif
    for (; i < n; i++) o[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

int metatp_glu(const GluArgs *g) {
    if (g->act != 0 && g->act != 1) return -1;
    for (int64_t t = 0; t < g->T; t++) {
        const float *a = g->a + t * g->a_st, *b = g->b + t * g->b_st;
        float *o = g->out + t * g->o_st;
        if (g->act == 0) {
            silu_mul_row(a, b, o, g->n);
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

/* ------------------------------------------------------------------ RMS norm, add
 * Why: between a step's compiled calls, numpy spent ~10 us per norm and per residual add (five
 * array calls each); as compiled calls they join the step's batch (one ctypes call for a run).
 *
 * rms_norm: out = x * (1 / sqrt(mean(x^2) + eps)) [* w] per row, as ggml and
 * numpy_kernels.rms_scale round it: the sum of squares in double, the mean rounded to float, the
 * rest in float, the weight multiplied after the scale (two roundings). */
typedef struct {
    int64_t T, n;
    const float *x;
    int64_t x_st;
    const float *w;        /* NULL: no weight */
    float *out;
    int64_t o_st;
    float eps;
} RmsNormArgs;

int metatp_rms_norm(const RmsNormArgs *a) {
    if (a->n <= 0 || a->T < 0) return -2;
    for (int64_t t = 0; t < a->T; t++) {
        const float *x = a->x + t * a->x_st;
        float *o = a->out + t * a->o_st;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        int64_t i = 0;
        for (; i + 4 <= a->n; i += 4) {
            s0 += (double)x[i] * x[i];
            s1 += (double)x[i + 1] * x[i + 1];
            s2 += (double)x[i + 2] * x[i + 2];
            s3 += (double)x[i + 3] * x[i + 3];
        }
        for (; i < a->n; i++) s0 += (double)x[i] * x[i];
        float mean = (float)(((s0 + s1) + (s2 + s3)) / (double)a->n);
        mean += a->eps;
        const float scale = 1.0f / sqrtf(mean);
        if (a->w) {
            for (i = 0; i < a->n; i++) {
                const float v = x[i] * scale;
                o[i] = v * a->w[i];
            }
        } else {
            for (i = 0; i < a->n; i++) o[i] = x[i] * scale;
        }
    }
    return 0;
}

/* add: out = a + b over rows (a residual connection) */
typedef struct {
    int64_t T, n;
    const float *a;
    int64_t a_st;
    const float *b;
    int64_t b_st;
    float *out;
    int64_t o_st;
} AddArgs;

int metatp_add(const AddArgs *g) {
    for (int64_t t = 0; t < g->T; t++) {
        const float *a = g->a + t * g->a_st, *b = g->b + t * g->b_st;
        float *o = g->out + t * g->o_st;
        for (int64_t i = 0; i < g->n; i++) o[i] = a[i] + b[i];
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
    int64_t group;                 /* 1, or 8: the row-group layout (4-bit codes, blocks of 32) */
    int64_t half_scales;           /* group 8: scale and offset are IEEE halves */
} DequantArgs;

/* Row r of a weight in the row-group layout, dequantized: lane r % 8 of its group's blocks. */
__attribute__((optimize("fp-contract=off")))
static void dequant_grouped_row(const DequantArgs *a, int64_t r, float *out) {
    const int64_t nb = a->k / 32, g = r / 8, lane = r % 8, gbytes = 32 * a->bits;
    const int bias = (int)a->bias;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = (const uint8_t *)a->q + (g * nb + b) * gbytes + 4 * lane;
        const int half = (int)a->half_scales;
        const float s = scale_at((const uint8_t *)a->scale, (g * nb + b) * 8 + lane, half);
        const float o = a->offset ? scale_at((const uint8_t *)a->offset, (g * nb + b) * 8 + lane, half) : 0.0f;
        if (a->bits == 8) {
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++) {
                    float v = (float)(int8_t)gb[32 * j + c] * s;
                    if (a->offset) v += o;
                    out[b * 32 + 4 * j + c] = v;
                }
            continue;
        }
        for (int j = 0; j < 4; j++)
            for (int c = 0; c < 4; c++) {
                const uint8_t byte = gb[32 * j + c];
                float lo = (float)((int)(byte & 0x0F) - bias) * s, hi = (float)((int)(byte >> 4) - bias) * s;
                if (a->offset) { lo += o; hi += o; }
                out[b * 32 + 4 * j + c] = lo;
                out[b * 32 + 16 + 4 * j + c] = hi;
            }
    }
}

__attribute__((optimize("fp-contract=off")))
int metatp_dequant(const DequantArgs *a) {
    if (a->block != 16 && a->block != 32) return -1;
    if (a->k <= 0 || a->k % a->block != 0 || a->rows < 0) return -2;
    if (!(a->bits == 8 || (a->bits == 4 && a->k % 32 == 0) || a->bits == 16)) return -5;
    if (!layout_ok(a->group, a->half_scales, a->bits, a->block, a->rows)) return -6;
    const int64_t k = a->k, B = a->block, nb = k / B, row_bytes = k * a->bits / 8;
    const int nthreads = a->rows * k < (int64_t)1 << 16 ? 1 : (int)a->nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < a->rows; r++) {
        if (a->group == 8) {
            dequant_grouped_row(a, r, a->out + r * a->ldo);
            continue;
        }
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
 * dst[ids[t]] = src[t] for T rows of n floats (the KV-cache write of a step), stored as the
 * cache type (`type`: float32 copied, else rounded by kv_quant_row); src row stride in floats,
 * dst row stride in bytes. An id outside [0, dst_rows) is refused (-1) before anything is
 * written. */
typedef struct {
    int64_t T, n;
    const float *src;
    int64_t src_st;
    void *dst;
    int64_t dst_st, dst_rows;
    const int32_t *ids;
    int64_t type;
} SetRowsArgs;

int metatp_set_rows(const SetRowsArgs *a) {
    if (kv_row_bytes(a->type, a->n) < 0) return -5;
    for (int64_t t = 0; t < a->T; t++)
        if (a->ids[t] < 0 || a->ids[t] >= a->dst_rows) return -1;
    for (int64_t t = 0; t < a->T; t++) {
        uint8_t *row = (uint8_t *)a->dst + a->ids[t] * a->dst_st;
        if (a->type == T_F32) memcpy(row, a->src + t * a->src_st, sizeof(float) * (size_t)a->n);
        else kv_quant_row(a->type, a->src + t * a->src_st, a->n, row);
    }
    return 0;
}

/* ------------------------------------------------------------------ batches
 * Several prepared kernel calls in one: under -sm tensor every simulated device makes its own
 * rope, KV write, attention and gated-activation call per layer, and each ctypes call costs more
 * than a small kernel. A batch runs them in the given order (so the bits are those of separate
 * calls); it stops at the first that fails and says which. */
typedef int (*kernel_fn)(const void *);

typedef struct {
    int64_t n;
    const kernel_fn *fns;
    const void *const *args;
    int64_t failed;          /* out: index of the call that returned nonzero */
} BatchArgs;

int metatp_batch(BatchArgs *b) {
    for (int64_t i = 0; i < b->n; i++) {
        const int rc = b->fns[i](b->args[i]);
        if (rc) {
            b->failed = i;
            return rc;
        }
    }
    return 0;
}
