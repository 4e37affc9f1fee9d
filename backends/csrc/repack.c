/* repack.c: the integer matrix product's kernels for weights in the row-group layout (part of the
 * unity build cpu_kernels.c, after q8.c, whose dot-product build and argument structs it uses;
 * ~ggml-cpu's repack.cpp). */

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
/* 4 activation codes read as one int32 (any alignment, any alias): a broadcast of it loads from
 * memory (copied to an int32 array first, GCC moved each through a general register) */
typedef int32_t q8_i32 __attribute__((may_alias, aligned(1)));

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
    const q8_i32 *xw = (const q8_i32 *)xb;      /* broadcasts straight from memory, not through a GPR */
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
                                                                 int64_t t_begin, int64_t t_end,
                                                                 int bits, int dshift, int has_off, int half) {
    for (int64_t t0 = t_begin; t0 < t_end;) {
        const int64_t left = t_end - t0;
        const int T = left >= 4 ? 4 : (int)left;
        if (T == 4) q8x8_tile(a, x, g, t0, 4, bits, dshift, has_off, half);
        else if (T == 3) q8x8_tile(a, x, g, t0, 3, bits, dshift, has_off, half);
        else if (T == 2) q8x8_tile(a, x, g, t0, 2, bits, dshift, has_off, half);
        else q8x8_tile(a, x, g, t0, 1, bits, dshift, has_off, half);
        t0 += T;
    }
}

/* Group g against tokens t0 .. t1-1 (each token's result is the same whatever the range). */
static void q8x8_group_range(const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int64_t t1) {
    const int dshift = a->kind == Q8_K ? 3 : 0;
    /* the formats the GGUF types give: Q8_0 (8-bit, half scales); Q4_0 / Q4_1 (nibbles, half
     * scales, with a bias or an offset); Q4_K (nibbles, float scales and offsets, Q8_K x) */
    if (a->bits == 8) {
        if (a->half_scales && !a->offset && !dshift) q8x8_group_fmt(a, x, g, t0, t1, 8, 0, 0, 1);
        else q8x8_group_fmt(a, x, g, t0, t1, 8, dshift, a->offset != NULL, (int)a->half_scales);
    } else if (a->half_scales && !dshift) {
        if (a->offset) q8x8_group_fmt(a, x, g, t0, t1, 4, 0, 1, 1); else q8x8_group_fmt(a, x, g, t0, t1, 4, 0, 0, 1);
    } else if (dshift && a->offset && !a->half_scales) {
        q8x8_group_fmt(a, x, g, t0, t1, 4, 3, 1, 0);
    } else {
        q8x8_group_fmt(a, x, g, t0, t1, 4, dshift, a->offset != NULL, (int)a->half_scales);
    }
}

static void q8x8_group(const Q8MatmulArgs *a, const Q8Act *x, int64_t g) {
    q8x8_group_range(a, x, g, 0, a->ntok);
}
