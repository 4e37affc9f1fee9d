/* attention.c: decode attention over the KV cache (part of the unity build cpu_kernels.c, after
 * kv.c, whose row types and row reads it uses, and attn_rows.c, whose row pieces it drives): the
 * units of (KV head, chunk), their online softmax over blocks, and the merge of the chunks. */

/* ------------------------------------------------------------------ attention
 * Softmax attention of a few queries over a KV cache, at memory speed: decode reads the whole
 * cache every step (at a depth of 1536 tokens as many bytes as the weights), so
 *  - every K and V row is read (and, for a 16-bit or quantized cache, dequantized) once per step
 *    per KV head: all the query rows that share a KV head (its query heads x the step's tokens,
 *    GQA) are scored against a row while it is in L1;
 *  - the cache is streamed in blocks of KV_BLOCK rows with an online softmax (running max m,
 *    running sum l, output rescaled when m grows), so nothing of length n_kv is kept;
 *  - the KV length is cut into chunks of ATTN_CHUNK rows at absolute multiples of ATTN_CHUNK;
 *    the OpenMP threads share the (KV head, chunk) units, chunk-major (a thread sweeps a range of
 *    cells, all KV heads of a cell side by side in the cache, its first unit of a chunk
 *    prefetching every head's rows); each unit leaves (m, l, unnormalized output) per query row,
 *    merged afterwards in chunk order with a log-sum-exp;
 *  - V rows of f32/f16/bf16/q8_0 are read in registers (no dequantized copy) by passes serving
 *    V_ROWS query rows at once (v_pass); with numerics "q8" a q8_0 K cache is scored in integers
 *    against Q8_0-rounded queries (dot8_rows_q8), as llama.cpp's CPU flash attention does.
 * Why (issue 25, depth 1536, one thread, this kernel alone over 30 layers): f16 ~290 -> ~180 us a
 * layer, q8_0 ~220 -> ~130, f32 ~430 -> ~310 (memory bound: 2.4 MB a layer); the float paths give
 * the same bits as before.
 * A step of many sequences (each on its own pages, so a unit serves one of them): a unit scores
 * only the groups of eight cells that hold the cells some row of it sees, and prefetches none past
 * them; a decode step of 16 sequences at depth 48 took 3.3 ms over 30 layers against 4.1 (f32
 * cache), 2.4 against 2.8 (q8_0), with a plan's attentions sharing one scratch buffer.
 * Batch invariance: chunks and blocks sit at fixed cache positions (not derived from n_kv, T or
 * the thread count), a query row whose mask hides a whole chunk is skipped there, a hidden block
 * leaves a row's state exactly as it was, and every row's arithmetic is its own; so a row's output
 * depends only on its query, its visible cells and their positions modulo ATTN_CHUNK. A sequence
 * whose first cell is a multiple of ATTN_CHUNK gets the same bits alone or among others.
 * q (H, T, D) float32: q[h*q_sh + t*q_st + d]; k/v (Hkv, n_kv, D|Dv) cache rows of type k_type/
 * v_type at byte strides: row (g, j) at k + g*k_sh + j*k_sj; mask (T, n_kv) additive or NULL:
 * mask[t*m_st + j]; sinks (H) or NULL; out (T, H, Dv): out[t*o_st + h*o_sh + d]. Query head h
 * reads kv head h / (H/Hkv). softcap > 0: s = softcap*tanh(s/softcap) before the mask.
 * scratch: Hkv * max_chunks * (H/Hkv) * T * (Dv + 2) + nthreads * (H/Hkv) * T * KV_BLOCK floats,
 * max_chunks >= ceil(n_kv / ATTN_CHUNK), and with q8 (K type q8_0) H*T*(ceil(D/4) + D/32) + D/16
 * more for the rounded queries. */

enum { KV_BLOCK = 64, ATTN_CHUNK = 128, KV_PREFETCH = 16 };
enum { ATTN_BALANCE_FROM = 64 };    /* query tokens from which a call's units go to threads as they finish */

int metatp_attn_chunk(void) { return ATTN_CHUNK; }

typedef struct {
    int64_t T, H, Hkv, D, Dv, n_kv;   /* n_kv: the visible cache rows, set before each call */
    const float *q;
    int64_t q_sh, q_st;
    const void *k;
    int64_t k_sh, k_sj, k_type;       /* byte strides */
    const void *v;
    int64_t v_sh, v_sj, v_type;
    const float *mask;
    int64_t m_st;
    float scale, softcap;
    const float *sinks;
    float *out;
    int64_t o_st, o_sh;
    float *scratch;
    int64_t max_chunks, nthreads;
    int64_t q8;                       /* 1: integer Q.K with Q8_0 queries for a q8_0 K cache (numerics "q8") */
    /* set by metatp_attention: the queries as Q8_0 codes and scales (NULL: float Q.K) */
    const int8_t *qq;
    const float *qd;
    /* NULL, or the visible length that every attention of a plan reading one mask shares (written
       once a step instead of into each call's n_kv, which is then its upper bound) */
    const int64_t *n_kv_at;
} AttentionArgs;


/* The first and last cells in [j0, j1) that mask row m shows (not -inf), into *first / *last;
 * *first > *last when it shows none. Eight mask values a compare. */
static void visible_span(const float *m, int64_t j0, int64_t j1, int64_t *first, int64_t *last) {
    int64_t f = j0, l = j1 - 1;
#if defined(__AVX2__)
    const __m256 hidden = _mm256_set1_ps(-INFINITY);
    while (f + 8 <= j1) {
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + f), hidden, _CMP_NEQ_UQ));
        if (bits) break;
        f += 8;
    }
#endif
    while (f < j1 && m[f] == -INFINITY) f++;
    if (f == j1) {
        *first = j1;
        *last = j1 - 1;
        return;
    }
#if defined(__AVX2__)
    while (l - 7 > f) {
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + l - 7), hidden, _CMP_NEQ_UQ));
        if (bits) break;
        l -= 8;
    }
#endif
    while (m[l] == -INFINITY) l--;
    *first = f;
    *last = l;
}

/* One unit: KV head g, cache rows [j0, j1) (one chunk), the G = gsize*T query rows of that head
 * that see any of those rows (span[2t], span[2t+1]: the first and last cell query t sees there,
 * first > last for none). part: G rows of (m, l, acc[Dv]); sbuf: G * KV_BLOCK scores. */
static void attn_unit(const AttentionArgs *a, int64_t g, int64_t j0, int64_t j1, const int64_t *span, float *part,
                      float *sbuf, int64_t pf_heads, unsigned char *seen) {
    const int64_t T = a->T, D = a->D, Dv = a->Dv, gsize = a->H / a->Hkv, G = gsize * T, P = Dv + 2;
    const uint8_t *kh = (const uint8_t *)a->k + g * a->k_sh, *vh = (const uint8_t *)a->v + g * a->v_sh;
    const float scale = a->scale, softcap = a->softcap;
    const int64_t D8 = D - D % 8, Dv8 = Dv - Dv % 8, Dv32 = Dv - Dv % 32, vst = Dv + 16, kst = D + 16;
    const int64_t krow_bytes = kv_row_bytes(a->k_type, D), vrow_bytes = kv_row_bytes(a->v_type, Dv);
    float kbuf[8 * kst];              /* dequantized K rows of a group of eight */
    const int v_direct = kv_direct(a->v_type) && Dv % 64 == 0, kq8 = a->qq != NULL;
    const int k_f16 = KV_F16_DIRECT && a->k_type == T_F16 && D8 == D && !kq8;     /* K rows read in registers */
    float *vblock = v_direct ? NULL : (float *)malloc(sizeof(float) * (size_t)(KV_BLOCK * vst));   /* dequantized V rows */
    const float *vrows[KV_BLOCK];
    int64_t rows[G], na = 0, first[T], last[T];
    int64_t lo = j1, hi = j0 - 1;               /* the cells any query row of the unit sees: [lo, hi] */
    for (int64_t t = 0; t < T; t++) {           /* which cells of this chunk does query t see? */
        first[t] = span[2 * t];
        last[t] = span[2 * t + 1];
        seen[t] = first[t] <= last[t];
        if (seen[t]) {
            lo = first[t] < lo ? first[t] : lo;
            hi = last[t] > hi ? last[t] : hi;
        }
    }
    int64_t row_q[G], row_t[G];                 /* the query head and token of each seen row */
    for (int64_t i = 0; i < gsize; i++)
        for (int64_t t = 0; t < T; t++) {
            if (!seen[t]) continue;             /* an unseen chunk: the merge skips it (seen) */
            const int64_t r = i * T + t;
            float *pr = part + r * P;
            pr[0] = -INFINITY;
            pr[1] = 0.0f;
            row_q[na] = g * gsize + i;
            row_t[na] = t;
            rows[na++] = r;
            for (int64_t d = 0; d < Dv; d++) pr[2 + d] = 0.0f;
        }
    if (na == 0 || (!vblock && !v_direct)) {
        free(vblock);
        return;
    }
    /* the V passes take the rows token-major (rows[] is head-major: ia = i * nt_seen + k for the
       k-th token seen): the heads of one token see the same cells, so a pass over V rows serves
       them together, where head-major passes of a step of many sequences would each find one
       row in four with weight (which rows share a pass never changes a row's arithmetic) */
    int64_t vord[G];
    {
        const int64_t nt_seen = na / gsize;
        for (int64_t k = 0, n = 0; k < nt_seen; k++)
            for (int64_t i = 0; i < gsize; i++) vord[n++] = i * nt_seen + k;
    }
    for (int64_t b0 = j0; b0 < j1; b0 += KV_BLOCK) {
        const int64_t nb = j1 - b0 < KV_BLOCK ? j1 - b0 : KV_BLOCK, nb8 = (nb + 7) & ~(int64_t)7;
        /* a block no query row of the unit sees would leave every row's state as it is: skipped
           (in a step of many sequences, most blocks of a sequence's chunk are another's or empty) */
        int used = 0;
        for (int64_t t = 0; t < T && !used; t++) used = seen[t] && first[t] < b0 + nb && last[t] >= b0;
        if (!used) continue;
        /* the groups of eight cells of the block that hold [lo, hi]: the cells outside them are
           hidden from every row (score -inf, weight an exact 0, as the mask would make them), so
           their K and V rows are neither read nor prefetched (a sequence's page in a step of
           many is mostly past its last cell: the reads of those rows were most of the traffic) */
        const int64_t g_lo = lo > b0 ? (lo - b0) & ~(int64_t)7 : 0;
        const int64_t g_hi = hi + 1 - b0 < nb ? hi + 1 - b0 : nb;       /* cells [g_lo, g_hi) scored */
        for (int64_t ia = 0; ia < na; ia++) {
            float *sr = sbuf + ia * KV_BLOCK;
            for (int64_t jj = 0; jj < g_lo; jj++) sr[jj] = -INFINITY;
            for (int64_t jj = (g_hi + 7) & ~(int64_t)7; jj < nb; jj++) sr[jj] = -INFINITY;
        }
        /* scores of the block, eight K rows at a time (each read once for all the unit's query
           rows; eight accumulators hide the FMA latency and are summed by one transpose). A
           missing row of the last group repeats the first and its lanes are dropped, so every
           score is computed the same way wherever the visible cells end. */
        for (int64_t j8 = g_lo; j8 < g_hi; j8 += 8) {
            const float *kr[8];
            /* one head's rows are strided by the other heads' rows: streams too short and sparse
               for the hardware prefetcher (in a decode step attention ran at ~3 GB/s). The first
               unit of a chunk a thread runs prefetches the rows of the chunk's later heads too
               (pf_heads): their units follow on this thread and find them in L2, and the cache is
               swept cell by cell instead of in one sparse stream per head */
            for (int64_t e = 0; e < 8 && pf_heads > 0; e++) {
                int64_t jp = b0 + j8 + KV_PREFETCH + e;
                if (jp > hi) jp = j1 + (jp - hi - 1);      /* past the unit's last seen cell: the next chunk's first */
                if (jp >= j1 + KV_PREFETCH) break;
                for (int64_t gg = 0; gg < pf_heads; gg++) {
                    prefetch_span(kh + gg * a->k_sh + jp * a->k_sj, krow_bytes);
                    prefetch_span(vh + gg * a->v_sh + jp * a->v_sj, vrow_bytes);
                }
            }
            const uint8_t *kp[8];
            for (int e = 0; e < 8; e++) {
                const int64_t jj = j8 + e < nb ? j8 + e : j8;
                kp[e] = kh + (b0 + jj) * a->k_sj;
                if (!kq8 && !k_f16) kr[e] = j8 + e < nb || e == 0 ? kv_row(a->k_type, kh, b0 + jj, a->k_sj, D, kbuf + e * kst) : kr[0];
            }
            for (int64_t ia = 0; ia < na; ia++) {
                const int64_t t = row_t[ia], h = row_q[ia];
                if (last[t] < b0 + j8 || first[t] > b0 + j8 + 7) {
                    /* none of the eight cells is the row's (another sequence's): the mask would
                       make every score -inf, so they are -inf without their dot products (a step
                       of many sequences puts several in one chunk) */
                    for (int e = 0; e < 8; e++) sbuf[ia * KV_BLOCK + j8 + e] = -INFINITY;
                    continue;
                }
                const float *qr = a->q + h * a->q_sh + t * a->q_st;
                float sc8[8];
                if (kq8) dot8_rows_q8(a->qq + (h * T + t) * D, a->qd + (h * T + t) * (D / 32), kp, D / 32, sc8);
#if KV_F16_DIRECT
                else if (k_f16) dot8_rows_f16(qr, kp, D8, sc8);
#endif
                else dot8_rows(qr, kr, D8, sc8);
#if defined(__AVX2__)
                if (D8 == D && softcap <= 0.0f) {
                    /* scale and mask 8 scores at once; the last group of a block takes its mask
                       through a padded copy, so every score goes the same way (no other path) */
                    __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(sc8), _mm256_set1_ps(scale));
                    if (a->mask) {
                        const float *mrow = a->mask + t * a->m_st + b0 + j8;
                        __m256 mv;
                        if (nb - j8 >= 8) {
                            mv = _mm256_loadu_ps(mrow);
                        } else {
                            float m8[8] = {0};
                            memcpy(m8, mrow, sizeof(float) * (size_t)(nb - j8));
                            mv = _mm256_loadu_ps(m8);
                        }
                        /* a hidden cell scores -inf whatever its K row holds (a stale NaN too) */
                        sv = _mm256_blendv_ps(_mm256_add_ps(sv, mv), mv,
                                              _mm256_cmp_ps(mv, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
                    }
                    _mm256_storeu_ps(sbuf + ia * KV_BLOCK + j8, sv);      /* lanes past nb: padding */
                    continue;
                }
#endif
                for (int e = 0; e < 8 && j8 + e < nb; e++) {
                    float sc = sc8[e];
                    for (int64_t d = D8; d < D; d++) sc += qr[d] * kv_load1(kr[e], d);
                    sc *= scale;
                    if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                    if (a->mask) {          /* a hidden cell scores -inf whatever its K row holds */
                        const float mk = a->mask[t * a->m_st + b0 + j8 + e];
                        sc = mk == -INFINITY ? mk : sc + mk;
                    }
                    sbuf[ia * KV_BLOCK + j8 + e] = sc;
                }
            }
        }
        /* online softmax: new running max, rescale, probabilities in place; a block the row
           cannot see changes nothing (its probabilities are exact zeros) */
        for (int64_t ia = 0; ia < na; ia++) {
            float *pr = part + rows[ia] * P, *sr = sbuf + ia * KV_BLOCK;
            for (int64_t jj = nb; jj < nb8; jj++) sr[jj] = -INFINITY;      /* whole vectors: see softmax8 */
            const float bm = block_max8(sr, nb8);
            const float m_new = bm > pr[0] ? bm : pr[0];
            if (m_new == -INFINITY) {                       /* nothing visible yet */
                for (int64_t jj = 0; jj < nb; jj++) sr[jj] = 0.0f;
                continue;
            }
            if (m_new > pr[0]) {
                const float alpha = pr[0] == -INFINITY ? 0.0f : expf(pr[0] - m_new);
                pr[1] *= alpha;
                for (int64_t d = 0; d < Dv; d++) pr[2 + d] *= alpha;
                pr[0] = m_new;
            }
            pr[1] += softmax8(sr, nb, nb8, m_new);
        }
        /* weighted V: the block's V rows read (dequantized) once for all the unit's query rows
           (skipped when no row gives them weight: another sequence's cells cost no V reads); each
           query row then sums them in row order with its accumulator in registers */
        if (v_direct) {         /* V rows read in registers, V_ROWS query rows a pass */
            for (int64_t i0 = 0; i0 < na; i0 += V_ROWS) {
                const int nt = na - i0 < V_ROWS ? (int)(na - i0) : V_ROWS;
                const float *sr[V_ROWS];
                float *acc[V_ROWS];
                for (int r = 0; r < nt; r++) {
                    const int64_t ia = vord[i0 + r];
                    sr[r] = sbuf + ia * KV_BLOCK;
                    acc[r] = part + rows[ia] * P + 2;
                }
                for (int64_t d0 = 0; d0 < Dv; d0 += 64) v_block(a->v_type, nt, vh, a->v_sj, b0, nb, sr, acc, d0);
            }
            continue;
        }
        for (int64_t jj = 0; jj < nb; jj++) {
            int any = 0;
            for (int64_t ia = 0; ia < na && !any; ia++) any = sbuf[ia * KV_BLOCK + jj] != 0.0f;
            vrows[jj] = any ? kv_row(a->v_type, vh, b0 + jj, a->v_sj, Dv, vblock + jj * vst) : NULL;
        }
        for (int64_t ia = 0; ia < na; ia++) {
            const float *sr = sbuf + ia * KV_BLOCK;
            float *acc = part + rows[ia] * P + 2;
            int64_t d = 0;
            for (; d < Dv32; d += 32) {
                v8f a0 = *(v8f_a *)(acc + d), a1 = *(v8f_a *)(acc + d + 8);
                v8f a2 = *(v8f_a *)(acc + d + 16), a3 = *(v8f_a *)(acc + d + 24);
                for (int64_t jj = 0; jj < nb; jj++) {
                    const float p = sr[jj];
                    if (p == 0.0f) continue;
                    const float *vr = vrows[jj];
                    const v8f pv = (v8f){p, p, p, p, p, p, p, p};
                    a0 += pv * kv_load8(vr, d);
                    a1 += pv * kv_load8(vr, d + 8);
                    a2 += pv * kv_load8(vr, d + 16);
                    a3 += pv * kv_load8(vr, d + 24);
                }
                *(v8f_a *)(acc + d) = a0;
                *(v8f_a *)(acc + d + 8) = a1;
                *(v8f_a *)(acc + d + 16) = a2;
                *(v8f_a *)(acc + d + 24) = a3;
            }
            for (; d < Dv8; d += 8) {
                v8f a0 = *(v8f_a *)(acc + d);
                for (int64_t jj = 0; jj < nb; jj++) {
                    const float p = sr[jj];
                    if (p == 0.0f) continue;
                    a0 += (v8f){p, p, p, p, p, p, p, p} * kv_load8(vrows[jj], d);
                }
                *(v8f_a *)(acc + d) = a0;
            }
            for (; d < Dv; d++) {
                float a1 = acc[d];
                for (int64_t jj = 0; jj < nb; jj++)
                    if (sr[jj] != 0.0f) a1 += sr[jj] * kv_load1(vrows[jj], d);
                acc[d] = a1;
            }
        }
    }
    free(vblock);
}

#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

/* One call's shape and its private state: the copy of its arguments the units read (with the
 * visible length and the rounded queries), where its parts go and which units left one. */
typedef struct {
    AttentionArgs args;
    int64_t G, P, nch, units;
    float *parts, *sbufs;
    unsigned char *seen_tab;    /* which (KV head, chunk, query token) units left a part: the merge
                                   reads only those (in a step of many sequences, each row has one
                                   chunk of many, and the parts lie 264 bytes apart) */
    int64_t *spans;             /* per chunk and query token: the first and last cell it sees there */
    int64_t *live, n_live;      /* the chunks some query sees, in order: the units are theirs */
} AttnCall;

/* Which cells of each chunk each query row sees (the mask read once a call, not once a KV head)
 * and which chunks any row sees. Why: a decode step of 16 sequences on a 4096-cell cache reads 16
 * of 32 chunks; the units of the empty ones went to one thread in the static share, which then
 * did half the work while the other did none (76 against 38 us a layer). Units now exist for the
 * chunks some row sees only. */
static void attn_spans(AttnCall *c) {
    const AttentionArgs *a = &c->args;
    const int64_t T = a->T;
    c->n_live = 0;
    for (int64_t cc = 0; cc < c->nch; cc++) {
        const int64_t j0 = cc * ATTN_CHUNK, j1 = j0 + ATTN_CHUNK < a->n_kv ? j0 + ATTN_CHUNK : a->n_kv;
        int64_t *span = c->spans + cc * T * 2;
        int any = 0;
        for (int64_t t = 0; t < T; t++) {
            span[2 * t] = j0;
            span[2 * t + 1] = j1 - 1;
            if (a->mask) visible_span(a->mask + t * a->m_st, j0, j1, &span[2 * t], &span[2 * t + 1]);
            any |= span[2 * t] <= span[2 * t + 1];
        }
        if (any) c->live[c->n_live++] = cc;
    }
}

/* Checks one call and prepares it: 0, or the error code of metatp_attention. */
static int attn_setup(const AttentionArgs *in, AttnCall *c) {
    c->args = *in;
    AttentionArgs *a = &c->args;
    if (a->n_kv_at && *a->n_kv_at < a->n_kv) a->n_kv = *a->n_kv_at;
    const int64_t T = a->T, H = a->H, Hkv = a->Hkv, Dv = a->Dv, n_kv = a->n_kv;
    c->seen_tab = NULL;
    if (Hkv <= 0 || H % Hkv || n_kv <= 0 || T <= 0 || a->nthreads < 1) return -1;
    if (kv_row_bytes(a->k_type, a->D) < 0 || kv_row_bytes(a->v_type, Dv) < 0) return -5;
    c->G = H / Hkv * T;
    c->P = Dv + 2;
    c->nch = (n_kv + ATTN_CHUNK - 1) / ATTN_CHUNK;
    if (c->nch > a->max_chunks) return -2;
    c->parts = a->scratch;
    c->sbufs = a->scratch + Hkv * a->max_chunks * c->G * c->P;
    a->qq = NULL;
    a->qd = NULL;
    if (a->q8 && a->k_type == T_Q8_0) {
        /* the queries rounded once a call (llama.cpp's Q8_0 activation rounding), after the
           scores' scratch: H*T rows of D codes, D/32 scales and D/16 integer sums (unused) */
        const int64_t D = a->D, nrow = H * T;
        int8_t *qq = (int8_t *)(c->sbufs + a->nthreads * c->G * KV_BLOCK);
        float *qd = (float *)(qq + (nrow * D + 3) / 4 * 4);
        int32_t *isum = (int32_t *)(qd + nrow * (D / 32));
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                q8_quantize_row(Q8_0, D, a->q + h * a->q_sh + t * a->q_st, qq + (h * T + t) * D,
                                qd + (h * T + t) * (D / 32), NULL, isum);
        a->qq = qq;
        a->qd = qd;
    }
    /* one block: the seen table (zero: no unit has left a part yet), the spans, the live chunks */
    const size_t seen_bytes = ((size_t)(Hkv * c->nch * T) + 7) & ~(size_t)7;
    c->seen_tab = (unsigned char *)calloc(1, seen_bytes + sizeof(int64_t) * (size_t)(c->nch * T * 2 + c->nch));
    if (!c->seen_tab) return -3;
    c->spans = (int64_t *)(c->seen_tab + seen_bytes);
    c->live = c->spans + c->nch * T * 2;
    attn_spans(c);
    c->units = Hkv * c->n_live;
    return 0;
}

/* Unit u of a call: chunk-major over the live chunks (a thread streams consecutive cells, all KV
 * heads of a cell side by side in the cache); prefetch: whether this is the thread's first unit of
 * the chunk. */
static void attn_run_unit(const AttnCall *c, int64_t u, float *sbuf, int first_of_chunk) {
    const AttentionArgs *a = &c->args;
    const int64_t Hkv = a->Hkv, cc = c->live[u / Hkv], g = u % Hkv, j0 = cc * ATTN_CHUNK;
    const int64_t j1 = j0 + ATTN_CHUNK < a->n_kv ? j0 + ATTN_CHUNK : a->n_kv;
    attn_unit(a, g, j0, j1, c->spans + cc * a->T * 2, c->parts + (g * c->nch + cc) * c->G * c->P, sbuf,
              first_of_chunk ? Hkv - g : 0, c->seen_tab + (g * c->nch + cc) * a->T);
}

/* Merged row gr (KV head g, its query row r) of a call: its chunks in chunk order (log-sum-exp),
 * the sink added, normalized. */
static void attn_merge_row(const AttnCall *c, int64_t gr) {
    const AttentionArgs *a = &c->args;
    const int64_t T = a->T, G = c->G, P = c->P, nch = c->nch, Dv = a->Dv, gsize = a->H / a->Hkv;
    const int64_t g = gr / G, r = gr - g * G, i = r / T, t = r - i * T, h = g * gsize + i;
    const float *parts = c->parts;
    float m = a->sinks ? a->sinks[h] : -INFINITY;
    const unsigned char *seen = c->seen_tab + g * nch * T + t;    /* seen[c * T]: chunk c has a part */
    for (int64_t li = 0; li < c->n_live; li++) {       /* the other chunks have no part */
        const int64_t k = c->live[li];
        if (!seen[k * T]) continue;
        const float mc = parts[((g * nch + k) * G + r) * P];
        m = mc > m ? mc : m;
    }
    float *orow = a->out + t * a->o_st + h * a->o_sh;
    for (int64_t d = 0; d < Dv; d++) orow[d] = 0.0f;
    if (m == -INFINITY) return;
    float l = a->sinks ? expf(a->sinks[h] - m) : 0.0f;
    for (int64_t li = 0; li < c->n_live; li++) {
        const int64_t k = c->live[li];
        if (!seen[k * T]) continue;
        const float *pc = parts + ((g * nch + k) * G + r) * P;
        if (pc[0] == -INFINITY) continue;
        const float w = expf(pc[0] - m);
        l += w * pc[1];
        for (int64_t d = 0; d < Dv; d++) orow[d] += w * pc[2 + d];
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < Dv; d++) orow[d] *= inv;
}

/* Several independent attentions in one parallel region: under -sm tensor one layer's attention
 * on every simulated device (each its own heads, cache and scratch). The threads share the units
 * of all of them, then the merged rows of all of them; the thread count is chosen from the work
 * of all together (a device's share alone stayed on one thread at depths where the whole layer
 * used two). Threads change who computes a unit or a row, never what it computes, so the bits
 * are those of separate calls. */
typedef struct {
    int64_t n;
    const AttentionArgs *const *items;
    int64_t nthreads;
} AttentionGroup;

/* Unit u of a group's units (first_unit[i]: call i's first) on thread th; *last_i, *last_c: the
 * call and chunk of this thread's previous unit (its first unit of a chunk prefetches). */
static inline void attn_group_unit(const AttnCall *calls, const int64_t *first_unit, int64_t u, int th,
                                   int64_t *last_i, int64_t *last_c) {
    int64_t i = 0;
    while (u >= first_unit[i + 1]) i++;
    const AttnCall *c = &calls[i];
    const int64_t uu = u - first_unit[i], cc = c->live[uu / c->args.Hkv];
    attn_run_unit(c, uu, c->sbufs + (int64_t)th * c->G * KV_BLOCK, i != *last_i || cc != *last_c);
    *last_i = i;
    *last_c = cc;
}

int metatp_attention_group(const AttentionGroup *grp) {
    const int64_t n = grp->n;
    if (n < 1 || n > MAX_ITEMS) return -4;
    AttnCall *calls = (AttnCall *)malloc(sizeof(AttnCall) * (size_t)n);
    if (!calls) return -3;
    int64_t first_unit[MAX_ITEMS + 1], first_row[MAX_ITEMS + 1], work = 0;
    int rc = 0;
    first_unit[0] = first_row[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        calls[i].seen_tab = NULL;
        if (!rc) rc = attn_setup(grp->items[i], &calls[i]);
        if (rc) continue;
        const AttnCall *c = &calls[i];
        first_unit[i + 1] = first_unit[i] + c->units;
        first_row[i + 1] = first_row[i] + c->args.Hkv * c->G;
        work += c->args.n_kv * c->args.Hkv * c->G;
        /* every item's scratch must hold a block of scores for each of the group's threads */
        if (c->args.nthreads < grp->nthreads) rc = -1;
    }
    if (rc) {
        for (int64_t i = 0; i < n; i++) free(calls[i].seen_tab);
        free(calls);
        return rc;
    }
    const int64_t units = first_unit[n], rows = first_row[n];
    const int nthreads = grp->nthreads > 1 && work >= 4096 && units > 1 ? team_size(grp->nthreads) : 1;
    int64_t max_T = 0;
    for (int64_t i = 0; i < n; i++) max_T = calls[i].args.T > max_T ? calls[i].args.T : max_T;
    /* A pass of a prompt's tokens: its causal mask gives the chunks unequal work (the first is
     * seen by every row, the last by few), and the static share left one thread ~70% of a
     * 512-token pass's units, so threads take units as they finish (pp512 q8 +12%, alternated
     * runs). Decode keeps the static chunk-major sweep: its locality and prefetch (at depth 1536,
     * f32 cache: 68 us a layer static, 81-85 taken as they finish). A unit's work does not depend
     * on its thread either way. */
    const int balance = max_T >= ATTN_BALANCE_FROM;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int th = THREAD_NUM();
        int64_t last_i = -1, last_c = -1;      /* the call and chunk of this thread's previous unit */
        if (balance) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < units; u++) attn_group_unit(calls, first_unit, u, th, &last_i, &last_c);
        } else {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) attn_group_unit(calls, first_unit, u, th, &last_i, &last_c);
        }
#pragma omp for schedule(static)
        for (int64_t gr = 0; gr < rows; gr++) {
            int64_t i = 0;
            while (gr >= first_row[i + 1]) i++;
            attn_merge_row(&calls[i], gr - first_row[i]);
        }
    }
    for (int64_t i = 0; i < n; i++) free(calls[i].seen_tab);
    free(calls);
    return 0;
}

int metatp_attention(const AttentionArgs *a) {
    const AttentionGroup one = {1, &a, a->nthreads};
    return metatp_attention_group(&one);
}
