"""What each node runs on a CUDA device, assembled from the kernel families' own tables.

Every family module (`kernels/<family>.py`) owns its decisions: `HANDLERS` (which kernel an op
runs), `FUSIONS` (the fusions its kernels implement, `FusionRow`s) and `workspace` (the scratch
its handlers will ask for, decided by the same functions). This module only joins them: an op
or a fusion kind claimed by two families is an error at import, not a silent override.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from metatp.backends.cuda.kernels import FAMILY_MODULES
from metatp.backends.cuda.kernels.handler import FusionRow, Handler, Scratch
from metatp.backends.fusion import FusionKind
from metatp.ir.ops import Op
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend

__all__ = ["CUDA_OPS", "FUSION_ROWS", "FAMILY_OF_OP", "WORKSPACE_OF_OP", "scratch_needs"]


def _join_handlers(families: dict[str, ModuleType]) -> tuple[dict[Op, Handler], dict[Op, ModuleType]]:
    handlers: dict[Op, Handler] = {}
    owner: dict[Op, ModuleType] = {}
    for name, mod in families.items():
        for op, h in mod.HANDLERS.items():
            if op in handlers:
                raise TypeError(f"CUDA op {op.name} has handlers in two families: {owner[op].__name__} and {name}")
            handlers[op], owner[op] = h, mod
    return handlers, owner


def _join_fusions(families: dict[str, ModuleType]) -> dict[FusionKind, FusionRow]:
    rows: dict[FusionKind, FusionRow] = {}
    for name, mod in families.items():
        for row in mod.FUSIONS:
            if row.kind in rows:
                raise TypeError(f"fusion {row.kind.value} has rows in two families (the second: {name})")
            rows[row.kind] = row
    return rows


#: op -> handler, and op -> the family module that owns it
CUDA_OPS, FAMILY_OF_OP = _join_handlers(FAMILY_MODULES)
#: fusion kind -> its row (the order the finders run in is `fusion.FUSION_ORDER`)
FUSION_ROWS: dict[FusionKind, FusionRow] = _join_fusions(FAMILY_MODULES)


def _workspace_families(families: dict[str, ModuleType]) -> dict[Op, tuple[ModuleType, ...]]:
    """op -> the families asked for a node's `workspace`: the op's own, then any whose fusions may
    absorb such nodes (`WORKSPACE_OPS`, e.g. a fused launch writing a cache SET_ROWS would)."""
    out: dict[Op, tuple[ModuleType, ...]] = {op: (mod,) for op, mod in FAMILY_OF_OP.items()}
    for mod in families.values():
        for op in getattr(mod, "WORKSPACE_OPS", ()):
            if mod not in out.get(op, ()):
                out[op] = out.get(op, ()) + (mod,)
    return out


#: op -> the family modules whose `workspace` a node of that op is asked of
WORKSPACE_OF_OP: dict[Op, tuple[ModuleType, ...]] = _workspace_families(FAMILY_MODULES)


def scratch_needs(backend: CupyBackend, plan: Plan, d: int, one_token_too: bool = False) -> Scratch:
    """Scratch buffer -> (elements, dtype) the kernels of device d need to run `plan` (the largest
    any node asks for), as each node's family says (and the families that may fuse it:
    `WORKSPACE_OF_OP`; `one_token_too`: a one-token step at the same KV length too)."""
    need: dict[str, tuple[int, Any]] = {}
    for node in plan.graph.nodes:
        families = WORKSPACE_OF_OP.get(node.op, ())
        if not families or not plan.of(node).compute[d]:
            continue
        for family in families:
            for key, (n, dtype) in family.workspace(backend, plan, node, d, one_token_too).items():
                if n > need.get(key, (0, None))[0]:
                    need[key] = (n, dtype)
    return need
