"""What every kernel family's handlers share: the handler and fusion-row types, recording a
launcher's launches, and reading a node's device arrays from the executable.

A handler takes the executable, a device and a node (or a `Fusion`) and returns that device's
steps: kernel launches recorded with frozen arguments, `StreamCall`s (a cuBLAS GEMM: captured
with them where the runtime's cuBLAS can be) or `HostStep`s (cupy ops: eager only). It raises
ValueError / TypeError / UnsupportedOpError for a layout its kernel cannot take. A family module
(`kernels/<family>.py`) exports its `HANDLERS`, its `FUSIONS` (one `FusionRow` per fusion its
kernels implement) and `workspace`, its scratch needs, decided by the same functions its handlers
call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from metatp.backends.cuda.launch import recording, rows2d
from metatp.backends.cuda.storage import RawWeight
from metatp.backends.fusion import Finder, Fusion, FusionKind
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["Handler", "FusedHandler", "FusionRow", "Scratch", "record", "array_of", "rows_view", "weight_operand",
           "unfused_in_order", "no_workspace"]

Handler = Callable[["CupyExecutable", int, Tensor], list]
FusedHandler = Callable[["CupyExecutable", int, Fusion], list]
#: scratch buffer name -> (elements, dtype) a node needs on one device
Scratch = dict[str, tuple[int, Any]]


def no_workspace(backend: Any, plan: Any, node: Tensor, d: int, one_token_too: bool = False) -> Scratch:
    """The `workspace` of a family whose kernels need no scratch."""
    return {}


def unfused_in_order(ex: CupyExecutable, d: int, f: Fusion) -> list:
    """A fusion's nodes one by one, in graph order: what runs when its kernel refuses a layout
    (their outputs have buffers; their inputs are kept alive)."""
    idx = ex.plan.graph.index
    steps: list = []
    for t in sorted(f.members, key=lambda t: idx[t]):
        steps += ex.node_steps(d, t)
    return steps


@dataclass(frozen=True)
class FusionRow:
    """One fusion a family's kernels implement: its kind, where it is found (`find`, a
    `backends.fusion.Finder`), what runs it (`run`) and what runs instead when `run` refuses
    the layout (`unfused`: by default the nodes one by one)."""

    kind: FusionKind
    find: Finder
    run: FusedHandler
    unfused: FusedHandler = unfused_in_order


def record(fn, *args, **kw) -> list:
    """The launches `fn(*args, **kw)` makes, recorded with frozen arguments."""
    with recording() as launches:
        fn(*args, **kw)
    return [la.frozen() for la in launches]


def array_of(ex: CupyExecutable, d: int, t: Tensor | None):
    """Device d's array of `t` (None for an absent operand)."""
    return ex.arrays[d][t] if t is not None else None


def rows_view(ex: CupyExecutable, arr):
    """A 2-D (rows, ne0) view of an array whose leading dims collapse (else ValueError)."""
    ne0, n_rows, stride = rows2d(arr)
    return ex.rt.view(arr, 0, (n_rows, ne0), (stride * arr.dtype.itemsize, arr.dtype.itemsize),
                      arr.dtype) if arr.size else arr.reshape(n_rows, ne0)


def weight_operand(ex: CupyExecutable, d: int, w: Tensor) -> tuple[Any, str, int, int]:
    """(data, weight type, row bytes, matrix bytes) of a weight for the matvec kernels."""
    a = ex.arrays[d][w]
    if isinstance(a, RawWeight):
        return a.data, a.wtype, a.nb[1], a.nb[2]
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise UnsupportedOpError(f"cupy backend: weight {w.name!r} must be f32 or raw GGUF blocks")
    loc = ex.plan.of(w).local[d]
    return a, "f32", loc.ne[0] * 4, loc.ne[0] * loc.ne[1] * 4
