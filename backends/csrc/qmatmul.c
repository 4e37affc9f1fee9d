/* qmatmul.c: y = x @ W^T over int8-coded weights, float32 activations (part of the unity build
 * cpu_kernels.c; uses simd.h).
 *
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
 * The offset and bias terms are added per chunk after its tiles (qmm_terms).
 */

enum { QMM_TOKEN_BLOCK = 64 };   /* tokens of a pass the group kernel runs at a time */
#if defined(__AVX512F__)
#define QMM_GROUPS 1      /* qmatmul_groups.c: the float GEMM on the row-group layout */
#else
#define QMM_GROUPS 0
#endif

typedef struct {
    /* bits 8: int8 codes; 4: nibbles, code = nibble - bias; 16: halves, bias 1 = bfloat16 */
    int64_t rows, k, block, bits, bias;
    const void *q;
    const float *scale, *offset;   /* offset may be NULL */
    const float *x;
    int64_t ldx, ntok;
    float *y;
    int64_t ldy;
    /* 1: row-major codes; 8: the row-group layout of repack.c (4- or 8-bit codes, blocks of 32),
     * read by the 512-bit float GEMM below; half_scales: its scales/offsets are IEEE halves */
    int64_t group, half_scales;
} QMatmulArgs;

/* Several independent products in one parallel region (e.g. one node's slices on every
 * simulated device): the threads share out all their rows, so a group pays one fork/join. */
typedef struct {
    int64_t n;
    const QMatmulArgs *const *items;
    int64_t nthreads;
} QMatmulGroup;

static int qmm_check(const QMatmulArgs *a) {
    if (a->group != 1 && !(QMM_GROUPS && a->group == 8 && a->block == 32 && (a->bits == 4 || a->bits == 8)
                           && a->rows % 8 == 0)) return -6;
    if (a->block != 16 && a->block != 32) return -1;
    if (a->k <= 0 || a->k % a->block != 0 || a->rows < 0 || a->ntok < 1) return -2;
    if (!(a->bits == 8 || (a->bits == 4 && a->k % 32 == 0 && a->bias >= 0 && a->bias <= 15)
          || (a->bits == 16 && (a->bias == 0 || a->bias == 1)))) return -5;
    return 0;
}

/* The sums of x that the blocks' offsets multiply, block-major: xsum[b * xsum_ld(a) + t], so the
 * offset term takes 8 tokens side by side (qmm_terms); zeros pad the tokens to a multiple of 8. */
static int64_t xsum_ld(const QMatmulArgs *a) { return (a->ntok + 7) / 8 * 8; }

static void qmm_xsum(const QMatmulArgs *a, float *xsum) {
    const int64_t nb = a->k / a->block, ld = xsum_ld(a);
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t t = 0; t < a->ntok; t++) xsum[b * ld + t] = sum_f32(a->x + t * a->ldx + b * a->block, a->block);
        for (int64_t t = a->ntok; t < ld; t++) xsum[b * ld + t] = 0.0f;
    }
}

/* Where a tile of R rows (from r0) x tokens (from t0) reads: its rows' codes and scales, its
 * tokens' x, and the codes PREFETCH_ROWS rows ahead; the scales and offsets that far ahead are
 * prefetched here (the codes as the tile goes, a block at a time). */
typedef struct {
    int64_t nb, rowbytes;
    const uint8_t *q0, *pf;
    const float *s0, *x0;
} TileAt;

static inline __attribute__((always_inline)) TileAt tile_at(const QMatmulArgs *a, int64_t r0, int R, int64_t t0,
                                                           int bits) {
    TileAt at;
    at.nb = a->k / a->block;
    at.rowbytes = a->k * bits / 8;
    at.q0 = (const uint8_t *)a->q + r0 * at.rowbytes;
    at.pf = at.q0 + PREFETCH_ROWS * at.rowbytes;
    at.s0 = a->scale + r0 * at.nb;
    at.x0 = a->x + t0 * a->ldx;
    prefetch_span(at.s0 + PREFETCH_ROWS * at.nb, R * at.nb * (int64_t)sizeof(float));
    if (a->offset) prefetch_span(a->offset + (r0 + PREFETCH_ROWS) * at.nb, R * at.nb * (int64_t)sizeof(float));
    return at;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#define QMM_TILES_OF_8 1        /* qmm_tile_b32 takes tiles of 1 row x 8 tokens */
#else
#define QMM_TILES_OF_8 0
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2: codes are unpacked straight into __m256 (see simd.h). Blocks of 32 sum in 8 lanes
 * (qmm_tile_b32), blocks of 16 in 16 lanes as two __m256 (lanes 0..7, 8..15), as the v16f code.
 * Each build's bits are its own; within a build a (row, token) takes the same operations at
 * every tile shape. */

/* Unit k (16 codes) as two 8-float halves; nibbles without their bias (see qmm_terms). */
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

static inline float hsum_pair(__m256 lo, __m256 hi) { return hsum8((v8f)_mm256_add_ps(lo, hi)); }

/* Blocks of 32 on AVX2: R rows x T tokens (R * T <= 8; 1 x 8 for steps of many tokens), each
 * (row, token) one 8-lane accumulator: a block's 32 products summed in a chain of 4 (lanes l,
 * l + 8, l + 16, l + 24), times its scale into the accumulator, then the 8 lanes as a tree. Why 8
 * lanes and not the 16 of the 512-bit code: one operation fewer per 32 products on both halves
 * (5 instead of 6), and half the accumulators, so one row's converted codes serve 8 tokens (the
 * 16 registers held 4 before). The layer weights at 16 tokens: 36.6-38.4 -> 31.1-32.1 ms (30
 * layers of the default model's shapes, 2 threads, Intel machine, with qmm_terms). */
static inline __attribute__((always_inline)) void qmm_tile_b32(
        const QMatmulArgs *a, int64_t r0, int R, int64_t t0, int T, int bits, int bias, float *res) {
    const TileAt at = tile_at(a, r0, R, t0, bits);
    const int64_t nb = at.nb, ldx = a->ldx, rowbytes = at.rowbytes;
    const uint8_t *q0 = at.q0, *pf = at.pf;
    const float *s0 = at.s0, *x0 = at.x0;
    __m256 acc[8];
    for (int j = 0; j < R * T; j++) acc[j] = _mm256_setzero_ps();
    const int64_t step = R * bits * 4;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + b * step + off);
        for (int i = 0; i < R; i++) {
            __m256 u[4];
            block_pairs(q0 + i * rowbytes, b, bits, bias, u);
            const __m256 sc = _mm256_broadcast_ss(s0 + i * nb + b);
            for (int t = 0; t < T; t++) {
                const float *xt = x0 + t * ldx + b * 32;
                __m256 p = _mm256_mul_ps(u[0], _mm256_loadu_ps(xt));
                p = _mm256_fmadd_ps(u[1], _mm256_loadu_ps(xt + 8), p);
                p = _mm256_fmadd_ps(u[2], _mm256_loadu_ps(xt + 16), p);
                p = _mm256_fmadd_ps(u[3], _mm256_loadu_ps(xt + 24), p);
                acc[i * T + t] = _mm256_fmadd_ps(sc, p, acc[i * T + t]);
            }
        }
    }
    for (int j = 0; j < R * T; j++) res[j] = hsum8((v8f)acc[j]);
}

/* Blocks of 16 on AVX2 (blocks of 32 go to qmm_tile_b32): each (row, token) a 16-lane sum as two
 * __m256, as the v16f code. */
static inline __attribute__((always_inline)) void qmm_tile(
        const QMatmulArgs *a, int64_t r0, int R, int64_t t0, int T, int bits, int bias, int shift, float *res) {
    if (shift == 1) {
        qmm_tile_b32(a, r0, R, t0, T, bits, bias, res);
        return;
    }
    const TileAt at = tile_at(a, r0, R, t0, bits);
    const int64_t nb = at.nb, ldx = a->ldx, rowbytes = at.rowbytes;
    const uint8_t *q0 = at.q0, *pf = at.pf;
    const float *s0 = at.s0, *x0 = at.x0;
    const int64_t units = a->k / UNIT;
    __m256 acc[4][4][2];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
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
    const TileAt at = tile_at(a, r0, R, t0, bits);
    const int64_t nb = at.nb, ldx = a->ldx, rowbytes = at.rowbytes;
    const uint8_t *q0 = at.q0, *pf = at.pf;
    const float *s0 = at.s0, *x0 = at.x0;
    const int64_t units = a->k / UNIT;
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
    if (a->group != 1) return 0;      /* the group kernel folds offsets and biases into its weights */
    return a->offset != NULL || (a->bits == 4 && a->bias != 0);
}

/* The tile's result for (row, token) as it is, into y; the chunk's offset and bias terms come after
 * (qmm_terms). */
static inline void qmm_store(const QMatmulArgs *a, int64_t r0, int R, int64_t t0, int T, const float *res) {
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) a->y[(t0 + t) * a->ldy + r0 + i] = res[i * T + t];
}

/* out[i][t] = sum_b w[i * nb + b] * xs[b * ld + t] for NR rows and 8 tokens: the even blocks and
 * the odd ones each in one chain of fused multiply-adds in block order, then their sum. Every
 * (row, token) takes these rounded operations whatever the tile or the step's other tokens (batch
 * invariance); the rows' and halves' chains run side by side (one chain waited on each addition). */
static inline __attribute__((always_inline)) void block_dots(const float *w, int64_t nb, int NR, const float *xs,
                                                             int64_t ld, float out[CHUNK_ROWS][8]) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 ev[CHUNK_ROWS], od[CHUNK_ROWS];
    for (int i = 0; i < NR; i++) ev[i] = od[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256 x0 = _mm256_loadu_ps(xs + b * ld), x1 = _mm256_loadu_ps(xs + (b + 1) * ld);
        for (int i = 0; i < NR; i++) {
            ev[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * nb + b), x0, ev[i]);
            od[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * nb + b + 1), x1, od[i]);
        }
    }
    if (b < nb) {
        const __m256 x0 = _mm256_loadu_ps(xs + b * ld);
        for (int i = 0; i < NR; i++) ev[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * nb + b), x0, ev[i]);
    }
    for (int i = 0; i < NR; i++) _mm256_storeu_ps(out[i], _mm256_add_ps(ev[i], od[i]));
#else
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < 8; t++) {
            float ev = 0.0f, od = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                if (b & 1) od = fmaf(w[i * nb + b], xs[b * ld + t], od);
                else ev = fmaf(w[i * nb + b], xs[b * ld + t], ev);
            }
            out[i][t] = ev + od;
        }
#endif
}

/* block_dots for a chunk's nr rows, a whole chunk's count as a constant (its loops unrolled). */
static inline void chunk_dots(const float *w, int64_t nb, int64_t nr, const float *xs, int64_t ld,
                              float out[CHUNK_ROWS][8]) {
    if (nr == CHUNK_ROWS) block_dots(w, nb, CHUNK_ROWS, xs, ld, out);
    else block_dots(w, nb, (int)nr, xs, ld, out);
}

/* Rows r0 .. r0+nr (at most CHUNK_ROWS) of y, all tokens, plus the offset term and the nibble bias
 * (nibbles are read without their bias, one instruction less per 16 codes; it comes back as
 * - bias * sum_b scale[b] * xsum[b]), 8 tokens at a time. Why here and not per tile: a dot product
 * per (row, token) took ~10% of a 16-token step of the AVX2 build (Q4_1 weights carry offsets),
 * and one vector chain per tile waited on its additions (15%). */
static void qmm_terms(const QMatmulArgs *a, const float *xsum, int64_t r0, int64_t nr) {
    const int64_t nb = a->k / a->block, ld = xsum_ld(a);
    const float bias = a->bits == 4 ? (float)a->bias : 0.0f;
    for (int64_t t0 = 0; t0 < a->ntok; t0 += 8) {
        float off[CHUNK_ROWS][8], sc[CHUNK_ROWS][8];
        if (a->offset) chunk_dots(a->offset + r0 * nb, nb, nr, xsum + t0, ld, off);
        if (bias != 0.0f) chunk_dots(a->scale + r0 * nb, nb, nr, xsum + t0, ld, sc);
        const int64_t nt = a->ntok - t0 < 8 ? a->ntok - t0 : 8;
        for (int64_t i = 0; i < nr; i++)
            for (int64_t t = 0; t < nt; t++) {
                float *y = a->y + (t0 + t) * a->ldy + r0 + i;
                float v = *y;
                if (a->offset) v += off[i][t];
                if (bias != 0.0f) v = fmaf(-bias, sc[i][t], v);
                *y = v;
            }
    }
}

/* Rows r0 .. r0+nr of an item against all its tokens (TILE_ROWS): one row a tile for 3 or 4
 * tokens, two for 2, four for 1; on AVX2, blocks of 32 take tiles of 8 tokens first. */
static inline __attribute__((always_inline)) void qmm_chunk_fmt(
        const QMatmulArgs *a, const float *xsum, int64_t r0, int64_t nr, int bits, int bias, int shift) {
    float res[16];     /* a tile's R * T results */
#define QMM_TILE(r, R, t0, T) do { \
        qmm_tile(a, (r), (R), (t0), (T), bits, bias, shift, res); \
        qmm_store(a, (r), (R), (t0), (T), res); \
    } while (0)
    int64_t t8 = 0;
    if (QMM_TILES_OF_8 && shift == 1)     /* blocks of 32 on AVX2: tiles of 8 tokens first (qmm_tile_b32) */
        for (; t8 + 8 <= a->ntok; t8 += 8)
            for (int64_t r = r0; r < r0 + nr; r++) QMM_TILE(r, 1, t8, 8);
#define QMM_TILE_AFTER_8(r, R, t0, T) QMM_TILE((r), (R), t8 + (t0), (T))
    TILE_ROWS(QMM_TILE_AFTER_8, a->ntok - t8, r0, nr, 1, 1, 2, 4);
#undef QMM_TILE_AFTER_8
#undef QMM_TILE
    if (xsum) qmm_terms(a, xsum, r0, nr);
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

#if QMM_GROUPS
static void qmg_chunk(const QMatmulArgs *a, int64_t g, int64_t t0, int64_t t1);    /* qmatmul_groups.c */
#endif

/* Scheduling chunks of an item: CHUNK_ROWS rows, or one group of 8 in the row-group layout. */
static int64_t qmm_chunks(const QMatmulArgs *a) {
    return a->group != 1 ? a->rows / 8 : (a->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
}

/* 1 when this build reads the row-group layout (codes.group_rows) in the float product. */
int metatp_qmatmul_groups(void) { return QMM_GROUPS; }

/* Chunk c of the call's chunks (numbered across its items by first_chunk) in token block tb. */
static void qmm_run_chunk(const QMatmulGroup *g, const int64_t *first_chunk, const float *xsum,
                          const int64_t *xsum_at, int64_t c, int64_t tb) {
    int64_t i = 0;
    while (c >= first_chunk[i + 1]) i++;
    const QMatmulArgs *a = g->items[i];
#if QMM_GROUPS
    if (a->group != 1) {
        const int64_t t0 = tb * QMM_TOKEN_BLOCK, t1 = t0 + QMM_TOKEN_BLOCK;
        if (t0 < a->ntok) qmg_chunk(a, c - first_chunk[i], t0, t1 < a->ntok ? t1 : a->ntok);
        return;
    }
#endif
    if (tb) return;       /* row-major items: all their tokens in the first block */
    const int64_t r0 = (c - first_chunk[i]) * CHUNK_ROWS, left = a->rows - r0;
    qmm_chunk(a, xsum && needs_xsum(a) ? xsum + xsum_at[i] : NULL, r0, left < CHUNK_ROWS ? left : CHUNK_ROWS);
}

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
        first_chunk[i + 1] = first_chunk[i] + qmm_chunks(a);
        xsum_at[i + 1] = xsum_at[i] + (needs_xsum(a) ? a->k / a->block * xsum_ld(a) : 0);
        work += a->rows * a->k * a->ntok;
    }
    float *xsum = NULL;
    if (xsum_at[n]) {
        xsum = (float *)malloc(sizeof(float) * (size_t)xsum_at[n]);
        if (!xsum) return -3;
        for (int64_t i = 0; i < n; i++)
            if (needs_xsum(g->items[i])) qmm_xsum(g->items[i], xsum + xsum_at[i]);
    }
    const int nthreads = work < (int64_t)1 << 16 ? 1 : team_size(g->nthreads);   /* small: not worth waking threads */
    const int64_t total = first_chunk[n];
    int64_t blocks = 1;     /* token blocks: a long prompt's activations stay in L2 */
    for (int64_t i = 0; i < n; i++)
        if (g->items[i]->group != 1 && (g->items[i]->ntok + QMM_TOKEN_BLOCK - 1) / QMM_TOKEN_BLOCK > blocks)
            blocks = (g->items[i]->ntok + QMM_TOKEN_BLOCK - 1) / QMM_TOKEN_BLOCK;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        if (blocks == 1) {
            /* one token block: chunks go to whichever thread is free (as q8_matmul.c) */
#pragma omp for schedule(guided) nowait
            for (int64_t c = 0; c < total; c++) qmm_run_chunk(g, first_chunk, xsum, xsum_at, c, 0);
        }
        else
            for (int64_t tb = 0; tb < blocks; tb++) {
                /* static: a thread gets the same rows in every token block (its weights stay in its cache) */
#pragma omp for schedule(static) nowait
                for (int64_t c = 0; c < total; c++) qmm_run_chunk(g, first_chunk, xsum, xsum_at, c, tb);
            }
    }
    free(xsum);
    return 0;
}
