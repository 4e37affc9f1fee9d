"""Rotary position embedding (``cuda/rope.cu``), NORMAL and NEOX, optionally Q and K in one launch.

The family's decisions: ROPE runs `rope`; two ROPEs of a few tokens with the same positions and
parameters (Q and K of a layer) run as one launch (`FusionKind.ROPE_PAIR`). No scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metatp.backends.cuda.kernels.handler import FusionRow, array_of, no_workspace, record, unfused_in_order
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, BLOCK_1D, check_f32, check_i32, f32, grid1d, head_strides,
                                         i32, launch)
from metatp.backends.fusion import Fusion, FusionKind, later_partners
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op, RopeMode
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'rope', 'HANDLERS', 'FUSIONS', 'workspace']

ENTRY_POINTS = ["rope_norm_f32", "rope_neox_f32"]



def rope(x, y, pos, *, head_dim: int, n_head: int, n_tokens: int, n_dims: int,
         freq_base: float, freq_scale: float = 1.0, neox: bool = False, freq_factors=None,
         attn_factor: float = 1.0, x_strides=None, y_strides=None, second=None) -> None:
    """RoPE on f32 ``x`` [n_tokens, n_head, head_dim] (numpy order) into ``y`` (may be x).

    ``pos``: int32 [n_tokens] in device memory (read by the kernel: a captured graph
    replays with new positions). ``x_strides``/``y_strides``: (head stride, token stride)
    in elements; default from 3-D arrays, else contiguous. ``neox``: rotate halves.
    ``second``: optional (x2, y2, n_head2, x2_strides, y2_strides), rotated in the same
    launch with the same positions (Q and K of a layer).
    """
    check_f32(x, y, freq_factors)
    check_i32(pos)
    if head_dim % 2 or n_dims % 2 or n_dims > head_dim:
        raise ValueError("head_dim and n_dims must be even and n_dims <= head_dim")
    xs1, xs2 = head_strides(x, head_dim, n_head, x_strides)
    ys1, ys2 = head_strides(y, head_dim, n_head, y_strides)
    x2 = y2 = None
    n_head2, x2s, y2s = 0, (0, 0), (0, 0)
    if second is not None:
        x2, y2, n_head2, x2_strides, y2_strides = second
        check_f32(x2, y2)
        x2s = head_strides(x2, head_dim, n_head2, x2_strides)
        y2s = head_strides(y2, head_dim, n_head2, y2_strides)
    total = head_dim // 2 * (n_head + n_head2) * n_tokens
    if total == 0:
        return
    launch("rope", "rope_neox_f32" if neox else "rope_norm_f32", grid1d(total), (BLOCK_1D,),
           (x, y, x2, y2, pos, freq_factors, i32(head_dim), i32(n_head), i32(n_head2),
            i32(n_tokens), i32(n_dims), i32(xs1), i32(xs2), i32(ys1), i32(ys2),
            i32(x2s[0]), i32(x2s[1]), i32(y2s[0]), i32(y2s[1]), f32(freq_base),
            f32(freq_scale), f32(attn_factor)))


# ---------------------------------------------------------------- handlers
def _run_rope(ex: CupyExecutable, d: int, node: Tensor, second=None) -> list:
    x, pos = node.src[0], node.src[1]
    ff = node.src[2] if len(node.src) > 2 else None
    if x.ne[3] != 1:
        raise UnsupportedOpError(f"cupy backend: ROPE {node.name!r} with ne3 > 1")
    p = node.params
    xa, out = array_of(ex, d, x)[0], array_of(ex, d, node)[0]
    ffa = array_of(ex, d, ff).reshape(-1) if ff is not None else None
    head_dim, n_head, n_tok = xa.shape[2], xa.shape[1], xa.shape[0]
    return record(rope, xa, out, array_of(ex, d, pos).reshape(-1), head_dim=head_dim, n_head=n_head,
                  n_tokens=n_tok, n_dims=p["n_dims"], freq_base=p["freq_base"],
                  freq_scale=p["freq_scale"], neox=p["mode"] == RopeMode.NEOX, freq_factors=ffa,
                  second=second)


def _fused_rope_pair(ex: CupyExecutable, d: int, f: Fusion) -> list:
    first, second = f.parts["first"], f.at
    x2 = array_of(ex, d, second.src[0])[0]
    return _run_rope(ex, d, first, second=(x2, array_of(ex, d, second)[0], x2.shape[1], None, None))


# ---------------------------------------------------------------- fusion
def _find_rope_pair(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """Two ROPEs with the same positions and parameters (Q and K of a layer) -> one launch at
    the later one."""
    if node.op is not Op.ROPE or node in taken:
        return []
    idx = ex.plan.graph.index
    for other in later_partners(ex.facts, node, taken):
        if other.params != node.params or other.src[2:] != node.src[2:] or node.ne[0] != other.ne[0]:
            continue
        if node.ne[2] != other.ne[2] or node.ne[3] != 1 or other.ne[3] != 1:
            continue
        if not ex.facts.fusable(node, other) or not ex.facts.uses_after(node, idx[other]):
            continue
        if node.ne[2] > MATVEC_MAX_TOKENS:
            continue
        return [Fusion(FusionKind.ROPE_PAIR, other, (node,), keep=(node.src[0],), parts={"first": node})]
    return []


workspace = no_workspace

HANDLERS = {Op.ROPE: _run_rope}
FUSIONS = (FusionRow(FusionKind.ROPE_PAIR, _find_rope_pair, _fused_rope_pair, unfused_in_order),)
