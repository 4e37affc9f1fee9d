"""KV-cache row stores (``cuda/kv.cu``): SET_ROWS with f32 -> f16 / bf16 / f32 conversion, or
quantization into q8_0 / q4_0 / q4_1 / q5_0 / q5_1 blocks (one warp per block, gguf.quants
rounding), K and V in one launch.

The family's decisions: SET_ROWS runs `set_rows`; two SET_ROWS of a few rows with the same row
indices into caches of one storage type (K and V of a layer) run as one launch
(`FusionKind.SET_ROWS_PAIR`). No scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metatp.backends.cuda.kernels.handler import FusionRow, array_of, no_workspace, record, unfused_in_order
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, BLOCK_1D, CACHE_TYPES, KV_QUANT_TYPES, launch, i32, grid1d,
                                         cache_type_of, rows2d, check_f32, check_i32)
from metatp.backends.cuda.storage import quant_cache_type
from metatp.backends.fusion import Fusion, FusionKind, later_partners
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'set_rows', 'HANDLERS', 'FUSIONS', 'workspace']

ENTRY_POINTS = [f"set_rows_f32_{t}" for t in CACHE_TYPES]


def _dst_row_stride(dst, ne0: int) -> int:
    """Row stride of a cache array in its elements (bytes for a uint8 quantized cache)."""
    return rows2d(dst)[2] if dst.ndim > 1 else ne0


def set_rows(src, dst, idx, *, ne0: int | None = None, n_rows: int | None = None,
             src_row_stride: int | None = None, dst_row_stride: int | None = None,
             second=None, cache_type: str | None = None) -> None:
    """``dst[idx[r], :ne0] = src[r, :ne0]`` converting f32 to dst's type (f16/bf16/f32), or
    quantizing into dst's blocks: a quantized cache is uint8 rows of blocks and `cache_type`
    names its type (ne0 then a multiple of 32; dst_row_stride in bytes).
    ``idx`` is read from device memory (a captured graph writes new rows each replay).
    ``second``: optional (src2, dst2) stored with the same indices in the same launch
    (the K and V rows of a layer; dst2 of dst's type)."""
    check_f32(src)
    check_i32(idx)
    ne0, n_src_rows, src_row_stride = rows2d(src, ne0, None, src_row_stride)
    if n_rows is None:
        n_rows = int(idx.size)
    if n_rows > idx.size or (src.ndim > 1 and n_rows > n_src_rows):
        raise ValueError(f"n_rows={n_rows} exceeds idx ({idx.size}) or src rows ({n_src_rows})")
    out = cache_type_of(dst, cache_type)
    quant = out in KV_QUANT_TYPES
    if dst_row_stride is None:
        dst_row_stride = _dst_row_stride(dst, ne0)
    src2 = dst2 = None
    ne0_2, s2, d2 = 0, 0, 0
    if second is not None:
        src2, dst2 = second
        check_f32(src2)
        if cache_type_of(dst2, cache_type) != out:
            raise TypeError("both destinations must have the same type")
        ne0_2, rows2, s2 = rows2d(src2)
        d2 = _dst_row_stride(dst2, ne0_2)
        if src2.ndim > 1 and rows2 < n_rows:
            raise ValueError(f"second source has {rows2} rows, need {n_rows}")
    if quant:
        qk, nbytes = KV_QUANT_TYPES[out]
        dests = [(ne0, dst_row_stride, dst.shape[-1])]
        if dst2 is not None:
            dests.append((ne0_2, d2, dst2.shape[-1]))
        for n, stride, width in dests:
            if n % qk:
                raise ValueError(f"a {out} cache row takes whole blocks of {qk}, got {n} elements")
            if n and (stride % 2 or n // qk * nbytes > width):
                raise ValueError(f"{out} destination rows of {width} bytes (stride {stride}) cannot hold {n} elements")
    if n_rows == 0 or ne0 + ne0_2 == 0:
        return
    if quant:
        warps = (ne0 + ne0_2) // KV_QUANT_TYPES[out][0] * n_rows
        grid = grid1d(warps * 32)
    else:
        grid = grid1d((ne0 + ne0_2) * n_rows)
    launch("kv", f"set_rows_f32_{out}", grid, (BLOCK_1D,),
           (src, dst, idx, i32(ne0), i32(n_rows), i32(src_row_stride),
            i32(dst_row_stride), src2, dst2, i32(ne0_2), i32(s2), i32(d2)))


# ---------------------------------------------------------------- handlers
def _run_set_rows(ex: CupyExecutable, d: int, node: Tensor, second=None) -> list:
    rows, ids, _ = node.src
    if rows.ne[2] != 1 or rows.ne[3] != 1 or ids.ne[1] != 1 or ids.ne[2] != 1:
        raise UnsupportedOpError(f"cupy backend: SET_ROWS {node.name!r} with batch dims is not supported")
    return record(set_rows, array_of(ex, d, rows)[0, 0], array_of(ex, d, node)[0, 0],
                  array_of(ex, d, ids)[0, 0, 0], second=second, cache_type=quant_cache_type(node.type))


def _fused_set_rows_pair(ex: CupyExecutable, d: int, f: Fusion) -> list:
    first, second = f.parts["first"], f.at
    return _run_set_rows(ex, d, first, second=(array_of(ex, d, second.src[0])[0, 0], array_of(ex, d, second)[0, 0]))


# ---------------------------------------------------------------- fusion
def _find_set_rows_pair(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """Two SET_ROWS with the same row indices into caches of one storage type (K and V of a
    layer) -> one launch at the later one."""
    if node.op is not Op.SET_ROWS or node in taken:
        return []
    facts = ex.facts
    for other in later_partners(facts, node, taken):
        if node.src[0].ne[1] > MATVEC_MAX_TOKENS or node.type != other.type:
            continue
        if list(ex.plan.of(node).compute) != list(ex.plan.of(other).compute):
            continue
        if facts.sub_of.get(node) != facts.sub_of.get(other) or not facts.uses_after(node, ex.plan.graph.index[other]):
            continue
        if any(node.view_src is r or other.view_src is r for r in (node.src[0], other.src[0])):
            continue
        return [Fusion(FusionKind.SET_ROWS_PAIR, other, (node,), keep=(node.src[0],), parts={"first": node})]
    return []


workspace = no_workspace

HANDLERS = {Op.SET_ROWS: _run_set_rows}
FUSIONS = (FusionRow(FusionKind.SET_ROWS_PAIR, _find_set_rows_pair, _fused_set_rows_pair, unfused_in_order),)
