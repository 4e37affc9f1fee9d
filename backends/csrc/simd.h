/* simd.h: what every kernel of the unity build (cpu_kernels.c) shares: the vector types, the
 * exact half/bfloat16 conversions, the per-ISA loaders that turn 16 codes into 16 floats
 * (AVX-512, AVX2, NEON, portable C), the fixed-order sums, exp for 8 floats, and the register
 * tiling skeleton of the two matrix products (qmatmul.c, q8_matmul.c). The counterpart of
 * ggml-cpu's simd-mappings.h. Included once, first, by cpu_kernels.c. */
#ifndef METATP_SIMD_H
#define METATP_SIMD_H

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

/* Horizontal sums as a tree (16 -> 8 -> 4 -> 1): a row pays this once, and a chain of 16
   dependent scalar adds costs more than the row's arithmetic on short rows. */
static inline float hsum8(v8f v) {
    v4f l, h;
    memcpy(&l, &v, sizeof l);
    memcpy(&h, (const char *)&v + sizeof l, sizeof h);
    const v4f b = l + h;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hsum(v16f v) {
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return hsum8(lo + hi);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 has 8-float registers: GCC moves a 16-float vector type between its halves through the
 * stack (several times slower), so code for this ISA unpacks 16 codes (or 8 halves) straight
 * into __m256 halves (qmatmul.c's tile, kv.c's row reads). */
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
#endif

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

/* The most independent products one grouped call takes (QMatmulGroup, Q8MatmulGroup). */
enum { MAX_ITEMS = 64 };

/* The register tiling both matrix products share: rows r0 .. r0+nr of an item against its ntok
 * tokens, four tokens a tile, fewer tokens with more rows a tile (R4 .. R1 rows a tile for 4 .. 1
 * tokens: the accumulators of a tile fill the vector registers), rows left over one at a time.
 * TILE(r, R, t0, T) computes and stores the tile of rows r.. and tokens t0..; R and T are
 * constants at each of its uses, so the tile's loops unroll and its accumulators stay in
 * registers. */
#define TILE_ROWS_OF(TILE, r0, nr, t0, T, R) do { \
        int64_t i_ = 0; \
        for (; i_ + (R) <= (nr); i_ += (R)) TILE((r0) + i_, (R), (t0), (T)); \
        for (; i_ < (nr); i_++) TILE((r0) + i_, 1, (t0), (T)); \
    } while (0)
#define TILE_ROWS(TILE, ntok, r0, nr, R4, R3, R2, R1) do { \
        for (int64_t t0_ = 0; t0_ < (ntok);) { \
            const int64_t left_ = (ntok) - t0_; \
            if (left_ >= 4) { TILE_ROWS_OF(TILE, r0, nr, t0_, 4, R4); t0_ += 4; } \
            else if (left_ == 3) { TILE_ROWS_OF(TILE, r0, nr, t0_, 3, R3); t0_ += 3; } \
            else if (left_ == 2) { TILE_ROWS_OF(TILE, r0, nr, t0_, 2, R2); t0_ += 2; } \
            else { TILE_ROWS_OF(TILE, r0, nr, t0_, 1, R1); t0_ += 1; } \
        } \
    } while (0)

/* Threads for T rows of n floats (row kernels: rope.c, elementwise.c; rows are independent, so the
 * bits do not depend on it): the caller's count from 8 K floats, one below (a decode step of a few
 * sequences, where waking the threads costs more than the rows). Why 8 K: a decode step of 16
 * sequences (16 x 576 norms and adds, 16 x 1536 activations) took its row kernels ~0.95 -> ~0.5 ms
 * with them shared (their inputs lie half in each core's cache after a shared product); one
 * token's rows stay on one thread. */
enum { ROW_THREADS_FROM = 1 << 13 };    /* floats */

static int row_threads(int64_t T, int64_t n, int64_t nthreads) {
    return T * n >= ROW_THREADS_FROM && T > 1 && nthreads > 1 ? team_size(nthreads) : 1;
}

#endif /* METATP_SIMD_H */
