"""Lowering: each device's shape, byte strides and view offset for every tensor.

Requires: consumer-view states (`States.sync`) for every leaf and node of the graph, final
(after coalescing), and a row in `passes.rules.OP_RULES` with a `lower_view` for every view op.
Ensures: one `Local` per device for every tensor; its `ne` equals the state's local shape
(checked here, an internal SplitError otherwise).

The split dim gets the device's extent. A tensor with its own memory (leaf or computed node) is
contiguous on every device. A view is placed inside its source's *local* memory exactly, by its
op's `lower_view` (passes/rules.py):
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
from metatp.ir.ops import OPS
from metatp.ir.tensor import Tensor
from metatp.passes.layout import local_contiguous_nb, local_ne
from metatp.passes.plan import Local
from metatp.passes.rules import OP_RULES
from metatp.passes.state import SplitState

__all__ = ["lower", "local_ne"]


def _own_memory(t: Tensor, st: SplitState, n: int) -> list[Local]:
    return [Local(ne, local_contiguous_nb(t, ne), 0) for ne in (local_ne(t, st, j) for j in range(n))]


def lower(graph: Graph, sync: dict[Tensor, SplitState], n: int) -> dict[Tensor, list[Local]]:
    """Per-device Local (ne, nb, offs) of every leaf and node, from consumer-view states."""
    local: dict[Tensor, list[Local]] = {}
    for t in graph.leaves:
        local[t] = _own_memory(t, sync[t], n)
    for node in graph.nodes:
        st = sync[node]
        if not OPS[node.op].is_view:
            local[node] = _own_memory(node, st, n)
            continue
        rule = OP_RULES.get(node.op)
        if rule is None or rule.lower_view is None:
            raise SplitError(f"lowering: no rule for view op {node.op.name} (node {node.name!r})")
        local[node] = rule.lower_view(node, local, sync, n)
        for j, loc in enumerate(local[node]):
            if loc.ne != local_ne(node, st, j):
                raise SplitError(f"internal: lowering {node.op.name} node {node.name!r} on device {j} gives "
                                 f"ne={list(loc.ne)}, its state {st} says {list(local_ne(node, st, j))}")
    return local
