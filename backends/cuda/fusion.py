"""Which nodes of a Plan run as one CUDA launch: the families' fusion rows, in priority order.

A fusion runs several nodes as one launch at the position of one of them (`at`); the others
get no launch (`absorbed`). Two memory rules keep the arena allocator's view (computed from the
unfused graph) true: an input read later than its last unfused reader is kept alive (`keep`,
decode-sized tensors only), and an output written earlier than its own node gets memory of
its own (`detach`). Legality (same subgraph, same devices, no buffer of its own needed) is
`PlanFacts`'; what a kernel can take (weight layouts, token counts) is its family's finder
(`kernels/<family>.py`, `FUSIONS`). This module only orders them (`FusionKind`'s order): a
node joins the first fusion that claims it. Together they cut a llama decode layer to 8 launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metatp.backends.cuda.kernels.handler import FusionRow
from metatp.backends.cuda.ops import FUSION_ROWS
from metatp.backends.fusion import Fusion, FusionKind, select

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["ORDERED_ROWS", "find_fusions"]

#: The families' rows in `FusionKind`'s order: the order their finders claim nodes (an earlier
#: kind's fusion wins a node).
ORDERED_ROWS: tuple[FusionRow, ...] = tuple(FUSION_ROWS[k] for k in FusionKind if k in FUSION_ROWS)


def find_fusions(ex: CupyExecutable) -> list[Fusion]:
    """Every fusion of the plan; a node joins one fusion at most (earlier rows win)."""
    return select(ex, [row.find for row in ORDERED_ROWS])
