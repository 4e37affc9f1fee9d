/* row_best.c: per row of a block of logits, its largest value, the first index holding it and
 * whether every value of the row is finite (part of the unity build cpu_kernels.c).
 *
 * Why: the greedy pick of a step (backends/logits_read.py) read each row twice on one thread with
 * numpy (argmax, then min for the finiteness check): a step of 16 rows over a 49152 vocabulary is
 * 3 MB, just written by the output product on both cores, and took ~0.35 ms of a ~20 ms step.
 * Here one pass finds the maximum and the non-finite values, a second stops at the first index
 * holding the maximum, and the rows are shared by the kernel threads.
 *
 * The pick is numpy's argmax of a finite row: the largest value, the lowest index among equals
 * (-0.0 and 0.0 are equal, and the value returned is the one at that index). A row holding a NaN
 * or an infinity is reported as not finite; its value and index are then unspecified (the caller
 * reads the whole row). */

typedef struct {
    int64_t rows, n, ld;      /* row r is x[r * ld .. r * ld + n - 1] */
    const float *x;
    float *val;               /* per row: the largest value */
    int64_t *idx;             /* per row: the first index holding it */
    int64_t *finite;          /* per row: 1 when every value is finite, else 0 */
    int64_t nthreads;
} RowBestArgs;

/* 1 when v is a NaN or an infinity: v * 0 is then NaN, which no comparison equals. */
static inline int not_finite1(float v) { return !(v * 0.0f == 0.0f); }

static void row_best_one(const float *x, int64_t n, float *val, int64_t *idx, int64_t *finite) {
    float m = -INFINITY;
    int bad = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    {
        const __m512 zero = _mm512_setzero_ps();
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 badm = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            mv = _mm512_max_ps(mv, v);
            badm |= _mm512_cmp_ps_mask(_mm512_mul_ps(v, zero), zero, _CMP_NEQ_UQ);
        }
        m = _mm512_reduce_max_ps(mv);
        bad = badm != 0;
    }
#elif defined(__AVX2__)
    {
        const __m256 zero = _mm256_setzero_ps();
        __m256 mv = _mm256_set1_ps(-INFINITY), badv = zero;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            mv = _mm256_max_ps(mv, v);
            badv = _mm256_or_ps(badv, _mm256_cmp_ps(_mm256_mul_ps(v, zero), zero, _CMP_NEQ_UQ));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int e = 0; e < 8; e++) m = lanes[e] > m ? lanes[e] : m;
        bad = _mm256_movemask_ps(badv) != 0;
    }
#endif
    for (; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        bad |= not_finite1(x[i]);
    }
    *finite = !bad;
    if (bad) {
        *val = NAN;
        *idx = 0;
        return;
    }
    int64_t at = 0;
#if defined(__AVX512F__)
    {
        const __m512 mm = _mm512_set1_ps(m);
        for (; at + 16 <= n; at += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), mm, _CMP_EQ_OQ);
            if (hit) {
                at += __builtin_ctz((unsigned)hit);
                goto found;
            }
        }
    }
#elif defined(__AVX2__)
    {
        const __m256 mm = _mm256_set1_ps(m);
        for (; at + 8 <= n; at += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), mm, _CMP_EQ_OQ));
            if (hit) {
                at += __builtin_ctz((unsigned)hit);
                goto found;
            }
        }
    }
#endif
    while (at < n - 1 && x[at] != m) at++;      /* m is one of the row's values: the scan stops at it */
found:
    *idx = at;
    *val = x[at];
}

/* Returns 0, or -1 for a shape the kernel does not take. */
int metatp_row_best(const RowBestArgs *a) {
    if (a->rows < 1 || a->n < 1 || a->ld < a->n || a->nthreads < 1) return -1;
    const int nthreads = a->rows > 1 && a->rows * a->n >= ((int64_t)1 << 16) ? team_size(a->nthreads) : 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < a->rows; r++)
        row_best_one(a->x + r * a->ld, a->n, a->val + r, a->idx + r, a->finite + r);
    return 0;
}
