/* qmatmul_groups.c: the float matrix product (exact numerics) on weights in the row-group layout,
 * with 512-bit registers (part of the unity build cpu_kernels.c, after qmatmul.c, whose argument
 * struct and dispatch it serves; the layout is repack.c's, made by codes.group_rows).
 *
 * Why: qmatmul.c's row-major tile converts a row's codes to floats for at most 4 tokens and then
 * spends three vector operations per 32 multiply-adds and token; a step of 16 tokens cost ~3.3 ms
 * a token against ~5.8 for one (2-vCPU AMD EPYC, AVX-512, default model). Here a 512-bit register
 * holds 4 codes of 4 rows (the layout's 32-bit word of 8 rows is two such registers), so the
 * codes of a group's block are turned into dequantized weights once (code * scale + offset, one
 * fused multiply-add) and then meet up to 8 tokens with one fused multiply-add per 16 products:
 * the token's 4 matching activations are broadcast to the 4 rows.
 *
 * Exactness: each (row, token) result is 4 running sums, one per position in the word (lanes
 * 4r .. 4r+3), each taking its codes in the same order (block by block; in a block the words in
 * turn, a word's low nibbles before its high ones), then added as (s0 + s1) + (s2 + s3). A token's
 * operations are the same whatever the tile shape or the step's other tokens, so results are
 * batch-invariant; they differ from the row-major tile's only in summation order. */

#if QMM_GROUPS

enum { QMG_T = 8 };    /* tokens a tile: 16 accumulators + 4 weight vectors + 2 activations + 4 scales */

/* Blocks ahead that the first tile of a group prefetches: every line of a block's codes (an 8-bit
 * block is four lines, a 4-bit one two) and its scales and offsets; past the group's end the next
 * group's, which the same thread runs next. Measured on the default model's weights (2 threads,
 * Zen 4 machine, one process): 4 blocks and only the first two lines of a block before; 16 and
 * every line took the 8-bit lm head (49152 x 576) at 16 tokens 4.3 -> 2.8 ms and the layer
 * weights at one token 3.8 -> 3.2 ms. */
enum { QMG_PREFETCH = 16 };

/* 8 scales (or offsets) of a group's block as 8 floats. */
static inline __attribute__((always_inline)) __m256 qmg_load8(const uint8_t *p, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* Lanes 4r .. 4r+3 take the value of row r (rows 0..3, or 4..7 for `high`). */
static inline __attribute__((always_inline)) __m512 qmg_spread(__m256 v, int high) {
    const __m512i lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i hi = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    return _mm512_permutexvar_ps(high ? hi : lo, _mm512_castps256_ps512(v));
}

/* Dequantized weights of 16 code bytes (4 rows x 4 positions) of a word: for nibbles, the low
 * halves in w[0] and the high ones in w[1]; 8-bit codes in w[0]. */
static inline __attribute__((always_inline)) void qmg_weights(const uint8_t *p, int bits, int bias, int has_off,
                                                              __m512 sc, __m512 of, __m512 w[2]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (bits == 8) {
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        w[0] = has_off ? _mm512_fmadd_ps(c, sc, of) : _mm512_mul_ps(c, sc);
        return;
    }
    const __m512i v = _mm512_cvtepu8_epi32(b), bv = _mm512_set1_epi32(bias);
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(v, 4);
    if (bias) {
        lo = _mm512_sub_epi32(lo, bv);
        hi = _mm512_sub_epi32(hi, bv);
    }
    const __m512 cl = _mm512_cvtepi32_ps(lo), ch = _mm512_cvtepi32_ps(hi);
    w[0] = has_off ? _mm512_fmadd_ps(cl, sc, of) : _mm512_mul_ps(cl, sc);
    w[1] = has_off ? _mm512_fmadd_ps(ch, sc, of) : _mm512_mul_ps(ch, sc);
}

/* The 8 row sums of a token's two accumulators (rows 0..3, 4..7): (s0 + s1) + (s2 + s3) a row. */
static inline __attribute__((always_inline)) __m256 qmg_rows(__m512 a, __m512 b) {
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));        /* lane 4r: s0 + s1; 4r+2: s2 + s3 */
    b = _mm512_add_ps(b, _mm512_permute_ps(b, 0xB1));
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));        /* lane 4r: (s0 + s1) + (s2 + s3) */
    b = _mm512_add_ps(b, _mm512_permute_ps(b, 0x4E));
    const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    return _mm512_castps512_ps256(_mm512_permutex2var_ps(a, pick, b));
}

/* What a tile does with the group's dequantized weights: work them out from the codes (a pass of
 * one tile), work them out and keep them in `wk` (the first tile of several), or read them back
 * from `wk` (the later tiles). Kept weights take the conversions and the multiply by the scale off
 * the later tiles, for one store and a load per register; the weights are the same numbers either
 * way, so results are bit-identical. */
enum { QMG_MAKE = 0, QMG_KEEP = 1, QMG_REUSE = 2 };

/* Tokens from which the weights are kept. Measured on the default model's weights (exact numerics,
 * 2 threads, Zen 5 machine, both builds in one process): keeping them at 16 tokens took the layers
 * 11.3 -> 11.7 ms, at 24 tokens 16.1 -> 15.5 ms, 32: 22.9 -> 21.4, 64: 43.6 -> 40.3, 512: 337 -> 302;
 * so it was 3 tiles. On the Intel machine, builds in separate processes run in turn, keeping from 16
 * took a 16-sequence decode step 19.3 -> 17.8 ms (S_TG 789-795 -> 856-862 t/s), pp16 1046 -> 1135-1157
 * and pp20 1023-1033 -> 1186-1197 t/s: 2 tiles (the Zen 5 figure, from one process, is the doubtful
 * one; docs/performance.md). */
#ifndef QMG_KEEP_FROM
#define QMG_KEEP_FROM (2 * QMG_T)
#endif

/* Floats of kept weights per block of a group: 8 or 4 word steps x 2 registers x 2 (nibble halves). */
enum { QMG_KEPT_PER_BLOCK = 8 * 2 * 16 };

/* Group g (rows 8g .. 8g+7) against tokens t0 .. t0+T-1. */
static inline __attribute__((always_inline)) void qmg_tile(const QMatmulArgs *a, int64_t g, int64_t t0, int T,
                                                           int bits, int bias, int has_off, int half, int first,
                                                           int use, float *wk) {
    const int64_t k = a->k, nb = k / 32, gbytes = 32 * bits, sb = half ? 2 : 4, ldx = a->ldx;
    const uint8_t *q = (const uint8_t *)a->q + g * nb * gbytes;
    const uint8_t *sp = (const uint8_t *)a->scale + g * nb * 8 * sb;
    const uint8_t *op = has_off ? (const uint8_t *)a->offset + g * nb * 8 * sb : NULL;
    const float *x0 = a->x + t0 * ldx;
    __m512 acc[QMG_T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = q + b * gbytes;
        if (first && use != QMG_REUSE) {        /* later tiles of the group find its codes in cache */
            for (int64_t line = 0; line < gbytes; line += 64) __builtin_prefetch(qb + QMG_PREFETCH * gbytes + line);
            __builtin_prefetch(sp + (b + QMG_PREFETCH) * 8 * sb);
            if (has_off) __builtin_prefetch(op + (b + QMG_PREFETCH) * 8 * sb);
        }
        __m512 sc0 = _mm512_setzero_ps(), sc1 = sc0, of0 = sc0, of1 = sc0;
        if (use != QMG_REUSE) {
            const __m256 s8 = qmg_load8(sp + b * 8 * sb, half);
            const __m256 o8 = has_off ? qmg_load8(op + b * 8 * sb, half) : _mm256_setzero_ps();
            sc0 = qmg_spread(s8, 0), sc1 = qmg_spread(s8, 1);
            of0 = qmg_spread(o8, 0), of1 = qmg_spread(o8, 1);
        }
        float *wb = wk + b * QMG_KEPT_PER_BLOCK;
        for (int j = 0; j < (bits == 8 ? 8 : 4); j++) {
            __m512 w0[2], w1[2];                                    /* rows 0..3, rows 4..7 */
            float *wj = wb + j * (bits == 8 ? 32 : 64);
            if (use == QMG_REUSE) {
                w0[0] = _mm512_loadu_ps(wj), w1[0] = _mm512_loadu_ps(wj + 16);
                if (bits == 4) w0[1] = _mm512_loadu_ps(wj + 32), w1[1] = _mm512_loadu_ps(wj + 48);
            } else {
                qmg_weights(qb + 32 * j, bits, bias, has_off, sc0, of0, w0);
                qmg_weights(qb + 32 * j + 16, bits, bias, has_off, sc1, of1, w1);
            }
            if (use == QMG_KEEP) {
                _mm512_storeu_ps(wj, w0[0]), _mm512_storeu_ps(wj + 16, w1[0]);
                if (bits == 4) _mm512_storeu_ps(wj + 32, w0[1]), _mm512_storeu_ps(wj + 48, w1[1]);
            }
            for (int t = 0; t < T; t++) {
                const float *xt = x0 + t * ldx + b * 32 + 4 * j;
                const __m512 xl = _mm512_broadcast_f32x4(_mm_loadu_ps(xt));
                acc[t][0] = _mm512_fmadd_ps(w0[0], xl, acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(w1[0], xl, acc[t][1]);
                if (bits == 4) {                                    /* high nibbles: codes 16 + 4j .. */
                    const __m512 xh = _mm512_broadcast_f32x4(_mm_loadu_ps(xt + 16));
                    acc[t][0] = _mm512_fmadd_ps(w0[1], xh, acc[t][0]);
                    acc[t][1] = _mm512_fmadd_ps(w1[1], xh, acc[t][1]);
                }
            }
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(a->y + (t0 + t) * a->ldy + g * 8, qmg_rows(acc[t][0], acc[t][1]));
}

/* Tokens t0 .. t1-1 of group g: tiles of 8 tokens, the remainder as 4, 2, 1. With more than one
 * tile and room `wk` for the group's weights (qmg_chunk gives it from QMG_KEEP_FROM tokens on), the
 * first tile keeps them and the others read them. */
static inline __attribute__((always_inline)) void qmg_chunk_fmt(const QMatmulArgs *a, int64_t g, int64_t t0, int64_t t1,
                                                                int bits, int bias, int has_off, int half, float *wk) {
    int64_t t = t0;
    if (wk) {
        qmg_tile(a, g, t, QMG_T, bits, bias, has_off, half, 1, QMG_KEEP, wk);
        for (t += QMG_T; t + QMG_T <= t1; t += QMG_T) qmg_tile(a, g, t, QMG_T, bits, bias, has_off, half, 0, QMG_REUSE, wk);
        if (t + 4 <= t1) { qmg_tile(a, g, t, 4, bits, bias, has_off, half, 0, QMG_REUSE, wk); t += 4; }
        if (t + 2 <= t1) { qmg_tile(a, g, t, 2, bits, bias, has_off, half, 0, QMG_REUSE, wk); t += 2; }
        if (t < t1) qmg_tile(a, g, t, 1, bits, bias, has_off, half, 0, QMG_REUSE, wk);
        return;
    }
    for (; t + QMG_T <= t1; t += QMG_T) qmg_tile(a, g, t, QMG_T, bits, bias, has_off, half, t == t0, QMG_MAKE, wk);
    if (t + 4 <= t1) { qmg_tile(a, g, t, 4, bits, bias, has_off, half, t == t0, QMG_MAKE, wk); t += 4; }
    if (t + 2 <= t1) { qmg_tile(a, g, t, 2, bits, bias, has_off, half, t == t0, QMG_MAKE, wk); t += 2; }
    if (t < t1) qmg_tile(a, g, t, 1, bits, bias, has_off, half, t == t0, QMG_MAKE, wk);
}

/* This thread's room for one group's kept weights (32 bytes a column, grown as needed and kept
 * for the thread's life): NULL when there is none, and then every tile works them out. */
static float *qmg_room(int64_t k) {
    static __thread float *room = NULL;
    static __thread int64_t held = 0;
    const int64_t want = k / 32 * QMG_KEPT_PER_BLOCK;
    if (want > held) {
        free(room);
        room = (float *)aligned_alloc(64, (size_t)want * sizeof(float));
        held = room ? want : 0;
    }
    return room;
}

/* Group g of an item against its tokens t0 .. t1-1, dispatched on the weight format: the GGUF types'
 * combinations constant (Q4_1, Q4_0, Q8_0, Q4_K), the rest through the general form. */
static void qmg_chunk(const QMatmulArgs *a, int64_t g, int64_t t0, int64_t t1) {
    const int has_off = a->offset != NULL, half = (int)a->half_scales, bias = (int)a->bias;
    float *const wk = t1 - t0 >= QMG_KEEP_FROM ? qmg_room(a->k) : NULL;
    if (a->bits == 4) {
        if (half && has_off && !bias) qmg_chunk_fmt(a, g, t0, t1, 4, 0, 1, 1, wk);                 /* Q4_1 */
        else if (half && !has_off && bias == 8) qmg_chunk_fmt(a, g, t0, t1, 4, 8, 0, 1, wk);       /* Q4_0 */
        else if (!half && has_off && !bias) qmg_chunk_fmt(a, g, t0, t1, 4, 0, 1, 0, wk);           /* Q4_K */
        else qmg_chunk_fmt(a, g, t0, t1, 4, bias, has_off, half, wk);
    } else {
        if (half && !has_off) qmg_chunk_fmt(a, g, t0, t1, 8, 0, 0, 1, wk);                          /* Q8_0 */
        else qmg_chunk_fmt(a, g, t0, t1, 8, 0, has_off, half, wk);
    }
}

#endif /* QMM_GROUPS */
