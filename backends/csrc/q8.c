/* q8.c: llama.cpp's Q8 rounding of activation rows and the integer block dot product (part of the
 * unity build cpu_kernels.c; uses simd.h; ~ggml-cpu's quants.c). The matrix products built
 * on them are in repack.c (the row-group layout) and q8_matmul.c. */

/* ------------------------------------------------------------------ Q8 activations (numerics="llamacpp")
 * Why: the float kernel (qmatmul.c) converts every weight code to a float and multiplies float
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
#if defined(__AVX512F__)
        /* the same rounding 16 lanes at a time (a prompt of many tokens quantizes K floats a
         * token per product): max and integer sums are exact in any order, the product x * id
         * is the scalar one, and cvtps rounds to nearest even as rintf does (the default mode) */
        for (int64_t b = 0; b < k / 32; b++) {
            const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float db = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
            const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
            const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
            const __m128i bl = _mm512_cvtepi32_epi8(ql), bh = _mm512_cvtepi32_epi8(qh);
            _mm_storeu_si128((__m128i *)(q + b * 32), bl);
            _mm_storeu_si128((__m128i *)(q + b * 32 + 16), bh);
            isum[2 * b] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bl));       /* sums of the int8 codes */
            isum[2 * b + 1] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bh));
            d[b] = round_to_half(db);
            if (kind == Q8_1) s[b] = round_to_half(db * (float)(isum[2 * b] + isum[2 * b + 1]));
        }
        return;
#elif defined(__AVX2__)
        /* the same with 8 lanes: codes packed to bytes (in range, so the saturating packs are
         * exact) and put back in order, the sums taken from the bytes */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < k / 32; b++) {
            __m256 v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
            const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float db = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
            __m256i qi[4];
            for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
            _mm256_storeu_si256((__m256i *)(q + b * 32), bytes);
            for (int h = 0; h < 2; h++) {
                const __m128i half = h ? _mm256_extracti128_si256(bytes, 1) : _mm256_castsi256_si128(bytes);
                const __m256i s8 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(half), ones);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                isum[2 * b + h] = _mm_cvtsi128_si32(s4);
            }
            d[b] = round_to_half(db);
            if (kind == Q8_1) s[b] = round_to_half(db * (float)(isum[2 * b] + isum[2 * b + 1]));
        }
        return;
#endif
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
#if defined(METATP_AMX) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define Q8_ISA "avx512-amx"       /* q8_amx.c's tiles for steps of many tokens */
#else
#define Q8_ISA "avx512-vnni"
#endif
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
