/* attn_rows.c: the row-level pieces of the decode attention (part of the unity build
 * cpu_kernels.c, after kv.c, whose row types and row reads they use, and before attention.c,
 * whose units and merge drive them): float loads and dequantized reads of cache rows, the dot
 * products of query rows with eight K rows (f32, f16 in registers, integer Q8_0), the block max
 * and the softmax weights of a block, and the passes over a block's V rows that serve up to
 * V_ROWS query rows from registers. Each row's arithmetic is its own and in a fixed order, which
 * the batch invariance of attention.c rests on. */

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

/* out[e] = the sum of acc[e]'s lanes for eight accumulators: one transpose-and-add (each row's
 * lanes are summed among themselves in a fixed tree, whatever the other rows hold). */
static inline void hsum8x8(const v8f acc[8], float out[8]) {
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

/* out[e] = q . k_e over the first D8 (a multiple of 8) elements, for eight rows k_e: one
 * accumulator per row (eight hide the FMA latency), then hsum8x8. */
static inline void dot8_rows(const float *q, const float *const k[8], int64_t D8, float out[8]) {
    v8f acc[8];
    for (int e = 0; e < 8; e++) acc[e] = (v8f){0};
    for (int64_t d = 0; d < D8; d += 8) {
        const v8f qv = *(const v8f_a *)(q + d);
        for (int e = 0; e < 8; e++) acc[e] += qv * kv_load8(k[e], d);
    }
    hsum8x8(acc, out);
}

#if defined(__F16C__) && defined(__AVX2__)
#define KV_F16_DIRECT 1
/* dot8_rows over eight f16 cache rows, converted in registers: the same floats (a half converts
 * exactly) in the same fused multiply-adds as dot8_rows over the rows dequantized to a buffer,
 * so the same bits, without writing and re-reading the buffer. */
static inline void dot8_rows_f16(const float *q, const uint8_t *const k[8], int64_t D8, float out[8]) {
    v8f acc[8];
    for (int e = 0; e < 8; e++) acc[e] = (v8f){0};
    for (int64_t d = 0; d < D8; d += 8) {
        const v8f qv = *(const v8f_a *)(q + d);
        for (int e = 0; e < 8; e++)
            acc[e] += qv * (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)k[e] + d)));
    }
    hsum8x8(acc, out);
}
#else
#define KV_F16_DIRECT 0
#endif

/* The integer Q.K of a q8_0 cache (numerics "q8", as llama.cpp's CPU flash attention takes it):
 * out[e] = sum over blocks b of (d_k[e][b] * d_q[b]) * isum_b, isum_b the exact int32 dot product
 * of the query's Q8_0 codes (q8_quantize_row's rounding) with K row e's codes, the products
 * accumulated per row in eight float lanes (one fused multiply-add a block) and summed by
 * hsum8x8; no K row is converted to floats. */
static inline void dot8_rows_q8(const int8_t *qq, const float *qd, const uint8_t *const k[8], int64_t nblk,
                                float out[8]) {
    v8f acc[8];
    for (int e = 0; e < 8; e++) acc[e] = (v8f){0};
    for (int64_t b = 0; b < nblk; b++) {
#if Q8_SIMD
        const __m256i x = _mm256_loadu_si256((const __m256i *)(qq + 32 * b));
        for (int e = 0; e < 8; e++) {
            const uint8_t *blk = k[e] + 34 * b;
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256 is = _mm256_cvtepi32_ps(q8_dot32(_mm256_sign_epi8(w, w), w, x, 1));
#if defined(__F16C__)
            const float f = _cvtsh_ss(rd16(blk)) * qd[b];
#else
            const float f = half_to_float(rd16(blk)) * qd[b];
#endif
            acc[e] = (v8f)_mm256_fmadd_ps(is, _mm256_set1_ps(f), (__m256)acc[e]);
        }
#else
        for (int e = 0; e < 8; e++) {
            const uint8_t *blk = k[e] + 34 * b;
            const int8_t *w = (const int8_t *)blk + 2;
            const float f = half_to_float(rd16(blk)) * qd[b];
            for (int l = 0; l < 8; l++) {      /* the SIMD lanes: four codes each */
                int32_t is = 0;
                for (int j = 0; j < 4; j++) is += (int32_t)w[4 * l + j] * qq[32 * b + 4 * l + j];
                acc[e][l] += (float)is * f;
            }
        }
#endif
    }
    hsum8x8(acc, out);
}

/* The largest of sr[0 .. n8) (n8 a multiple of 8; -inf padding): any order gives the same max,
 * and a NaN score is passed over as the scalar `s > m ? s : m` passes it. */
static inline float block_max8(const float *sr, int64_t n8) {
#if defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n8; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(sr + j), m);   /* NaN lane: m kept */
    float l[8], r = -INFINITY;
    _mm256_storeu_ps(l, m);
    for (int e = 0; e < 8; e++) r = l[e] > r ? l[e] : r;
    return r;
#else
    float r = -INFINITY;
    for (int64_t j = 0; j < n8; j++) r = sr[j] > r ? sr[j] : r;
    return r;
#endif
}

/* sr[j] = exp(sr[j] - m) for j < n8 (a multiple of 8: the padding past a block's n cells holds
 * -inf), and the sum of the first n in cell order. Scores of -inf (masked cells) give exact
 * zeros, and a sum in cell order does not change when exact zeros come between its terms: a
 * sequence's cells give the same bits wherever they sit in a block, and whatever else the block
 * holds (batch invariance; a sum in 8 lanes would depend on each cell's position mod 8, and a
 * decode step's cells land wherever cells are free). Why vectorized: the scalar expf here was
 * ~3 ms of a decode step at depth 1536 (one call a score). */
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

/* 16 values of a cache row from element d (a multiple of 16) as floats, in registers: float32,
 * IEEE half or bfloat16 (exact), or q8_0 codes times their block's scale (one rounded product a
 * value: gguf's dequantization, the value kv_dequant_row writes). */
static inline __attribute__((always_inline)) v16f kv_load16(int64_t type, const uint8_t *row, int64_t d) {
    if (type == T_F32) return load_f32((const float *)row + d);
    if (type == T_F16 || type == T_BF16) return load_halves((const uint16_t *)row + d, type == T_BF16);
    const uint8_t *blk = row + 34 * (d / 32);
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))
    const float s = _cvtsh_ss(rd16(blk));
#else
    const float s = half_to_float(rd16(blk));
#endif
    return load_codes((const int8_t *)blk + 2 + d % 32) * s;
}

/* Cache types whose rows kv_load16 reads (the others are dequantized into a buffer first). */
static inline int kv_direct(int64_t type) {
    return type == T_F32 || type == T_F16 || type == T_BF16 || type == T_Q8_0;
}

enum { V_ROWS = 4 };    /* query rows a pass over a block's V rows serves (4 x 64 values in registers) */

/* The NT query rows' weights of cell jj into p; 0 when none of them weighs it (the cell is skipped). */
static inline __attribute__((always_inline)) int row_weights(int NT, const float *const *sr, int64_t jj, float *p) {
    int any = 0;
    for (int r = 0; r < NT; r++) {
        p[r] = sr[r][jj];
        any |= p[r] != 0.0f;
    }
    return any;
}

/* acc_r[d0 .. d0+64) += sum over the block's rows jj (in row order) of p_r[jj] * v[jj][d0 ..],
 * for NT query rows at once: each V row is loaded (and converted) once for all of them while their
 * accumulators stay in registers. A row whose weight is 0 is skipped (exactly as if absent: another
 * sequence's cells, whatever they hold, change nothing); each product is one fused multiply-add
 * into the row's own accumulator, so a row's bits do not depend on the rows it shares a pass with. */
static inline __attribute__((always_inline)) void v_pass(int64_t type, int NT, const uint8_t *vh, int64_t v_sj,
                                                         int64_t b0, int64_t nb, const float *const *sr,
                                                         float *const *acc, int64_t d0) {
    v16f A[V_ROWS][4];
    for (int r = 0; r < NT; r++)
        for (int k = 0; k < 4; k++) A[r][k] = load_f32(acc[r] + d0 + 16 * k);
    for (int64_t jj = 0; jj < nb; jj++) {
        float p[V_ROWS];
        if (!row_weights(NT, sr, jj, p)) continue;
        const uint8_t *row = vh + (b0 + jj) * v_sj;
        v16f v[4];
        for (int k = 0; k < 4; k++) v[k] = kv_load16(type, row, d0 + 16 * k);
        for (int r = 0; r < NT; r++) {
            if (p[r] == 0.0f) continue;
            for (int k = 0; k < 4; k++) A[r][k] += p[r] * v[k];
        }
    }
    for (int r = 0; r < NT; r++)
        for (int k = 0; k < 4; k++) memcpy(acc[r] + d0 + 16 * k, &A[r][k], sizeof(v16f));
}

#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__FMA__) && defined(__F16C__)
/* 8 values of a cache row from element d (a multiple of 8), as kv_load16 gives them. */
static inline __attribute__((always_inline)) __m256 kv_load8v(int64_t type, const uint8_t *row, int64_t d) {
    if (type == T_F32) return _mm256_loadu_ps((const float *)row + d);
    if (type == T_F16 || type == T_BF16) {
        __m256 v;
        halves8_to_f32((const uint16_t *)row + d, type == T_BF16, &v);
        return v;
    }
    const uint8_t *blk = row + 34 * (d / 32);
    const __m128i c = _mm_loadl_epi64((const __m128i *)(blk + 2 + d % 32));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_set1_ps(_cvtsh_ss(rd16(blk))));
}

/* v_pass for 256-bit registers (16 of them): the 64 values go as four slices of 16, each a pass
 * over the block's rows with NT x 2 accumulators in registers (GCC lowers the 16-float vector
 * type through the stack on this ISA: the kernel at depth 1536 took 1.7x the time). Every
 * (row, value) takes the same fused multiply-adds in the same row order as v_pass's, and the
 * same rows are skipped. */
static inline __attribute__((always_inline)) void v_pass_avx2(int64_t type, int NT, const uint8_t *vh, int64_t v_sj,
                                                              int64_t b0, int64_t nb, const float *const *sr,
                                                              float *const *acc, int64_t d0) {
    for (int64_t ds = d0; ds < d0 + 64; ds += 16) {
        __m256 A[V_ROWS][2];
        for (int r = 0; r < NT; r++) {
            A[r][0] = _mm256_loadu_ps(acc[r] + ds);
            A[r][1] = _mm256_loadu_ps(acc[r] + ds + 8);
        }
        for (int64_t jj = 0; jj < nb; jj++) {
            float p[V_ROWS];
            if (!row_weights(NT, sr, jj, p)) continue;
            const uint8_t *row = vh + (b0 + jj) * v_sj;
            const __m256 v0 = kv_load8v(type, row, ds), v1 = kv_load8v(type, row, ds + 8);
            for (int r = 0; r < NT; r++) {
                if (p[r] == 0.0f) continue;
                const __m256 pr = _mm256_set1_ps(p[r]);
                A[r][0] = _mm256_fmadd_ps(pr, v0, A[r][0]);
                A[r][1] = _mm256_fmadd_ps(pr, v1, A[r][1]);
            }
        }
        for (int r = 0; r < NT; r++) {
            _mm256_storeu_ps(acc[r] + ds, A[r][0]);
            _mm256_storeu_ps(acc[r] + ds + 8, A[r][1]);
        }
    }
}
#define v_pass v_pass_avx2
#endif

/* v_pass with the type and the row count as constants (each pairing compiled on its own). */
#define V_PASS_NT(TYPE)                                                             \
    switch (nt) {                                                                   \
        case 1: v_pass(TYPE, 1, vh, v_sj, b0, nb, sr, acc, d0); break;              \
        case 2: v_pass(TYPE, 2, vh, v_sj, b0, nb, sr, acc, d0); break;              \
        case 3: v_pass(TYPE, 3, vh, v_sj, b0, nb, sr, acc, d0); break;              \
        default: v_pass(TYPE, 4, vh, v_sj, b0, nb, sr, acc, d0); break;             \
    }
static void v_block(int64_t type, int nt, const uint8_t *vh, int64_t v_sj, int64_t b0, int64_t nb,
                    const float *const *sr, float *const *acc, int64_t d0) {
    switch (type) {
        case T_F32: V_PASS_NT(T_F32) break;
        case T_F16: V_PASS_NT(T_F16) break;
        case T_BF16: V_PASS_NT(T_BF16) break;
        default: V_PASS_NT(T_Q8_0) break;
    }
}
