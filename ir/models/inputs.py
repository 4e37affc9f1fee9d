"""The inputs a forward graph takes each step, defined once for the builders and the feeders.

A graph builder declares the input leaves (`declare_inputs`): a `StepInputs[Tensor]`, kept in
`graph.meta["inputs"]`. Whoever runs the graph (the engine, `gpu_check`, tests) fills the same
fields with arrays (`StepInputs[np.ndarray]`, usually from `step_values` or `sequence_values`)
and turns the pair into the executable's feed with `make_feed`. The field names, leaf names,
types and shapes live here and nowhere else, so a new input is one field, not a string key
written in four places.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Generic, Sequence, TypeVar

import numpy as np

from metatp.ir import ops
from metatp.ir.tensor import Flag, GGMLType, Tensor

if TYPE_CHECKING:
    from metatp.ir.graph import Graph
    from metatp.ir.models.common import BatchSpec

__all__ = ["StepInputs", "INPUT_NAMES", "declare_inputs", "graph_inputs", "kq_masks", "step_values",
           "sequence_values", "make_feed"]

V = TypeVar("V")


@dataclass(frozen=True)
class StepInputs(Generic[V]):
    """One value per per-step input of a forward graph: leaves (`Tensor`) or their data (`np.ndarray`).

    Shapes are numpy's (rows first), for T new tokens over n_kv cache cells."""

    tokens: V                     # [T] i32: token ids
    pos: V                        # [T] i32: each row's position in its sequence (rope)
    kv_idxs: V                    # [T] i32: the KV cell each row writes
    kq_mask: V                    # [T, n_kv] f32: 0 where a row sees a cell, -inf elsewhere
    out_ids: V | None = None      # [n_outputs] i32: rows whose logits are kept (absent: every row)
    kq_mask_swa: V | None = None  # [T, n_kv] f32: the causal mask limited to the sliding window


# field -> (leaf name, ggml type). The leaf names are llama.cpp's (the dump tool shows them).
INPUT_NAMES: dict[str, tuple[str, GGMLType]] = {
    "tokens": ("inp_tokens", GGMLType.I32),
    "pos": ("inp_pos", GGMLType.I32),
    "kv_idxs": ("inp_kv_idxs", GGMLType.I32),
    "kq_mask": ("kq_mask", GGMLType.F32),
    "out_ids": ("inp_out_ids", GGMLType.I32),
    "kq_mask_swa": ("kq_mask_swa", GGMLType.F32),
}
_NP = {GGMLType.I32: np.int32, GGMLType.F32: np.float32}


def _leaf(field: str, ne: tuple[int, ...]) -> Tensor:
    name, typ = INPUT_NAMES[field]
    return ops.new_tensor(name, ne, typ, Flag.INPUT)


def declare_inputs(spec: BatchSpec, swa: bool = False) -> StepInputs[Tensor]:
    """A graph's per-step input leaves for `spec`: out_ids only when fewer rows than tokens are
    read out; the sliding-window mask only for a model with SWA layers (`swa`)."""
    T = spec.n_tokens
    tokens, pos, kv_idxs = _leaf("tokens", (T,)), _leaf("pos", (T,)), _leaf("kv_idxs", (T,))
    kq_mask = _leaf("kq_mask", (spec.n_kv, T))
    out_ids = _leaf("out_ids", (spec.n_outputs,)) if spec.n_outputs != T else None
    kq_mask_swa = _leaf("kq_mask_swa", (spec.n_kv, T)) if swa else None
    return StepInputs(tokens, pos, kv_idxs, kq_mask, out_ids, kq_mask_swa)


def graph_inputs(graph: Graph) -> StepInputs[Tensor]:
    """The input leaves a built forward graph declared."""
    return graph.meta["inputs"]


def kq_masks(seen: Sequence[np.ndarray], pos: np.ndarray, n_kv: int, window: int = 0,
             swa: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """The attention masks of rows that see cells `seen[i]` (the cells of positions 0..pos[i] of
    their sequence, in position order): the causal mask, and with `swa` the sliding-window one
    (llama.cpp's standard SWA: only the last `window` of those cells; window <= 0: all of them)."""
    mask = np.full((len(seen), n_kv), -np.inf, dtype=np.float32)
    swa_mask = mask.copy() if swa else None
    for i, cells in enumerate(seen):
        mask[i, cells] = 0.0
        if swa_mask is not None:
            swa_mask[i, cells[max(0, int(pos[i]) + 1 - window):] if window > 0 else cells] = 0.0
    return mask, swa_mask


def step_values(leaves: StepInputs[Tensor], tokens: np.ndarray, pos: np.ndarray, kv_idxs: np.ndarray,
                seen: Sequence[np.ndarray], window: int = 0,
                out_ids: Sequence[int] | None = None) -> StepInputs[np.ndarray]:
    """The arrays for `leaves`: rows at positions `pos` writing cells `kv_idxs` and seeing cells
    `seen` (see `kq_masks`); `out_ids` is used only when the graph declares that input."""
    n_kv = leaves.kq_mask.ne[0]
    mask, swa_mask = kq_masks(seen, pos, n_kv, window, leaves.kq_mask_swa is not None)
    out = None
    if leaves.out_ids is not None:
        if out_ids is None:
            raise ValueError("this graph reads out a subset of rows: out_ids is needed")
        out = np.asarray(out_ids, dtype=np.int32)
    return StepInputs(tokens, pos, kv_idxs, mask, out, swa_mask)


def sequence_values(leaves: StepInputs[Tensor], tokens: Sequence[int], n_past: int, window: int = 0,
                    out_ids: Sequence[int] | None = None) -> StepInputs[np.ndarray]:
    """The arrays for one sequence laid out from cell 0 (cell j holds position j) after `n_past`
    cached tokens; the rows read out default to the last ones."""
    T = len(tokens)
    pos = np.arange(n_past, n_past + T, dtype=np.int32)
    if out_ids is None and leaves.out_ids is not None:
        out_ids = range(T - leaves.out_ids.ne[0], T)
    seen = [np.arange(p + 1) for p in pos]
    return step_values(leaves, np.asarray(tokens, dtype=np.int32), pos, pos, seen, window, out_ids)


def _dims(shape) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def make_feed(leaves: StepInputs[Tensor], values: StepInputs[np.ndarray], graph: Graph | None = None
              ) -> dict[Tensor, np.ndarray]:
    """The executable's feed: each declared leaf with its array (same fields present in both,
    types as declared, shapes checked). With `graph`, a declared leaf that none of its nodes
    reads is left out (the full mask of a model whose every layer slides: no plan holds it)."""
    feed: dict[Tensor, np.ndarray] = {}
    read = None if graph is None else _read_leaves(graph)
    for f in fields(StepInputs):
        leaf, value = getattr(leaves, f.name), getattr(values, f.name)
        if (leaf is None) != (value is None):
            raise ValueError(f"step input {f.name!r}: the graph {'lacks' if leaf is None else 'declares'} it "
                             f"but a value is {'given' if leaf is None else 'missing'}")
        if leaf is None or (read is not None and leaf not in read):
            continue
        arr = np.asarray(value, dtype=_NP[leaf.type])
        if _dims(arr.shape) != _dims(reversed(leaf.ne)):
            raise ValueError(f"step input {f.name!r}: shape {arr.shape} does not fit the leaf {leaf.name} {leaf.ne}")
        feed[leaf] = arr
    return feed


def _read_leaves(graph: Graph) -> frozenset:
    """The graph's leaves as a set, made once per graph (a built graph does not change)."""
    read = graph.meta.get("leaf_set")
    if read is None:
        read = graph.meta["leaf_set"] = frozenset(graph.leaves)
    return read
