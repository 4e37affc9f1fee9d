"""The numpy backend's compiled kernels (`backends/csrc/`, one unity build `cpu_kernels.c`) for
few-token steps (decode), through ctypes, one module per kernel family in step with the C files:

- `lib`: build and load the library, the argument structs, one prepared call, batches of calls,
  the kernel thread count and its governor (`available`, `kernel_info`, `default_threads`, `batch`,
  `adaptive_threads`: fewer threads while other processes hold CPUs, csrc/threads.c);
- `matmul`: products over int8-coded weights, float (qmatmul.c) and integer (q8.c, repack.c,
  q8_matmul.c), grouped products, the long-prompt dequantize-and-BLAS path (dequant.c);
- `attention`: rope (rope.c) and decode attention (attention.c);
- `kv`: the KV cache's row types and the KV write (kv.c);
- `elementwise`: gated activations, RMS norm, add (elementwise.c), the all-reduce (allreduce.c);
- `row_best`: the greedy pick of logits rows with their finiteness check (row_best.c).

Where the library cannot be built (no compiler, METATP_CPU_KERNELS=0) `available()` is False and
the backend keeps its numpy path. Callers use the names re-exported here (`native.qmatmul(...)`).
"""

from metatp.backends.numpy.native.attention import (attention_usable, group_attention, is_attention,
                                                   prepare_attention, prepare_rope, rope_usable)
from metatp.backends.numpy.native.elementwise import (GLU_ACTS, prepare_add, prepare_allreduce, prepare_glu,
                                                      prepare_rms_norm)
from metatp.backends.numpy.native.kv import KV_TYPES, kv_dequantize, kv_quantize, kv_row_bytes, prepare_set_rows
from metatp.backends.numpy.native.lib import (ATTN_CHUNK, MAX_GROUP_ITEMS, MAX_ROWS, adaptive_threads, available, batch,
                                              batchable, build_library, default_threads, isa, kernel_info, library_isa,
                                              others_load, set_adaptive_threads, team_cap)
from metatp.backends.numpy.native.matmul import (DEQUANT_CHUNK, Q8_0, Q8_1, Q8_K, dequantize, float_row_groups,
                                                 group_qmatmul, is_qmatmul, prepare_dequant_matmul, prepare_q8_matmul,
                                                 prepare_qmatmul, q8_isums, q8_kind, q8_matmul, q8_quantize, qmatmul,
                                                 round_half)
from metatp.backends.numpy.native.row_best import row_best

__all__ = ["available", "default_threads", "kernel_info", "isa", "prepare_qmatmul", "qmatmul", "prepare_rope",
           "q8_kind", "prepare_q8_matmul", "q8_matmul", "q8_quantize", "q8_isums", "Q8_0", "Q8_1", "Q8_K",
           "prepare_attention", "is_attention", "group_attention", "prepare_glu", "prepare_allreduce", "is_qmatmul",
           "group_qmatmul",
           "prepare_dequant_matmul", "prepare_set_rows", "DEQUANT_CHUNK", "batchable", "batch", "ATTN_CHUNK",
           "MAX_ROWS", "KV_TYPES", "kv_quantize", "kv_dequantize", "library_isa", "build_library", "round_half",
           "dequantize", "rope_usable", "attention_usable", "kv_row_bytes", "prepare_rms_norm", "prepare_add",
           "GLU_ACTS", "float_row_groups", "row_best", "MAX_GROUP_ITEMS", "adaptive_threads",
           "set_adaptive_threads", "team_cap", "others_load"]
