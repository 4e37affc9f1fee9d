/* dequant.c: codes -> float32 weights, for BLAS on long prompts (part of the unity build
 * cpu_kernels.c, after q8.c (layout_ok) and repack.c (scale_at)). */

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
    const int nthreads = a->rows * k < (int64_t)1 << 16 ? 1 : team_size(a->nthreads);
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
