"""What every op family of the numpy backend shares: the closure type, the float32 scalar type and
the few-token limit below which the compiled kernels are used."""

from __future__ import annotations

from typing import Callable

import numpy as np

from metatp.backends.numpy.native import MAX_ROWS

__all__ = ["Closure", "F32", "PACKED_MAX_TOKENS"]

Closure = Callable[[], None]
F32 = np.float32

# Up to this many tokens (a step of up to 64 sequences' decode tokens) the compiled kernels run:
# their per-row results do not depend on the other rows (batch invariance). Above it the float32
# BLAS product runs (prompt chunks): compute-bound there, BLAS blocks for the cache better than
# the kernel (measured crossover ~20 tokens on a 2-core AVX-512 VM), but its sums are not
# batch-invariant. The integer (Q8) products of numerics="q8" are not bound by it: they run
# compiled at any token count (kernels/matmul.py `_q8_mul_mat`, csrc/q8_gemm.c).
PACKED_MAX_TOKENS = MAX_ROWS
