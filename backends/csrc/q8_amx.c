/* q8_amx.c: the integer matrix product for steps of many tokens on AMX tiles (part of the unity
 * build cpu_kernels.c, after q8_gemm.c, whose layout helpers and tiles it uses; q8_matmul.c
 * dispatches to it).
 *
 * Why: on a CPU with AMX (Intel Sapphire Rapids and later) one tdpbssd multiplies a 16 x 32 tile of
 * int8 codes by a 32 x 16 one: 8192 multiply-adds, where a 512-bit vpdpbusd does 64. q8_gemm.c's
 * tile spends most of its instructions on those dot products; here they go to the tile unit and
 * the vector unit keeps only the float work that every (row, token, block) needs anyway.
 *
 * The tiles: A holds 16 tokens' activation codes of one block of 32 (16 rows x 32 bytes, loaded
 * straight from the quantized activations with a row stride of K); B holds one block of two row
 * groups (16 weight rows) in the layout the tile unit wants (8 rows of 4-code words x 16 weight
 * rows), which is word for word what gemm_unpack builds from the row-group layout: its 8 words
 * are stored and loaded as B. C = A x B is 16 tokens x 16 rows of exact int32 block sums, the same
 * integers as q8_gemm.c's (signed codes times signed codes: no +128 flip for 8-bit codes, so only
 * a nibble bias is taken off).
 *
 * Exactness: each (row, token) result is formed by the float operations of q8_gemm.c's tile in
 * the same block order (acc = fma(float(isum), scale * d, acc); offsets summed apart from zero
 * and added last), so the bits equal that tile's, repack.c's decode tile's and every remainder's:
 * a sequence's logits do not depend on how many tokens share its step. Tokens past the last
 * whole 16 take q8_gemm.c's tile.
 *
 * Where (METATP_AMX: -march=native on a CPU reporting amx_tile and amx_int8, and the named build
 * METATP_KERNEL_ISA=avx512-amx): products of 16 to AMX_MAX_TOKENS tokens (a decode step of 16-32
 * sequences, short prompts). On the 2-vCPU Intel VM it was written on (AMX granted, both threads)
 * a 16-sequence decode step took 10.0-10.1 ms against 11.0-11.3 and prompts of 16 and 32 tokens
 * ran 1.02-1.18x faster; from 64 tokens it lost (128: 0.88-0.91x, 512: 0.93-0.97x), the stored
 * sums and tile loads costing as much as the products they replace, so longer items keep
 * q8_gemm.c's tiles. See docs/performance.md.
 *
 * Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); where it
 * is refused (an older kernel, a hypervisor hiding it) the product runs q8_gemm.c's tile instead of
 * dying of SIGILL. */

#if Q8_GEMM512 && defined(METATP_AMX) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define Q8_GEMM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

enum { AMX_T = 16 };        /* tokens a tile: the rows of A and C */

/* The most tokens an item runs on AMX tiles; longer ones take q8_gemm.c's tiles. On the machine
 * it was measured on (docs/performance.md) the tiles won at 16-32 tokens a product and lost from
 * 128 (prompts of 128 tokens 0.88-0.91x, 512 0.93-0.97x), where a thread's rows and token blocks
 * keep q8_gemm.c's tiles fed from L2. */
#ifndef AMX_MAX_TOKENS
#define AMX_MAX_TOKENS 32
#endif

/* Does item `a` run on AMX tiles (row-group layout, a whole tile of tokens, not too many)? */
static int amx_takes(const Q8MatmulArgs *a) {
    return a->group == 8 && a->ntok >= AMX_T && a->ntok <= AMX_MAX_TOKENS;
}

/* ldtilecfg's 64-byte operand (palette 1) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* 1 when this process may use the tile registers (asked of the kernel once). */
static int amx_granted(void) {
    static int state;        /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* The calling thread's tile shapes: C0, C1 16 x 16 int32; A0, A1 16 x 32 bytes; B0, B1 8 x 64
 * bytes (two of each: two blocks in flight). Loaded at the start of every call on every thread
 * that runs tiles, since other code sharing the threads (OpenMP's pool) may load its own. */
static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = AMX_T;     c.colsb[i] = 64;
        c.rows[2 + i] = AMX_T; c.colsb[2 + i] = 32;
        c.rows[4 + i] = 8;     c.colsb[4 + i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Block b of groups A, B as the tile unit's B operand: gemm_unpack's 8 words, 8-bit codes back to
 * signed (its +128 undone). */
static inline __attribute__((always_inline)) void amx_weights(const uint8_t *qa, const uint8_t *qb, int64_t b,
                                                              int bits, int8_t *out) {
    const int64_t gbytes = 32 * bits;
    __m512i u[8];
    gemm_unpack(qa + b * gbytes, qb + b * gbytes, bits, u);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < 8; j++) _mm512_store_si512(out + 64 * j, bits == 8 ? _mm512_xor_si512(u[j], flip) : u[j]);
}

/* One block's 16 x 16 sums (stored by the tile unit) into the 16 tokens' accumulators. */
static inline __attribute__((always_inline)) void amx_accumulate(const Q8MatmulArgs *a, const Q8Act *x, const int32_t *c,
                                                                 int64_t t0, int64_t b, int dshift, int corr, __m512 sv,
                                                                 __m512 acc[AMX_T]) {
    const int64_t k = a->k, nd = dshift ? k / QK : k / 32;
    for (int t = 0; t < AMX_T; t++) {
        const int64_t tt = t0 + t;
        __m512i iv = _mm512_load_si512(c + 16 * t);
        if (corr) {
            const int32_t *is = x->isum + tt * (k / 16) + 2 * b;
            iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(corr * (is[0] + is[1])));
        }
        const __m512 f = _mm512_mul_ps(sv, _mm512_set1_ps(x->d[tt * nd + (b >> dshift)]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), f, acc[t]);
    }
}

/* Block `blk`'s product on tiles C, A, B (literal numbers: the intrinsics name the registers):
 * the weights from `w` (unpacked an iteration before: a tile load right after the vector stores
 * would wait for them), the sums stored to `c` (read an iteration later, for the same reason). */
#define AMX_PRODUCT(C, A, B, blk, w, c) do { \
        _tile_loadd(B, (w), 64); \
        _tile_loadd(A, xq + (blk) * 32, k); \
        _tile_zero(C); \
        _tile_dpbssd(C, A, B); \
        _tile_stored(C, (c), 64); \
    } while (0)

/* Groups g, g+1 (rows 8g .. 8g+15) against tokens t0 .. t0+15. `corr`: the nibble bias (what the
 * unsigned nibbles add per unit of sum(x)), or 0. A three-stage pipeline over the blocks: block
 * b + 2's weights are unpacked and block b + 1's product is started while block b's sums are
 * taken into the accumulators, so neither the tile unit nor the vector unit waits on the other's
 * stores. */
static inline __attribute__((always_inline)) void amx_tile(const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0,
                                                           int bits, int dshift, int has_off, int half, int corr) {
    const int64_t k = a->k, nb = k / 32, gbytes = 32 * bits, sb = half ? 2 : 4;
    const uint8_t *qa = (const uint8_t *)a->q + g * nb * gbytes, *qb = qa + nb * gbytes;
    const uint8_t *sa = (const uint8_t *)a->scale + g * nb * 8 * sb, *sbb = sa + nb * 8 * sb;
    const uint8_t *ma = has_off ? (const uint8_t *)a->offset + g * nb * 8 * sb : NULL;
    const uint8_t *mb = has_off ? ma + nb * 8 * sb : NULL;
    const int8_t *xq = x->q + t0 * k;
    int8_t wt[3][512] __attribute__((aligned(64)));
    int32_t ct[2][AMX_T * 16] __attribute__((aligned(64)));
    __m512 acc[AMX_T];
    for (int t = 0; t < AMX_T; t++) acc[t] = _mm512_setzero_ps();
    const int prefetch = t0 % GEMM_TOKEN_BLOCK == 0;    /* the first tile of a token block meets the rows first */
    amx_weights(qa, qb, 0, bits, wt[0]);
    if (nb > 1) amx_weights(qa, qb, 1, bits, wt[1]);
    AMX_PRODUCT(0, 2, 4, 0, wt[0], ct[0]);
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) {     /* a block's codes, and its scales' line (4 or 2 blocks a line) */
            const int64_t bp = b + GEMM_PREFETCH_BLOCKS;
            for (int64_t o = 0; o < gbytes; o += 64) {
                __builtin_prefetch(qa + bp * gbytes + o);
                __builtin_prefetch(qb + bp * gbytes + o);
            }
            if ((b & (sb == 2 ? 3 : 1)) == 0) {
                __builtin_prefetch(sa + bp * 8 * sb);
                __builtin_prefetch(sbb + bp * 8 * sb);
                if (has_off) {
                    __builtin_prefetch(ma + bp * 8 * sb);
                    __builtin_prefetch(mb + bp * 8 * sb);
                }
            }
        }
        if (b + 2 < nb) amx_weights(qa, qb, b + 2, bits, wt[(b + 2) % 3]);
        if (b + 1 < nb) {
            if (b & 1) AMX_PRODUCT(0, 2, 4, b + 1, wt[(b + 1) % 3], ct[0]);
            else AMX_PRODUCT(1, 3, 5, b + 1, wt[(b + 1) % 3], ct[1]);
        }
        amx_accumulate(a, x, ct[b & 1], t0, b, dshift, corr, gemm_scales(sa + b * 8 * sb, sbb + b * 8 * sb, half), acc);
    }
    if (has_off) {      /* the offset term from zero in block order, added last (as q8_gemm.c's tile) */
        __m512 off[AMX_T];
        for (int t = 0; t < AMX_T; t++) off[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m512 mv = gemm_scales(ma + b * 8 * sb, mb + b * 8 * sb, half);
            for (int t = 0; t < AMX_T; t++)
                off[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->xs[(t0 + t) * nb + b]), off[t]);
        }
        for (int t = 0; t < AMX_T; t++) acc[t] = _mm512_add_ps(acc[t], off[t]);
    }
    for (int t = 0; t < AMX_T; t++) _mm512_storeu_ps(a->y + (t0 + t) * a->ldy + g * 8, acc[t]);
}

/* Tokens t0 .. t1-1 of groups g, g+1: tiles of 16 tokens, the rest through q8_gemm.c's tile.
 * `corr` is that tile's (GEMM_PAIR_FORMATS); signed 8-bit codes need none here, a nibble bias the
 * same. */
static inline __attribute__((always_inline)) void amx_pair_fmt(const Q8MatmulArgs *a, const Q8Act *x, int64_t g,
                                                               int64_t t0, int64_t t1, int bits, int dshift,
                                                               int has_off, int half, int corr) {
    int64_t t = t0;
    for (; t + AMX_T <= t1; t += AMX_T) amx_tile(a, x, g, t, bits, dshift, has_off, half, bits == 8 ? 0 : corr);
    if (t < t1) gemm_pair_fmt(a, x, g, t, t1, bits, dshift, has_off, half, corr);
}

/* Groups g, g+1 of an item against its tokens t0 .. t1-1, dispatched on the weight format. */
static void amx_pair(const Q8MatmulArgs *a, const Q8Act *x, int64_t g, int64_t t0, int64_t t1) {
    GEMM_PAIR_FORMATS(amx_pair_fmt, a, x, g, t0, t1);
}
#else
#define Q8_GEMM_AMX 0
#endif

/* Does this call run tiles on AMX? (the build has them, the kernel grants them, and an item has a
 * whole tile of tokens) Then each thread loads the tile shapes first (amx_begin) and releases the
 * tile state after (amx_end). */
static int amx_wanted(const Q8MatmulGroup *g) {
#if Q8_GEMM_AMX
    for (int64_t i = 0; i < g->n; i++)
        if (amx_takes(g->items[i])) return amx_granted();
#else
    (void)g;
#endif
    return 0;
}

static void amx_begin(int on) {
#if Q8_GEMM_AMX
    if (on) amx_configure();
#else
    (void)on;
#endif
}

static void amx_end(int on) {
#if Q8_GEMM_AMX
    if (on) _tile_release();
#else
    (void)on;
#endif
}

/* For kernel_info: 1 when a product of many tokens runs on AMX tiles here, 0 when the build has
 * none, -1 when it has them but the kernel refused the tile state. */
int metatp_amx(void) {
#if Q8_GEMM_AMX
    return amx_granted() ? 1 : -1;
#else
    return 0;
#endif
}
