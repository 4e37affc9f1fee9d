/* rope.c: rotary embedding (part of the unity build cpu_kernels.c). */

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
    int64_t nthreads;      /* rows shared among threads (simd.h: row_threads) */
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
    const int nt = row_threads(T, H * D, a->nthreads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
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
