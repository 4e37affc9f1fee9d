"""Lowering: each device's shape, byte strides and view offset for every tensor (digest §5).

The split dim gets the device's extent. A tensor with its own memory (leaf or computed node) is
contiguous on every device. A view is placed inside its source's *local* memory exactly:
- RESHAPE: contiguous, at the source's offset;
- PERMUTE / TRANSPOSE: the source's local strides, permuted;
- VIEW: the window's inner dims are contiguous locally; dims that step whole source rows use the
  source's local row stride; the offset is the source's local offset plus the device's own
  elements before the window start, so Q/K/V views into a fused QKV output land on each
  device's local [Q_j | K_j | V_j] (llama.cpp scales offsets by ratio; this is the same number
  whenever that works, and exact for segmented layouts);
- CPY / SET_ROWS: their result aliases the destination, so they take its local layout.
"""

from __future__ import annotations

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Tensor, contiguous_nb
from metatp.passes.plan import Local
from metatp.passes.rules import _base_offs, _elements_to_bytes, analyze_view, local_start, owner_only
from metatp.passes.state import SplitState

__all__ = ["lower", "local_ne"]


def local_ne(t: Tensor, st: SplitState, j: int) -> tuple[int, int, int, int]:
    if not st.is_split:
        return t.ne
    ne = list(t.ne)
    ne[st.axis] = st.extent(j)
    return tuple(ne)


def _contiguous(t: Tensor, ne) -> tuple[int, int, int, int]:
    try:
        return contiguous_nb(t.type, ne)
    except ValueError as e:
        raise SplitError(f"tensor {t.name!r}: device slice {list(ne)} is not whole {t.type.name} blocks ({e})") from None


def _row_bytes(loc: Local, axis: int) -> int:
    return loc.nb[axis + 1] if axis < 3 else loc.nb[3] * loc.ne[3]


def _lower_view(node: Tensor, src: Tensor, src_state: SplitState, st: SplitState, src_loc: list[Local],
                n: int) -> list[Local]:
    rel = node.view_offs - _base_offs(src)
    if not src_state.is_split:
        return [Local(node.ne, node.nb, src_loc[j].offs + rel) for j in range(n)]
    owner = owner_only(src_state)
    if owner is not None and owner_only(st) == owner:
        # one device holds everything: it sees the view exactly as a single device would
        return [Local(node.ne, node.nb, src_loc[j].offs + rel) if j == owner else
                Local(local_ne(node, st, j), node.nb, src_loc[j].offs) for j in range(n)]
    va = analyze_view(node, src, src_state)
    if va.identical:
        return list(src_loc)
    out = []
    for j in range(n):
        ne = local_ne(node, st, j)
        row_j = _row_bytes(src_loc[j], va.src_axis)
        if va.mode == "window":          # inner dims contiguous, outer dims step local rows
            cnb = _contiguous(node, ne)
            nb = [cnb[i] if i <= va.inner_dims else node.nb[i] // va.row_bytes * row_j for i in range(4)]
            inside = _elements_to_bytes(src, local_start(va.row_rounds, va.start, j))
        else:                            # "direct": strides below the row are unchanged
            nb = [node.nb[i] if i <= va.dim else node.nb[i] // va.row_bytes * row_j for i in range(4)]
            inside = local_start(va.row_rounds, va.start, j) * src.nb[va.src_axis] + va.within
        out.append(Local(ne, tuple(nb), src_loc[j].offs + va.outer_rows * row_j + inside))
    return out


def _lower_permute(node: Tensor, axes, src_loc: list[Local]) -> list[Local]:
    out = []
    for loc in src_loc:
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax] = loc.ne[i]
            nb[ax] = loc.nb[i]
        out.append(Local(tuple(ne), tuple(nb), loc.offs))
    return out


def lower(graph: Graph, sync: dict[Tensor, SplitState], n: int) -> dict[Tensor, list[Local]]:
    """Per-device Local (ne, nb, offs) of every leaf and node, from consumer-view states."""
    local: dict[Tensor, list[Local]] = {}
    for t in graph.leaves:
        st = sync[t]
        local[t] = [Local(ne, _contiguous(t, ne), 0) for ne in (local_ne(t, st, j) for j in range(n))]
    for node in graph.nodes:
        st = sync[node]
        op = node.op
        if not OPS[op].is_view:
            local[node] = [Local(ne, _contiguous(node, ne), 0) for ne in (local_ne(node, st, j) for j in range(n))]
            continue
        src = node.src[0]
        if op is Op.CPY:
            local[node] = list(local[node.src[1]])
        elif op is Op.SET_ROWS:
            local[node] = list(local[node.src[2]])
        elif op is Op.RESHAPE:
            nes = [local_ne(node, st, j) for j in range(n)]
            local[node] = [Local(ne, _contiguous(node, ne), local[src][j].offs) for j, ne in enumerate(nes)]
        elif op is Op.PERMUTE:
            local[node] = _lower_permute(node, node.params["axes"], local[src])
        elif op is Op.TRANSPOSE:
            local[node] = _lower_permute(node, (1, 0, 2, 3), local[src])
        elif op is Op.VIEW:
            local[node] = _lower_view(node, src, sync[src], st, local[src], n)
        else:
            raise SplitError(f"lowering: no rule for view op {op.name} (node {node.name!r})")
        for j, loc in enumerate(local[node]):
            if loc.ne != local_ne(node, st, j):
                raise SplitError(f"internal: lowering {node.op.name} node {node.name!r} on device {j} gives "
                                 f"ne={list(loc.ne)}, its state {st} says {list(local_ne(node, st, j))}")
    return local
