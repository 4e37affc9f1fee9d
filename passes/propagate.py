"""Split-state propagation: a state for every leaf (split table; inputs MIRRORED) and node (rules).

Two views per tensor, as llama.cpp keeps them:
- `state` (assume_sync=False): PARTIAL where the value is an un-reduced partial sum;
- `sync_state` (assume_sync=True): what consumers see, i.e. MIRRORED for a node whose PARTIAL
  result is reduced before anyone reads it. Leaves keep one state in both views (a PARTIAL
  leaf is never reduced: its consumers must be linear in it).

Requires: a graph whose leaves all have a split-table row (or an override; inputs are MIRRORED)
and whose ops all have a row in `passes.rules.OP_RULES`.
Ensures: both views for every leaf and node; leaf states cover their tensor exactly
(`check_leaf_state`); every node state satisfied its rule and the take-over ratio
(`rules.check_ratio`). Raises SplitError naming the op, node and input states otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.rules import apply_rule
from metatp.passes.split_table import SplitTable
from metatp.passes.state import SplitState

__all__ = ["States", "propagate", "check_leaf_state"]


@dataclass
class States:
    state: dict[Tensor, SplitState]
    sync: dict[Tensor, SplitState]


def check_leaf_state(t: Tensor, st: SplitState, n_devices: int) -> None:
    """Validate a leaf state (table row or override): sizes add up and every device is listed."""
    if not st.is_split:
        return
    if any(len(seg) != n_devices for seg in st.ne):
        raise SplitError(f"leaf {t.name!r}: state {st} is not for {n_devices} devices")
    if st.total() != t.ne[st.axis]:
        raise SplitError(f"leaf {t.name!r}: state {st} covers {st.total()} of {t.ne[st.axis]} elements "
                         f"along axis {st.axis}")
    if any(x < 0 for seg in st.ne for x in seg):
        raise SplitError(f"leaf {t.name!r}: negative extent in {st}")


def leaf_state(t: Tensor, table: SplitTable, overrides: Mapping[Tensor, SplitState]) -> SplitState:
    if t in overrides:
        return overrides[t]
    if t.flags & Flag.INPUT:
        return SplitState.mirrored()
    return table.state(t)


def propagate(graph: Graph, table: SplitTable, overrides: Mapping[Tensor, SplitState] | None = None) -> States:
    """States of every tensor of `graph`, leaves first, then nodes in order."""
    overrides = overrides or {}
    n = table.n
    state: dict[Tensor, SplitState] = {}
    sync: dict[Tensor, SplitState] = {}
    for t in graph.leaves:
        st = leaf_state(t, table, overrides)
        check_leaf_state(t, st, n)
        state[t] = sync[t] = st
    mirrored = SplitState.mirrored()
    for node in graph.nodes:
        srcs = [sync.get(s) if s is not None else None for s in node.src]
        st = apply_rule(node, srcs)
        state[node] = st
        sync[node] = mirrored if st.is_partial else st
    return States(state, sync)
