"""The numpy backend's op builders, one module per op family (as `backends/cuda/kernels/`), and the
`KERNELS` table that maps an op to its builder.

Each entry of `KERNELS` takes (node, out, srcs, backend-side helpers) and returns a
zero-argument closure that computes `out` in place. Preparing closures once per plan keeps
per-token Python work to one call per node. Everything stays float32: scalars are
`np.float32` so numpy 2's promotion rules never turn a tensor into float64. These are an
implementation, not references: the float64 references are `metatp.testing.oracles`.

- `elementwise`: binary ops, GET_ROWS, norms, SCALE, ADD_ID, SOFT_MAX, GLU, unary, top-k, SUM_ROWS;
- `matmul`: MUL_MAT / MUL_MAT_ID and the llama.cpp activation rounding before a product;
- `attention`: ROPE and FLASH_ATTN_EXT;
- `kv`: CONT / CPY, SET_ROWS and the KV cache's row rounding;
- `common`: the closure type, `F32` and the few-token limit of the compiled kernels.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from metatp.backends.numpy.kernels.attention import _flash_attn, _rope, attention_numpy, rope_cos_sin
from metatp.backends.numpy.kernels.common import Closure
from metatp.backends.numpy.kernels.elementwise import (_add, _add_id, _binary, _get_rows, _glu, _norm, _rms_norm,
                                                       _scale, _soft_max, _sum_rows, _top_k, _unary, rms_norm_mul)
from metatp.backends.numpy.kernels.kv import _copy, _set_rows, kv_load_rows, kv_store_rows
from metatp.backends.numpy.kernels.matmul import (_mul_mat, _mul_mat_id, q8_quantize_numpy, quantize_q8_blocks,
                                                  round_f16)
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor

__all__ = ["KERNELS", "kernel_for", "Closure", "rms_norm_mul", "quantize_q8_blocks", "round_f16", "q8_quantize_numpy",
           "rope_cos_sin", "attention_numpy", "kv_store_rows", "kv_load_rows"]

KERNELS: dict[Op, Callable[..., Closure]] = {
    Op.GET_ROWS: _get_rows,
    Op.RMS_NORM: _rms_norm,
    Op.NORM: _norm,
    Op.ADD: _add,
    Op.MUL: _binary(np.multiply),
    Op.DIV: _binary(np.divide),
    Op.ADD_ID: _add_id,
    Op.SCALE: _scale,
    Op.MUL_MAT: _mul_mat,
    Op.MUL_MAT_ID: _mul_mat_id,
    Op.CONT: _copy,
    Op.CPY: _copy,
    Op.SET_ROWS: _set_rows,
    Op.ROPE: _rope,
    Op.FLASH_ATTN_EXT: _flash_attn,
    Op.SOFT_MAX: _soft_max,
    Op.GLU: _glu,
    Op.UNARY: _unary,
    Op.ARGSORT_TOP_K: _top_k,
    Op.SUM_ROWS: _sum_rows,
}


def kernel_for(node: Tensor) -> Callable[..., Closure]:
    """The builder of `node`'s op; UnsupportedOpError for an op the numpy backend has none for."""
    try:
        return KERNELS[node.op]
    except KeyError:
        raise UnsupportedOpError(f"numpy backend: no kernel for op {node.op.name} (node {node.name!r})") from None
