/* q8_matmul.c: the integer matrix product of numerics="llamacpp" (part of the unity build
 * cpu_kernels.c, after q8.c and repack.c): activations rounded to Q8 blocks once per call, then
 * row-major weights in register tiles (here) or row-group weights a group at a time (repack.c),
 * the threads sharing out chunks of rows of every item of a group. */

/* Steps of at least this many tokens take the GEMM (fewer: repack.c's decode tile, which reads
 * one group at a time, as a step bound by reading the weights wants). */
enum { GEMM_MIN_TOKENS = 8 };


/* Row groups a chunk of the GEMM: a pair in a 512-bit or an AVX2 build, else one (repack.c's tile, run one
 * token block at a time all the same: the cache blocking serves every build). */
enum { GEMM_GROUPS = Q8_GEMM512 || Q8_GEMM256 ? 2 : 1 };

/* Does item `a` take the GEMM's schedule? (row-group layout, enough tokens) */
static int gemm_takes(const Q8MatmulArgs *a) {
    return a->group == 8 && a->ntok >= GEMM_MIN_TOKENS;
}

/* Rows (in groups of 8) of chunk c of a GEMM item against tokens t0 .. t1-1; a last group
 * without a partner takes repack.c's tile (the same results: see q8_gemm.c). `amx`: this
 * thread has loaded q8_amx.c's tile shapes. */
static void gemm_chunk(const Q8MatmulArgs *a, const Q8Act *x, int64_t c, int64_t t0, int64_t t1, int amx) {
    const int64_t g = GEMM_GROUPS * c;
#if Q8_GEMM_AMX
    if (amx && amx_takes(a) && g + 1 < a->rows / 8) {
        amx_pair(a, x, g, t0, t1);
        return;
    }
#else
    (void)amx;
#endif
#if Q8_GEMM512
    if (g + 1 < a->rows / 8) {
        gemm_pair(a, x, g, t0, t1);
        return;
    }
#elif Q8_GEMM256
    if (g + 1 < a->rows / 8) {
        gemm256_pair(a, x, g, t0, t1);
        return;
    }
#endif
    q8x8_group_range(a, x, g, t0, t1);
}

#if Q8_SIMD
/* R rows (from r0) x T tokens (from t0) of one item for one weight format; every argument but
 * the pointers is a constant at each call site, so the loops unroll and the accumulators stay in
 * registers. One block's codes are unpacked once for all T tokens and one token's codes are read
 * for all R rows. Each (row, token) sum is one 8-lane accumulator taking the blocks in order, so
 * neither the tile shape nor the step's other tokens change a result (batch invariance); R rows
 * give the FMA unit R * T independent chains. res[i * T + t]. */
static inline __attribute__((always_inline)) void q8_tile(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
        int bits, int signed_w, int block32, int dshift, float *res) {
    const int64_t k = a->k, nb32 = k / 32, nbw = k / a->block, nd = dshift ? k / QK : nb32;
    const int64_t rowbytes = k * bits / 8;
    const int bias = (int)a->bias;
    const uint8_t *q0 = (const uint8_t *)a->q + r0 * rowbytes;
    const float *s0 = a->scale + r0 * nbw;
    const uint8_t *pf = q0 + PREFETCH_ROWS * rowbytes;
    prefetch_span(s0 + PREFETCH_ROWS * nbw, R * nbw * (int64_t)sizeof(float));
    if (a->offset) prefetch_span(a->offset + (r0 + PREFETCH_ROWS) * nbw, R * nbw * (int64_t)sizeof(float));
    const int64_t step = R * bits * 4;          /* the tile's code bytes per block */
    __m256 acc[4][4];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb32; b++) {
        for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(pf + b * step + off);
        for (int i = 0; i < R; i++) {
            const __m256i w = q8_weight32(q0 + i * rowbytes, b, bits, signed_w && bits == 4 ? bias : 0);
            const __m256i wu = signed_w ? _mm256_abs_epi8(w) : w;
            const float *sw = s0 + i * nbw;
            const __m256 sv = block32 ? _mm256_set1_ps(sw[b])
                                      : _mm256_set_m128(_mm_set1_ps(sw[2 * b + 1]), _mm_set1_ps(sw[2 * b]));
            for (int t = 0; t < T; t++) {
                const int8_t *xq = x->q + (t0 + t) * k + b * 32;
                const __m256i iv = q8_dot32(wu, w, _mm256_loadu_si256((const __m256i *)xq), signed_w);
                const __m256 f = _mm256_mul_ps(sv, _mm256_set1_ps(x->d[(t0 + t) * nd + (b >> dshift)]));
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), f, acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) res[i * T + t] = q8_hsum8(acc[i][t]);
}
#else
/* portable: one (row, token) at a time, the same block order */
static inline void q8_tile(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
                           int bits, int signed_w, int block32, int dshift, float *res) {
    (void)signed_w;
    const int64_t k = a->k, nb32 = k / 32, nbw = k / a->block, nd = dshift ? k / QK : nb32;
    for (int i = 0; i < R; i++) {
        const void *qrow = (const uint8_t *)a->q + (r0 + i) * (k * bits / 8);
        const float *sw = a->scale + (r0 + i) * nbw;
        for (int t = 0; t < T; t++) {
            const int8_t *xq = x->q + (t0 + t) * k;
            const float *dx = x->d + (t0 + t) * nd;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb32; b++) {
                int32_t is[2];
                q8_block_isums(qrow, b, bits, (int)a->bias, xq, is);
                const float db = dx[b >> dshift];
                if (block32) sum += sw[b] * db * (float)(is[0] + is[1]);
                else sum += sw[2 * b] * db * (float)is[0] + sw[2 * b + 1] * db * (float)is[1];
            }
            res[i * T + t] = sum;
        }
    }
}
#endif

/* The tile's results plus the offset term (per row and token, in block order), into y. */
static __attribute__((noinline, noclone)) void q8_store(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int R, int64_t t0, int T,
                            const float *res) {
    const int64_t nbw = a->k / a->block;
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) {
            float v = res[i * T + t];
            if (a->offset) {
                v += dot_f32(a->offset + (r0 + i) * nbw, x->xs + (t0 + t) * nbw, nbw);
            }
            a->y[(t0 + t) * a->ldy + r0 + i] = v;
        }
}

/* Rows r0 .. r0+nr of an item against all its tokens (TILE_ROWS): two rows a tile for 3 or 4
 * tokens, four for 1 or 2. */
static inline __attribute__((always_inline)) void q8_chunk_fmt(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int64_t nr,
        int bits, int signed_w, int block32, int dshift) {
    float res[16];
#define Q8_TILE(r, R, t0, T) do { \
        q8_tile(a, x, (r), (R), (t0), (T), bits, signed_w, block32, dshift, res); \
        q8_store(a, x, (r), (R), (t0), (T), res); \
    } while (0)
    TILE_ROWS(Q8_TILE, a->ntok, r0, nr, 2, 2, 4, 4);
#undef Q8_TILE
}

/* One chunk of rows, dispatched on the weight format (the combinations the GGUF types give:
 * 8-bit codes; nibbles with or without a bias; blocks of 32 or 16 weights; activation scales
 * per 32 or per 256). */
static void q8_chunk(const Q8MatmulArgs *a, const Q8Act *x, int64_t r0, int64_t nr) {
    const int bits = (int)a->bits, block32 = a->block == 32, dshift = a->kind == Q8_K ? 3 : 0;
    const int signed_w = !(bits == 4 && a->bias == 0);
#define Q8_FMT(B, S) do { \
        if (block32 && !dshift) q8_chunk_fmt(a, x, r0, nr, (B), (S), 1, 0); \
        else if (block32) q8_chunk_fmt(a, x, r0, nr, (B), (S), 1, 3); \
        else q8_chunk_fmt(a, x, r0, nr, (B), (S), 0, 3); \
    } while (0)
    if (bits == 8) Q8_FMT(8, 1);
    else if (signed_w) Q8_FMT(4, 1);
    else Q8_FMT(4, 0);
#undef Q8_FMT
}

/* Bytes of one item's quantized activations in the call's scratch. */
static size_t q8_act_bytes(const Q8MatmulArgs *a) {
    const int64_t k = a->k, n = a->ntok;
    return (size_t)(n * k) + sizeof(float) * (size_t)(n * (k / 32) * 2 + n * (k / a->block))
           + sizeof(int32_t) * (size_t)(n * (k / 16)) + 64;
}

/* Lay out item i's quantized activations in the scratch at *at, or share those of an earlier
 * item that reads the same rows the same way (Q, K and V read one normed x). Returns 1 when item
 * i owns them (its rows are then quantized by `q8_quantize_token`). */
static int q8_prepare_act(const Q8MatmulGroup *g, int64_t i, Q8Act *acts, char **at) {
    const Q8MatmulArgs *a = g->items[i];
    for (int64_t j = 0; j < i; j++) {
        const Q8MatmulArgs *b = g->items[j];
        if (b->x == a->x && b->ldx == a->ldx && b->ntok == a->ntok && b->k == a->k && b->kind == a->kind
            && b->block == a->block && (b->offset != NULL) == (a->offset != NULL)) {
            acts[i] = acts[j];
            return 0;
        }
    }
    const int64_t k = a->k, n = a->ntok, nbw = k / a->block;
    char *p = *at;
    Q8Act *x = &acts[i];
    x->d = (float *)p; p += sizeof(float) * (size_t)(n * (k / 32));
    x->s = (float *)p; p += sizeof(float) * (size_t)(n * (k / 32));
    x->xs = a->offset ? (float *)p : NULL; p += sizeof(float) * (size_t)(n * nbw);
    x->isum = (int32_t *)p; p += sizeof(int32_t) * (size_t)(n * (k / 16));
    x->q = (int8_t *)p; p += (size_t)(n * k);
    *at = (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    return 1;
}

/* Token t of an item's activations: rounded to Q8 blocks, and (with an offset) the per-block
 * multipliers of the offset term. Each token is independent of the others (the threads share
 * them out). */
static void q8_quantize_token(const Q8MatmulArgs *a, const Q8Act *x, int64_t t) {
    const int64_t k = a->k, nbw = k / a->block, nd = a->kind == Q8_K ? k / QK : k / 32;
    q8_quantize_row(a->kind, k, a->x + t * a->ldx, x->q + t * k, x->d + t * nd, x->s + t * (k / 32),
                    x->isum + t * (k / 16));
    if (!x->xs) return;
    for (int64_t b = 0; b < nbw; b++) {
        float v;
        if (a->kind == Q8_1) {
            v = x->s[t * (k / 32) + b];                              /* llama.cpp's f16 s */
        } else {
            const int32_t *is = x->isum + t * (k / 16);
            const int32_t sum = a->block == 16 ? is[b] : is[2 * b] + is[2 * b + 1];
            v = x->d[t * nd + b * a->block / QK] * (float)sum;
        }
        x->xs[t * nbw + b] = v;
    }
}

/* Chunks of work an item has: groups of 8 rows (GEMM_GROUPS for the GEMM), or CHUNK_ROWS row-major rows. */
static int64_t q8_chunks(const Q8MatmulArgs *a) {
    if (a->group == 8) return gemm_takes(a) ? (a->rows / 8 + GEMM_GROUPS - 1) / GEMM_GROUPS : a->rows / 8;
    return (a->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
}

/* Chunk c of item a in token block tb: a GEMM item runs its tokens one block of GEMM_TOKEN_BLOCK
 * at a time (block tb), any other item all its tokens at once (in block 0). `amx`: as gemm_chunk. */
static void q8_run_chunk(const Q8MatmulArgs *a, const Q8Act *x, int64_t c, int64_t tb, int amx) {
    if (gemm_takes(a)) {
        const int64_t t0 = tb * GEMM_TOKEN_BLOCK, t1 = t0 + GEMM_TOKEN_BLOCK;
        if (t0 < a->ntok) gemm_chunk(a, x, c, t0, t1 < a->ntok ? t1 : a->ntok, amx);
        return;
    }
    if (tb) return;
    if (a->group == 8) {
        q8x8_group(a, x, c);
        return;
    }
    const int64_t r0 = c * CHUNK_ROWS, left = a->rows - r0;
    q8_chunk(a, x, r0, left < CHUNK_ROWS ? left : CHUNK_ROWS);
}

/* Chunk c of the call's chunks (numbered across its items by first_chunk) in token block tb. */
static void q8_run_item_chunk(const Q8MatmulGroup *g, const Q8Act *acts, const int64_t *first_chunk, int64_t c,
                              int64_t tb, int amx) {
    int64_t i = 0;
    while (c >= first_chunk[i + 1]) i++;
    q8_run_chunk(g->items[i], &acts[i], c - first_chunk[i], tb, amx);
}

/* Tokens from which a call rounds its activations on every thread. */
enum { SHARED_QUANT_TOKENS = 4 };

int metatp_q8_matmul(const Q8MatmulGroup *g) {
    const int64_t n = g->n;
    if (n < 1 || n > MAX_ITEMS) return -4;
    int64_t first_chunk[MAX_ITEMS + 1], work = 0, blocks = 1;
    size_t bytes = 64;
    first_chunk[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const Q8MatmulArgs *a = g->items[i];
        const int rc = q8_check(a);
        if (rc) return rc;
        first_chunk[i + 1] = first_chunk[i] + q8_chunks(a);
        work += a->rows * a->k * a->ntok;
        bytes += q8_act_bytes(a);
        if (gemm_takes(a) && (a->ntok + GEMM_TOKEN_BLOCK - 1) / GEMM_TOKEN_BLOCK > blocks)
            blocks = (a->ntok + GEMM_TOKEN_BLOCK - 1) / GEMM_TOKEN_BLOCK;
    }
    char *scratch = (char *)malloc(bytes);
    if (!scratch) return -3;
    Q8Act acts[MAX_ITEMS];
    int64_t owners[MAX_ITEMS], n_owners = 0;
    char *at = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (int64_t i = 0; i < n; i++)
        if (q8_prepare_act(g, i, acts, &at)) owners[n_owners++] = i;
    const int nthreads = work < (int64_t)1 << 17 ? 1 : team_size(g->nthreads);
    const int64_t total = first_chunk[n];
    int64_t most_tokens = 0;
    for (int64_t o = 0; o < n_owners; o++)
        if (g->items[owners[o]]->ntok > most_tokens) most_tokens = g->items[owners[o]]->ntok;
    /* a step of several tokens quantizes them on every thread (one more barrier: on one thread
     * the rounding of 16 tokens took ~9% of a 16-sequence decode step); one token before the
     * parallel region, whose only barrier is then its end */
    const int shared_quant = nthreads > 1 && most_tokens >= SHARED_QUANT_TOKENS, amx = amx_wanted(g);
    if (!shared_quant)
        for (int64_t o = 0; o < n_owners; o++)
            for (int64_t t = 0; t < g->items[owners[o]]->ntok; t++)
                q8_quantize_token(g->items[owners[o]], &acts[owners[o]], t);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        amx_begin(amx);
        if (shared_quant) {
            for (int64_t o = 0; o < n_owners; o++) {
                const Q8MatmulArgs *a = g->items[owners[o]];
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < a->ntok; t++) q8_quantize_token(a, &acts[owners[o]], t);
            }
#pragma omp barrier
        }
        if (blocks == 1) {
            /* one token block: chunks go to whichever thread is free (a chunk's results do not
             * depend on the thread; with static halves one thread waited ~7% of the products) */
#pragma omp for schedule(guided) nowait
            for (int64_t c = 0; c < total; c++) q8_run_item_chunk(g, acts, first_chunk, c, 0, amx);
        }
        else
            for (int64_t tb = 0; tb < blocks; tb++) {
                /* static: a thread gets the same rows in every token block (its weights stay in its cache) */
#pragma omp for schedule(static) nowait
                for (int64_t c = 0; c < total; c++) q8_run_item_chunk(g, acts, first_chunk, c, tb, amx);
            }
        amx_end(amx);
    }
    free(scratch);
    return 0;
}

/* For the tests: the exact int32 sums per (token, row, 16-element half-block) of item g->items[0]
 * against activations already quantized by metatp_q8_quantize (codes in `xq`, ntok * k). */
typedef struct {
    const Q8MatmulArgs *w;
    const int8_t *xq;
    int32_t *out;          /* ntok * rows * (k/16) */
} Q8IsumArgs;

int metatp_q8_isums(const Q8IsumArgs *a) {
    const Q8MatmulArgs *w = a->w;
    const int64_t k = w->k;
    if (w->k <= 0 || w->k % 32 || !(w->bits == 8 || w->bits == 4)) return -2;
    if (w->group != 1) {
        if (!layout_ok(w->group, w->half_scales, w->bits, w->block, w->rows)) return -6;
        const int64_t nb = k / 32, gbytes = 32 * w->bits;
        const int bits = (int)w->bits;
        for (int64_t t = 0; t < w->ntok; t++)
            for (int64_t g = 0; g < w->rows / 8; g++)
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *xb = a->xq + t * k + b * 32;
                    int32_t xsum = 0;
                    for (int i = 0; i < 32; i++) xsum += xb[i];
                    const uint8_t *gb = (const uint8_t *)w->q + (g * nb + b) * gbytes;
                    int32_t is[8];
#if Q8_SIMD
                    __m256i uv[8], wv[8];
                    q8x8_unpack(gb, bits, uv, wv);
                    _mm256_storeu_si256((__m256i *)is, q8x8_isum(uv, wv, bits, xb, (int32_t)w->bias * xsum));
#else
                    q8x8_isum_c(gb, bits, xb, (int32_t)w->bias * xsum, is);
#endif
                    for (int r = 0; r < 8; r++) a->out[(t * w->rows + g * 8 + r) * nb + b] = is[r];
                }
        return 0;
    }
    for (int64_t t = 0; t < w->ntok; t++)
        for (int64_t r = 0; r < w->rows; r++) {
            const void *qrow = (const uint8_t *)w->q + r * (k * w->bits / 8);
            for (int64_t b = 0; b < k / 32; b++)
                q8_block_isums(qrow, b, (int)w->bits, (int)w->bias, a->xq + t * k,
                               a->out + (t * w->rows + r) * (k / 16) + 2 * b);
        }
    return 0;
}
