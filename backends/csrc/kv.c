/* kv.c: the KV cache's row types, their exact conversions and the KV write (set_rows) (part of the
 * unity build cpu_kernels.c; uses simd.h). */

/* ------------------------------------------------------------------ KV cache types
 * A cache row is stored as float32, IEEE half, bfloat16 or llama.cpp blocks of 32 (ids are
 * GGML type ids). Rows are written with llama.cpp's reference rounding (gguf.quants, the numpy
 * oracle: round-half-away for q8_0, truncation after +x.5 for the 4/5-bit types, round to
 * nearest even for f16 and bf16) and read back with gguf's dequantization, both without
 * fused multiply-adds so the bits are gguf's. */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_BF16 = 30 };

/* bytes of one row of n values of a cache type (n whole blocks), or -1 for a type not taken */
static int64_t kv_row_bytes(int64_t type, int64_t n) {
    switch (type) {
        case T_F32: return 4 * n;
        case T_F16: case T_BF16: return 2 * n;
        default: break;
    }
    if (n % 32) return -1;
    switch (type) {
        case T_Q8_0: return n / 32 * 34;
        case T_Q4_0: return n / 32 * 18;
        case T_Q4_1: return n / 32 * 20;
        case T_Q5_0: return n / 32 * 22;
        case T_Q5_1: return n / 32 * 24;
        default: return -1;
    }
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t h; memcpy(&h, p, sizeof h); return h; }
static inline void wr16(uint8_t *p, uint16_t h) { memcpy(p, &h, sizeof h); }

/* The 4- and 5-bit types: q0 = nibble (| high bit << 4); Q4_0/Q5_0 (q0 - 8|16) * d, Q4_1/Q5_1
 * d * q0 + m rounded twice (a product, then a sum) as gguf does: no FMA here. */
__attribute__((optimize("fp-contract=off")))
static void kv_dequant_nibbles(int64_t type, const uint8_t *p, int64_t n, float *out) {
    const int five = type == T_Q5_0 || type == T_Q5_1, one = type == T_Q4_1 || type == T_Q5_1;
    const int bsz = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    const int bias = one ? 0 : five ? 16 : 8;
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = p + bsz * b, *qs = blk + 2 + 2 * one + 4 * five;
        const float d = half_to_float(rd16(blk)), m = one ? half_to_float(rd16(blk + 2)) : 0.0f;
        uint32_t qh = 0;
        if (five) memcpy(&qh, blk + 2 + 2 * one, sizeof qh);
        float *o = out + 32 * b;
        if (one) {
            for (int j = 0; j < 16; j++) {
                o[j] = (float)((qs[j] & 0x0F) | (int)((qh >> j) & 1u) << 4) * d + m;
                o[j + 16] = (float)((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) * d + m;
            }
        } else {
            for (int j = 0; j < 16; j++) {
                o[j] = (float)(((qs[j] & 0x0F) | (int)((qh >> j) & 1u) << 4) - bias) * d;
                o[j + 16] = (float)(((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - bias) * d;
            }
        }
    }
}

/* n values of a cache row -> floats (gguf's dequantize_blocks, bit for bit: the other types
 * take one product per value, so nothing can be fused) */
static inline void kv_dequant_row(int64_t type, const uint8_t *p, int64_t n, float *out) {
    if (type == T_F16 || type == T_BF16) {
        const uint16_t *h = (const uint16_t *)p;
        int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
        for (; i + 8 <= n; i += 8) {          /* 8-float registers (see qmm_tile) */
            __m256 v;
            halves8_to_f32(h + i, type == T_BF16, &v);
            _mm256_storeu_ps(out + i, v);
        }
#else
        for (; i + UNIT <= n; i += UNIT) {
            const v16f v = load_halves(h + i, type == T_BF16);
            memcpy(out + i, &v, sizeof v);
        }
#endif
        for (; i < n; i++) {
            if (type == T_F16) {
                out[i] = half_to_float(h[i]);
            } else {
                const uint32_t bits = (uint32_t)h[i] << 16;
                memcpy(out + i, &bits, sizeof bits);
            }
        }
        return;
    }
    if (type != T_Q8_0) {
        kv_dequant_nibbles(type, p, n, out);
        return;
    }
    for (int64_t b = 0; b < n / 32; b++) {        /* Q8_0; plain loops: gcc vectorizes them best */
        const uint8_t *blk = p + 34 * b;
        const int8_t *qs = (const int8_t *)blk + 2;
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))     /* builds that include immintrin.h */
        const float d = _cvtsh_ss(rd16(blk));      /* the same value, one instruction */
#else
        const float d = half_to_float(rd16(blk));
#endif
        for (int j = 0; j < 32; j++) out[32 * b + j] = (float)qs[j] * d;
    }
}

/* n floats -> one cache row (gguf's quantize_blocks, bit for bit: float32 arithmetic, no FMA) */
__attribute__((optimize("fp-contract=off")))
static void kv_quant_row(int64_t type, const float *x, int64_t n, uint8_t *p) {
    if (type == T_F16 || type == T_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            if (type == T_F16) {
                h = float_to_half_bits(x[i]);
            } else {                        /* ggml_compute_fp32_to_bf16: quiet nan, nearest even */
                uint32_t u;
                memcpy(&u, x + i, sizeof u);
                if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = (u & 0xFFFF0000u) | (64u << 16);
                h = (uint16_t)(((uint64_t)u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            }
            wr16(p + 2 * i, h);
        }
        return;
    }
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        if (type == T_Q8_0) {
            uint8_t *blk = p + 34 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            wr16(blk, float_to_half_bits(d));
            for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)roundf(xb[j] * id);
            continue;
        }
        const int five = type == T_Q5_0 || type == T_Q5_1, one = type == T_Q4_1 || type == T_Q5_1;
        const int qmax = five ? 31 : 15;
        float d, mn = 0.0f, add;
        if (one) {                                  /* d = (max - min) / qmax, q = (x - min) / d */
            float mx = xb[0];
            mn = xb[0];
            for (int j = 1; j < 32; j++) { mx = xb[j] > mx ? xb[j] : mx; mn = xb[j] < mn ? xb[j] : mn; }
            d = (mx - mn) / (float)qmax;
            add = 0.5f;
        } else {                                    /* d = (signed max |x|) / -(qmax + 1) / 2 */
            float amax = 0.0f, mx = 0.0f;
            for (int j = 0; j < 32; j++)
                if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); mx = xb[j]; }
            d = mx / (five ? -16.0f : -8.0f);
            add = five ? 16.5f : 8.5f;
        }
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int q[32];
        for (int j = 0; j < 32; j++) {
            const float v = one ? (xb[j] - mn) * id + add : xb[j] * id + add;
            const int c = (int)truncf(v);
            q[j] = c < 0 ? 0 : c > qmax ? qmax : c;
        }
        uint8_t *blk = p + (int64_t)(type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24) * b;
        uint8_t *at = blk;
        wr16(at, float_to_half_bits(d));
        at += 2;
        if (one) { wr16(at, float_to_half_bits(mn)); at += 2; }
        if (five) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; j++) qh |= (uint32_t)(q[j] >> 4) << j;
            memcpy(at, &qh, sizeof qh);
            at += 4;
        }
        for (int j = 0; j < 16; j++) at[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
    }
}

/* For the tests: rows of floats -> cache rows, and back. */
typedef struct {
    int64_t type, rows, n;
    const float *x;
    uint8_t *q;
    float *out;       /* NULL: quantize x into q; else dequantize q into out */
} KvConvertArgs;

int metatp_kv_convert(const KvConvertArgs *a) {
    const int64_t rb = kv_row_bytes(a->type, a->n);
    if (rb < 0 || a->type == T_F32) return -1;
    for (int64_t r = 0; r < a->rows; r++) {
        if (a->out) kv_dequant_row(a->type, a->q + r * rb, a->n, a->out + r * a->n);
        else kv_quant_row(a->type, a->x + r * a->n, a->n, a->q + r * rb);
    }
    return 0;
}

/* ------------------------------------------------------------------ set rows
 * dst[ids[t]] = src[t] for T rows of n floats (the KV-cache write of a step), stored as the
 * cache type (`type`: float32 copied, else rounded by kv_quant_row); src row stride in floats,
 * dst row stride in bytes. An id outside [0, dst_rows) is refused (-1) before anything is
 * written. */
typedef struct {
    int64_t T, n;
    const float *src;
    int64_t src_st;
    void *dst;
    int64_t dst_st, dst_rows;
    const int32_t *ids;
    int64_t type;
} SetRowsArgs;

int metatp_set_rows(const SetRowsArgs *a) {
    if (kv_row_bytes(a->type, a->n) < 0) return -5;
    for (int64_t t = 0; t < a->T; t++)
        if (a->ids[t] < 0 || a->ids[t] >= a->dst_rows) return -1;
    for (int64_t t = 0; t < a->T; t++) {
        uint8_t *row = (uint8_t *)a->dst + a->ids[t] * a->dst_st;
        if (a->type == T_F32) memcpy(row, a->src + t * a->src_st, sizeof(float) * (size_t)a->n);
        else kv_quant_row(a->type, a->src + t * a->src_st, a->n, row);
    }
    return 0;
}
