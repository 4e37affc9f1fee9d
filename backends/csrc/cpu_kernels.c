/* Compiled kernels for the numpy backend's few-token steps (decode): matrix products over
 * int8-coded weights (float or Q8 activations; the Q8 ones at any token count), rope, KV writes,
 * attention, gated activations, norms and the simulated all-reduce.
 *
 * Every entry point takes one pointer to an argument struct (mirrored by ctypes.Structure in
 * backends/numpy/native/lib.py): Python builds it once per plan, so a call costs ~0.2 us instead
 * of the ~3 us ctypes spends converting a dozen scalar arguments.
 *
 * This file is the one translation unit (a unity build, as ggml-cpu's ggml-cpu.c gathers its
 * parts): the kernels live one job a file beside it and are included here in an order where each
 * sees what it uses, so the compiler still inlines across them and builds one shared object.
 * backends/host_build.py compiles it with -I on this folder and hashes every file in it.
 */
#include "threads.c"       /* team_size: fewer threads while other processes hold CPUs */
#include "simd.h"          /* vector types, ISA loaders, exact conversions, fixed-order sums, tiling */

#include "qmatmul.c"       /* metatp_qmatmul: float activations x int8/nibble/half codes */
#include "qmatmul_groups.c" /* its 512-bit GEMM on the row-group layout (exact numerics) */
#include "q8.c"            /* metatp_q8_quantize, metatp_round_half, metatp_isa: Q8 rounding, block dot */
#include "repack.c"        /* the row-group layout (8 rows a 32-bit lane) of the integer product */
#include "q8_gemm.c"       /* the integer product for many tokens: 16 rows x 8 tokens a 512-bit tile */
#include "q8_amx.c"        /* the same on AMX tiles: 16 rows x 16 tokens a tile product, metatp_amx */
#include "q8_matmul.c"     /* metatp_q8_matmul, metatp_q8_isums: the integer matrix product */
#include "rope.c"          /* metatp_rope */
#include "kv.c"            /* metatp_kv_convert, metatp_set_rows: KV cache row types */
#include "attn_rows.c"     /* the attention's row pieces: K dot products, softmax weights, V passes */
#include "attention.c"     /* metatp_attention, metatp_attn_chunk */
#include "elementwise.c"   /* metatp_glu, metatp_rms_norm, metatp_add */
#include "allreduce.c"     /* metatp_allreduce */
#include "dequant.c"       /* metatp_dequant */
#include "row_best.c"      /* metatp_row_best: a row's largest value, its first index, all finite */
#include "batch.c"         /* metatp_batch */
