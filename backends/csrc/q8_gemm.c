/* q8_gemm.c: the integer matrix product for steps of many tokens (prefill, large batches) on
 * weights in the row-group layout, with 512-bit registers (part of the unity build cpu_kernels.c,
 * after repack.c, whose layout and helpers it uses; q8_matmul.c dispatches to it).
 *
 * Why: repack.c's tile serves 8 rows (one group) and up to 4 tokens from 256-bit registers, which
 * suits decode (bound by reading the weights) but leaves a step of hundreds of tokens bound by
 * instructions. Here one 512-bit register holds the same word of two groups (16 rows), so one
 * vpdpbusd does 64 multiply-adds, and a tile keeps 16 rows x 8 tokens of accumulators in
 * registers: each weight block is unpacked once for 8 tokens, each token's codes are broadcast
 * once for 16 rows. 8-bit codes are made unsigned by flipping their top bit (code + 128) and the
 * 128 * sum(x) this adds is taken off afterwards (AVX-512 has no byte sign instruction).
 *
 * Exactness: the integer sums are exact whatever the instruction sequence, and every (row, token)
 * result is formed by the same float operations as repack.c's tile, in the same block order
 * (acc = fma(float(isum), scale * d, acc) per block; offsets in their own accumulator, added
 * last), so results are bit-identical to it at every token count and tile remainder. */

/* Tokens a cache block: each thread runs its rows over one block of tokens before the next, so
 * its weights are read from L2 while the block's activations (at most GEMM_TOKEN_BLOCK * K bytes)
 * stay there too. */
enum { GEMM_TOKEN_BLOCK = 64 };

#if Q8_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_GEMM512 1

/* How many blocks ahead the first tile of a token block prefetches its rows' codes and scales
 * (past the pair's last block: the next pair's, which this thread runs next). Why: a step of 8-16
 * tokens reads each weight once from memory, and the hardware prefetcher left the tiles waiting
 * on it. The 211 weights of the default model, 2 threads, with and without, in one process: 8
 * tokens 8.3 ms against 11.0, 16 tokens 12.4 against 13.9, 64 58.6 against 66.1, 256 147 against
 * 162 (48 blocks ahead beat 4-32 and matched 64; a linear stream over the pair did no better). */
#ifndef GEMM_PREFETCH_BLOCKS
#define GEMM_PREFETCH_BLOCKS 48
#endif

/* Tokens a tile (accumulators: 8 + 8 for the offset term, 8 unpacked words: 24 of 32 registers). */
enum { GEMM_T = 8 };

/* Word j of block b of groups A (low half) and B (high half) as unsigned bytes: nibbles, or
 * 8-bit codes + 128. u[j] for j < 4 (nibbles: the low ones) meets x codes 4j..4j+3, u[4 + j]
 * the high nibbles (16 + 4j..); 8-bit codes: word j meets x codes 4j..4j+3. */
static inline __attribute__((always_inline)) void gemm_unpack(const uint8_t *ga, const uint8_t *gb, int bits,
                                                              __m512i u[8]) {
    if (bits == 8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int j = 0; j < 8; j++) {
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(ga + 32 * j))),
                                                 _mm256_loadu_si256((const __m256i *)(gb + 32 * j)), 1);
            u[j] = _mm512_xor_si512(v, flip);
        }
        return;
    }
    const __m512i m = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(ga + 32 * j))),
                                             _mm256_loadu_si256((const __m256i *)(gb + 32 * j)), 1);
        u[j] = _mm512_and_si512(v, m);
        u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    }
}

/* 8 scales (or offsets) of group A's block and 8 of group B's, as 16 floats. */
static inline __attribute__((always_inline)) __m512 gemm_scales(const uint8_t *pa, const uint8_t *pb, int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                                       _mm_loadu_si128((const __m128i *)pb), 1));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps((const float *)pa))),
                                               _mm256_castps_pd(_mm256_loadu_ps((const float *)pb)), 1));
}

/* Groups g, g+1 (rows 8g .. 8g+15) against tokens t0 .. t0+T-1. `corr` is what the unsigned
 * bytes add to the exact sum per unit of sum(x): 128 for 8-bit codes, the nibble bias, or 0. */
static inline __attribute__((always_inline)) void gemm_tile(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int T, int bits, int dshift, int has_off,
        int half, int corr) {
    const int64_t k = a->k, nb = k / 32, nd = dshift ? k / QK : nb, gbytes = 32 * bits;
    const uint8_t *qa = (const uint8_t *)a->q + g * nb * gbytes, *qb = qa + nb * gbytes;
    const int64_t sb = half ? 2 : 4;
    const uint8_t *sa = (const uint8_t *)a->scale + g * nb * 8 * sb, *sbb = sa + nb * 8 * sb;
    const uint8_t *ma = has_off ? (const uint8_t *)a->offset + g * nb * 8 * sb : NULL;
    const uint8_t *mb = has_off ? ma + nb * 8 * sb : NULL;
    __m512 acc[GEMM_T], off[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = off[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i u[8];
        if (t0 % GEMM_TOKEN_BLOCK == 0 && GEMM_PREFETCH_BLOCKS) {     /* the first tile of a token block meets the rows first */
            const int64_t bp = b + GEMM_PREFETCH_BLOCKS;
            for (int64_t o = 0; o < gbytes; o += 64) {
                __builtin_prefetch(qa + bp * gbytes + o);
                __builtin_prefetch(qb + bp * gbytes + o);
            }
            if ((b & (sb == 2 ? 3 : 1)) == 0) {   /* 8 scales of 2 or 4 bytes a block: a line per 4 (or 2) blocks */
                __builtin_prefetch(sa + bp * 8 * sb);
                __builtin_prefetch(sbb + bp * 8 * sb);
                if (has_off) {
                    __builtin_prefetch(ma + bp * 8 * sb);
                    __builtin_prefetch(mb + bp * 8 * sb);
                }
            }
        }
        gemm_unpack(qa + b * gbytes, qb + b * gbytes, bits, u);
        const __m512 sv = gemm_scales(sa + b * 8 * sb, sbb + b * 8 * sb, half);
        const __m512 mv = has_off ? gemm_scales(ma + b * 8 * sb, mb + b * 8 * sb, half) : _mm512_setzero_ps();
        for (int t = 0; t < T; t++) {
            const int64_t tt = t0 + t;
            const q8_i32 *xw = (const q8_i32 *)(x->q + tt * k + b * 32);
            /* broadcasts straight from memory (a load each, folded into the multiply-add), two
             * chains of sums */
            __m512i iv = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(xw[0]));
            __m512i iw = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_set1_epi32(xw[1]));
            for (int j = 2; j < 8; j += 2) {
                iv = _mm512_dpbusd_epi32(iv, u[j], _mm512_set1_epi32(xw[j]));
                iw = _mm512_dpbusd_epi32(iw, u[j + 1], _mm512_set1_epi32(xw[j + 1]));
            }
            iv = _mm512_add_epi32(iv, iw);
            if (corr) {
                const int32_t *is = x->isum + tt * (k / 16) + 2 * b;
                iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(corr * (is[0] + is[1])));
            }
            const __m512 f = _mm512_mul_ps(sv, _mm512_set1_ps(x->d[tt * nd + (b >> dshift)]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), f, acc[t]);
            if (has_off) off[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->xs[tt * nb + b]), off[t]);
        }
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(a->y + (t0 + t) * a->ldy + g * 8, has_off ? _mm512_add_ps(acc[t], off[t]) : acc[t]);
}

/* Tokens t0 .. t1-1 of groups g, g+1: tiles of 8 tokens, the remainder as 4, 2, 1. */
static inline __attribute__((always_inline)) void gemm_pair_fmt(const Q8MatmulArgs *a, const Q8Act *x, int64_t g,
                                                                int64_t t0, int64_t t1, int bits, int dshift,
                                                                int has_off, int half, int corr) {
    int64_t t = t0;
    for (; t + GEMM_T <= t1; t += GEMM_T) gemm_tile(a, x, g, t, GEMM_T, bits, dshift, has_off, half, corr);
    if (t + 4 <= t1) { gemm_tile(a, x, g, t, 4, bits, dshift, has_off, half, corr); t += 4; }
    if (t + 2 <= t1) { gemm_tile(a, x, g, t, 2, bits, dshift, has_off, half, corr); t += 2; }
    if (t < t1) gemm_tile(a, x, g, t, 1, bits, dshift, has_off, half, corr);
}

/* Groups g, g+1 of an item against its tokens t0 .. t1-1 through FN(a, x, g, t0, t1, bits, dshift,
 * has_off, half, corr), dispatched on the weight format so that each combination of the GGUF
 * types (as in q8x8_group) gets its own constants, the rest the general form. `corr`: what this
 * file's unsigned bytes add per unit of sum(x) (128 for 8-bit codes, else the nibble bias). Used
 * by gemm_pair here and amx_pair in q8_amx.c. */
#define GEMM_PAIR_FORMATS(FN, a, x, g, t0, t1) do { \
        const int dshift_ = (a)->kind == Q8_K ? 3 : 0, has_off_ = (a)->offset != NULL; \
        const int half_ = (int)(a)->half_scales, bias_ = (int)(a)->bias; \
        if ((a)->bits == 8) { \
            if (half_ && !has_off_ && !dshift_) FN(a, x, g, t0, t1, 8, 0, 0, 1, 128);                /* Q8_0 */ \
            else FN(a, x, g, t0, t1, 8, dshift_, has_off_, half_, 128); \
        } else if (half_ && !dshift_) { \
            if (has_off_) FN(a, x, g, t0, t1, 4, 0, 1, 1, 0);                                        /* Q4_1 */ \
            else FN(a, x, g, t0, t1, 4, 0, 0, 1, bias_);                                             /* Q4_0 */ \
        } else if (dshift_ && has_off_ && !half_ && !bias_) { \
            FN(a, x, g, t0, t1, 4, 3, 1, 0, 0);                                                      /* Q4_K */ \
        } else { \
            FN(a, x, g, t0, t1, 4, dshift_, has_off_, half_, bias_); \
        } \
    } while (0)

static void gemm_pair(const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int64_t t1) {
    GEMM_PAIR_FORMATS(gemm_pair_fmt, a, x, g, t0, t1);
}
#else
#define Q8_GEMM512 0
#endif

#if !Q8_GEMM512 && Q8_SIMD && !defined(DPBUSD) && defined(__AVX2__) && defined(__FMA__)
/* ---- the same product for 256-bit registers without a byte dot product (AVX2)
 * Why: repack.c's tile broadcasts each token's activation word for one group of 8 rows and, on
 * AVX2, its accumulators did not fit the 16 registers. This tile serves two groups (16 rows) and
 * 4 tokens, words outermost: a word of both groups is unpacked once, then each token's matching
 * codes are broadcast once and meet both groups. Its integer core is assembly (gemm256_block4_*):
 * written with intrinsics, GCC kept 5 of the 8 accumulators in memory, a store and a load on
 * every multiply-add; there the 8 accumulators, the unpacked words, a broadcast and two products
 * fill the 16 registers exactly. Measured on the default model's layer weights (Q4_1, 2 threads,
 * Zen 5 machine, METATP_KERNEL_ISA=avx2, one process): 16 tokens 16.2 ms with the intrinsics and
 * the old 8-block prefetch, 14.4 with a 48-block one, 12.8 with the assembly; 64 tokens 51.6 ->
 * 49.7 -> 43.0.
 * Nibble codes add up in 16 bits over a block (8 products of <= 15 * 127 a lane, no saturation)
 * and widen once; 8-bit codes take the sign trick (|w| times x with w's sign, pairs of at most
 * 2 * 128 * 127) and widen after each word.
 * Exactness: the integer sums are exact in any order, and each (row, token) result takes
 * repack.c's float operations in block order (acc = fma(float(isum), scale * d, acc), the offset
 * term summed apart and added last), so it is bit-identical to that tile, which takes the
 * remainders of fewer than 4 tokens. */
#define Q8_GEMM256 1
enum { GEMM256_T = 4 };

/* Blocks ahead that the first tile of a token block prefetches its rows' codes, scales and
 * offsets (the hardware prefetcher left the tiles waiting; 8 blocks ahead before: see above;
 * 24 and 96 did no better than 48). */
#ifndef GEMM256_PF
#define GEMM256_PF 48
#endif

/* The two assembly cores' shared operands: the 8 accumulators a0..a3 (group A, tokens 0..3) and
 * b0..b3 (group B), read and written; loaded from pa / pb before and stored back after. */
#define GEMM256_ACCUMULATORS [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), \
    [b0] "+x"(b0), [b1] "+x"(b1), [b2] "+x"(b2), [b3] "+x"(b3)
#define GEMM256_LOAD_ACCUMULATORS \
    __m256i a0 = pa[0], a1 = pa[1], a2 = pa[2], a3 = pa[3], b0 = pb[0], b1 = pb[1], b2 = pb[2], b3 = pb[3]
#define GEMM256_STORE_ACCUMULATORS do { \
        pa[0] = a0; pa[1] = a1; pa[2] = a2; pa[3] = a3; \
        pb[0] = b0; pb[1] = b1; pb[2] = b2; pb[3] = b3; \
    } while (0)

/* Token t's codes at XLO (partners of the low nibbles) and XHI (of the high ones) into the 16-bit
 * sums ACCA, ACCB of groups A and B. */
#define GEMM256_NIBBLE_TOKEN(XLO, XHI, ACCA, ACCB) \
    "vpbroadcastd " XLO ", %[xv]\n\t" \
    "vpmaddubsw %[xv], %[lo_a], %[p]\n\t" \
    "vpmaddubsw %[xv], %[lo_b], %[q]\n\t" \
    "vpaddw %[p], " ACCA ", " ACCA "\n\t" \
    "vpaddw %[q], " ACCB ", " ACCB "\n\t" \
    "vpbroadcastd " XHI ", %[xv]\n\t" \
    "vpmaddubsw %[xv], %[hi_a], %[p]\n\t" \
    "vpmaddubsw %[xv], %[hi_b], %[q]\n\t" \
    "vpaddw %[p], " ACCA ", " ACCA "\n\t" \
    "vpaddw %[q], " ACCB ", " ACCB "\n\t"
/* Nibble word at byte W of both groups unpacked, then the 4 tokens' codes XLO (4j) and XHI (16 + 4j);
 * tokens 0..3 at x, x + k, x2 = x + 2k, x2 + k. */
#define GEMM256_NIBBLE_WORD(W, XLO, XHI) \
    "vmovdqu " W "(%[ga]), %[lo_a]\n\t" \
    "vpsrlw $4, %[lo_a], %[hi_a]\n\t" \
    "vpand %[m], %[lo_a], %[lo_a]\n\t" \
    "vpand %[m], %[hi_a], %[hi_a]\n\t" \
    "vmovdqu " W "(%[gb]), %[lo_b]\n\t" \
    "vpsrlw $4, %[lo_b], %[hi_b]\n\t" \
    "vpand %[m], %[lo_b], %[lo_b]\n\t" \
    "vpand %[m], %[hi_b], %[hi_b]\n\t" \
    GEMM256_NIBBLE_TOKEN(XLO "(%[x])", XHI "(%[x])", "%[a0]", "%[b0]") \
    GEMM256_NIBBLE_TOKEN(XLO "(%[x],%[k])", XHI "(%[x],%[k])", "%[a1]", "%[b1]") \
    GEMM256_NIBBLE_TOKEN(XLO "(%[x2])", XHI "(%[x2])", "%[a2]", "%[b2]") \
    GEMM256_NIBBLE_TOKEN(XLO "(%[x2],%[k])", XHI "(%[x2],%[k])", "%[a3]", "%[b3]")

/* One nibble block of groups A and B (words at ga, gb) against 4 tokens (codes at x + t * k):
 * pa[t], pb[t] += the byte products of word j's low nibbles with codes 4j..4j+3 and of its high
 * nibbles with 16+4j..16+4j+3, j = 0..3, as 16-bit sums. */
static inline __attribute__((always_inline)) void gemm256_block4_nibbles(const uint8_t *ga, const uint8_t *gb,
                                                                         const int8_t *x, int64_t k, __m256i pa[4],
                                                                         __m256i pb[4]) {
    GEMM256_LOAD_ACCUMULATORS;
    __m256i lo_a, hi_a, lo_b, hi_b, xv, p, q;
    const __m256i m = _mm256_set1_epi8(0x0F);
    const int8_t *x2 = x + 2 * k;
    __asm__(GEMM256_NIBBLE_WORD("0", "0", "16") GEMM256_NIBBLE_WORD("32", "4", "20")
            GEMM256_NIBBLE_WORD("64", "8", "24") GEMM256_NIBBLE_WORD("96", "12", "28")
            : GEMM256_ACCUMULATORS,
              [lo_a] "=&x"(lo_a), [hi_a] "=&x"(hi_a), [lo_b] "=&x"(lo_b), [hi_b] "=&x"(hi_b), [xv] "=&x"(xv),
              [p] "=&x"(p), [q] "=&x"(q)
            : [ga] "r"(ga), [gb] "r"(gb), [x] "r"(x), [x2] "r"(x2), [k] "r"(k), [m] "x"(m)
            : "memory");
    GEMM256_STORE_ACCUMULATORS;
}

/* Token t's 4 codes at X against word w (|w| in u) of groups A and B, widened into the 32-bit
 * sums ACCA, ACCB. */
#define GEMM256_BYTE_TOKEN(X, ACCA, ACCB) \
    "vpbroadcastd " X ", %[xv]\n\t" \
    "vpsignb %[w_a], %[xv], %[p]\n\t" \
    "vpmaddubsw %[p], %[u_a], %[p]\n\t" \
    "vpmaddwd %[ones], %[p], %[p]\n\t" \
    "vpaddd %[p], " ACCA ", " ACCA "\n\t" \
    "vpsignb %[w_b], %[xv], %[q]\n\t" \
    "vpmaddubsw %[q], %[u_b], %[q]\n\t" \
    "vpmaddwd %[ones], %[q], %[q]\n\t" \
    "vpaddd %[q], " ACCB ", " ACCB "\n\t"
/* 8-bit word at byte W (32j) of both groups, then the 4 tokens' codes X (4j). */
#define GEMM256_BYTE_WORD(W, X) \
    "vmovdqu " W "(%[ga]), %[w_a]\n\t" \
    "vpabsb %[w_a], %[u_a]\n\t" \
    "vmovdqu " W "(%[gb]), %[w_b]\n\t" \
    "vpabsb %[w_b], %[u_b]\n\t" \
    GEMM256_BYTE_TOKEN(X "(%[x])", "%[a0]", "%[b0]") \
    GEMM256_BYTE_TOKEN(X "(%[x],%[k])", "%[a1]", "%[b1]") \
    GEMM256_BYTE_TOKEN(X "(%[x2])", "%[a2]", "%[b2]") \
    GEMM256_BYTE_TOKEN(X "(%[x2],%[k])", "%[a3]", "%[b3]")

/* One 8-bit block of groups A and B against 4 tokens: pa[t], pb[t] += sum_j word j . codes 4j..4j+3
 * of token t, j = 0..7, as 32-bit sums (words 0..3, then 4..7: one asm statement each, as the
 * operand count allows). */
static inline __attribute__((always_inline)) void gemm256_block4_bytes(const uint8_t *ga, const uint8_t *gb,
                                                                       const int8_t *x, int64_t k, __m256i pa[4],
                                                                       __m256i pb[4]) {
    GEMM256_LOAD_ACCUMULATORS;
    __m256i w_a, u_a, w_b, u_b, xv, p, q;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ha = ga + 128 * half, *hb = gb + 128 * half;
        const int8_t *hx = x + 16 * half, *hx2 = hx + 2 * k;
        __asm__(GEMM256_BYTE_WORD("0", "0") GEMM256_BYTE_WORD("32", "4") GEMM256_BYTE_WORD("64", "8")
                GEMM256_BYTE_WORD("96", "12")
                : GEMM256_ACCUMULATORS,
                  [w_a] "=&x"(w_a), [u_a] "=&x"(u_a), [w_b] "=&x"(w_b), [u_b] "=&x"(u_b), [xv] "=&x"(xv),
                  [p] "=&x"(p), [q] "=&x"(q)
                : [ga] "r"(ha), [gb] "r"(hb), [x] "r"(hx), [x2] "r"(hx2), [k] "r"(k), [ones] "x"(ones)
                : "memory");
    }
    GEMM256_STORE_ACCUMULATORS;
}
#undef GEMM256_ACCUMULATORS
#undef GEMM256_LOAD_ACCUMULATORS
#undef GEMM256_STORE_ACCUMULATORS
#undef GEMM256_NIBBLE_TOKEN
#undef GEMM256_NIBBLE_WORD
#undef GEMM256_BYTE_TOKEN
#undef GEMM256_BYTE_WORD

/* Blocks whose integer sums a tile works out before it scales them (see gemm256_tile). */
enum { GEMM256_CHUNK = 16 };

/* Groups g, g+1 (rows 8g .. 8g+15) against tokens t0 .. t0+3. Nibble codes go GEMM256_CHUNK blocks
 * at a time: first their integer sums (the assembly, widened to 32 bits, 8 registers a block kept
 * in L1), then their scaling into the 8 float accumulators, which then stay in registers; and the
 * offset term takes its 8 sums side by side. Why: scaling each block's sums as they came kept the
 * accumulators in memory (the assembly takes every register), and the offset term summed one
 * (row group, token) at a time waited on each multiply-add: the Q4_1 tile took 16.1 ns a block
 * against 10.2 for its assembly alone, 13.8 now (one Zen 5 core; the layer weights at 16 and 32
 * tokens 4-7% faster). 8-bit codes, whose sums come 32-bit and whose assembly is the longer part,
 * are scaled as they come (the buffer cost that tile ~10%). The float operations and their order
 * are the same either way. */
static inline __attribute__((always_inline)) void gemm256_tile(
        const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int bits, int dshift, int has_off, int half,
        int bias) {
    enum { T = GEMM256_T };
    const int64_t k = a->k, nb = k / 32, nd = dshift ? k / QK : nb, gbytes = 32 * bits, sb = half ? 2 : 4;
    const uint8_t *qa = (const uint8_t *)a->q + g * nb * gbytes, *qb = qa + nb * gbytes;
    const uint8_t *sa = (const uint8_t *)a->scale + g * nb * 8 * sb, *sbb = sa + nb * 8 * sb;
    const uint8_t *ma = has_off ? (const uint8_t *)a->offset + g * nb * 8 * sb : NULL;
    const int8_t *xq = x->q + t0 * k;
    const float *xd = x->d + t0 * nd;
    const int32_t *xi = x->isum + t0 * (k / 16);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const int64_t chunk = bits == 8 ? 1 : GEMM256_CHUNK;
    for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
        const int64_t c1 = c0 + chunk < nb ? c0 + chunk : nb;
        __m256i isum[GEMM256_CHUNK][T][2];
        for (int64_t b = c0; b < c1; b++) {
            const uint8_t *ga = qa + b * gbytes, *gb = qb + b * gbytes;
            if (t0 % GEMM_TOKEN_BLOCK == 0) {      /* the first tile of a token block meets the rows first */
                for (int64_t line = 0; line < gbytes; line += 64) {
                    __builtin_prefetch(ga + GEMM256_PF * gbytes + line);
                    __builtin_prefetch(gb + GEMM256_PF * gbytes + line);
                }
                if ((b & (sb == 2 ? 3 : 1)) == 0) {     /* 8 scales of 2 or 4 bytes a block: a line per 4 (or 2) */
                    const int64_t at = (b + GEMM256_PF) * 8 * sb;
                    __builtin_prefetch(sa + at);
                    __builtin_prefetch(sbb + at);
                    if (has_off) {
                        __builtin_prefetch(ma + at);
                        __builtin_prefetch(ma + nb * 8 * sb + at);
                    }
                }
            }
            __m256i pa[T], pb[T];
            for (int t = 0; t < T; t++) pa[t] = pb[t] = _mm256_setzero_si256();
            if (bits == 8) {        /* 32-bit sums already: scaled as they come (a buffer cost this tile ~10%) */
                gemm256_block4_bytes(ga, gb, xq + b * 32, k, pa, pb);
                const __m256 sva = q8x8_scales(sa + b * 8 * sb, half), svb = q8x8_scales(sbb + b * 8 * sb, half);
                for (int t = 0; t < T; t++) {
                    const __m256 d = _mm256_set1_ps(xd[t * nd + (b >> dshift)]);
                    acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pa[t]), _mm256_mul_ps(sva, d), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb[t]), _mm256_mul_ps(svb, d), acc[t][1]);
                }
                continue;
            }
            gemm256_block4_nibbles(ga, gb, xq + b * 32, k, pa, pb);
            for (int t = 0; t < T; t++) {
                __m256i ia = _mm256_madd_epi16(pa[t], ones), ib = _mm256_madd_epi16(pb[t], ones);
                if (bias) {
                    const int32_t *is = xi + t * (k / 16) + 2 * b;
                    const __m256i c = _mm256_set1_epi32(bias * (is[0] + is[1]));
                    ia = _mm256_sub_epi32(ia, c);
                    ib = _mm256_sub_epi32(ib, c);
                }
                isum[b - c0][t][0] = ia;
                isum[b - c0][t][1] = ib;
            }
        }
        for (int64_t b = c0; b < c1 && bits == 4; b++) {
            const __m256 sva = q8x8_scales(sa + b * 8 * sb, half), svb = q8x8_scales(sbb + b * 8 * sb, half);
            for (int t = 0; t < T; t++) {
                const __m256 d = _mm256_set1_ps(xd[t * nd + (b >> dshift)]);
                acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[b - c0][t][0]), _mm256_mul_ps(sva, d), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[b - c0][t][1]), _mm256_mul_ps(svb, d), acc[t][1]);
            }
        }
    }
    if (has_off) {     /* the offset term, in block order, its 8 sums side by side (one alone waited on each) */
        __m256 o[T][2];
        for (int t = 0; t < T; t++) o[t][0] = o[t][1] = _mm256_setzero_ps();
        const float *xs = x->xs + t0 * nb;
        for (int64_t b = 0; b < nb; b++) {
            const __m256 moa = q8x8_scales(ma + b * 8 * sb, half), mob = q8x8_scales(ma + (nb + b) * 8 * sb, half);
            for (int t = 0; t < T; t++) {
                const __m256 s = _mm256_set1_ps(xs[t * nb + b]);
                o[t][0] = _mm256_fmadd_ps(moa, s, o[t][0]);
                o[t][1] = _mm256_fmadd_ps(mob, s, o[t][1]);
            }
        }
        for (int t = 0; t < T; t++) {
            acc[t][0] = _mm256_add_ps(acc[t][0], o[t][0]);
            acc[t][1] = _mm256_add_ps(acc[t][1], o[t][1]);
        }
    }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(a->y + (t0 + t) * a->ldy + (g + h) * 8, acc[t][h]);
}

/* Tokens t0 .. t1-1 of groups g, g+1: tiles of 4 tokens; the remainder through repack.c's tile, a
 * group at a time (the same bits, see the top). */
static inline __attribute__((always_inline)) void gemm256_pair_fmt(const Q8MatmulArgs *a, const Q8Act *x, int64_t g,
                                                                   int64_t t0, int64_t t1, int bits, int dshift,
                                                                   int has_off, int half, int bias) {
    int64_t t = t0;
    for (; t + GEMM256_T <= t1; t += GEMM256_T) gemm256_tile(a, x, g, t, bits, dshift, has_off, half, bias);
    if (t < t1) {
        q8x8_group_range(a, x, g, t, t1);
        q8x8_group_range(a, x, g + 1, t, t1);
    }
}

/* Groups g, g+1 of an item, dispatched on the weight format (the GGUF types' combinations as in
 * q8x8_group_range, the rest through the general form). */
static void gemm256_pair(const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int64_t t1) {
    const int dshift = a->kind == Q8_K ? 3 : 0, has_off = a->offset != NULL, half = (int)a->half_scales;
    const int bias = (int)a->bias;
    if (a->bits == 8) {
        if (half && !has_off && !dshift) gemm256_pair_fmt(a, x, g, t0, t1, 8, 0, 0, 1, 0);                /* Q8_0 */
        else gemm256_pair_fmt(a, x, g, t0, t1, 8, dshift, has_off, half, 0);
    } else if (half && !dshift && has_off && !bias) {
        gemm256_pair_fmt(a, x, g, t0, t1, 4, 0, 1, 1, 0);                                                 /* Q4_1 */
    } else if (half && !dshift && !has_off) {
        gemm256_pair_fmt(a, x, g, t0, t1, 4, 0, 0, 1, bias);                                              /* Q4_0 */
    } else if (dshift && has_off && !half && !bias) {
        gemm256_pair_fmt(a, x, g, t0, t1, 4, 3, 1, 0, 0);                                                 /* Q4_K */
    } else {
        gemm256_pair_fmt(a, x, g, t0, t1, 4, dshift, has_off, half, bias);
    }
}
#else
#define Q8_GEMM256 0
#endif
