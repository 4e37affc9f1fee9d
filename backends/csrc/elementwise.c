/* elementwise.c: per-row kernels: gated activations, RMS norm, add (part of the unity build
 * cpu_kernels.c; uses simd.h). */

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
    int64_t nthreads;
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
    const int nt = row_threads(g->T, g->n, g->nthreads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
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
 * numpy/kernels' rms_scale round it: the sum of squares in double, the mean rounded to float, the
 * rest in float, the weight multiplied after the scale (two roundings). */
typedef struct {
    int64_t T, n;
    const float *x;
    int64_t x_st;
    const float *w;        /* NULL: no weight */
    float *out;
    int64_t o_st;
    float eps;
    int64_t nthreads;
} RmsNormArgs;

int metatp_rms_norm(const RmsNormArgs *a) {
    if (a->n <= 0 || a->T < 0) return -2;
    const int nt = row_threads(a->T, a->n, a->nthreads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
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
    int64_t nthreads;
} AddArgs;

int metatp_add(const AddArgs *g) {
    const int nt = row_threads(g->T, g->n, g->nthreads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < g->T; t++) {
        const float *a = g->a + t * g->a_st, *b = g->b + t * g->b_st;
        float *o = g->out + t * g->o_st;
        for (int64_t i = 0; i < g->n; i++) o[i] = a[i] + b[i];
    }
    return 0;
}
