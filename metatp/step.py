"""One engine step's rows, and the forward passes they run in.

The engine (`metatp.engine`) turns a step's items into rows, groups the rows into passes and
builds one `Pass` per group; pipelining (`metatp.pipeline`) then drives the passes through
their public `issue()` and `read()` without knowing the engine: `issue` pads the rows to a
bucket, picks the plan of that shape and runs its executable; `read` reads the logits of the
rows that want them, in one of three ways the executable declares (`read_argmax`,
`read_candidates`, `read`). A pass reaches the engine only through `PassHost`, which says what
it needs (plans, the cell table, the row limits and the statistics it counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from metatp.backends.base import Executable
from metatp.ir.loader import Model
from metatp.ir.models import BatchSpec
from metatp.ir.models.inputs import graph_inputs, make_feed, step_values
from metatp.kv_cells import KVCells, SeqCells
from metatp.passes.plan import Plan
from metatp.sampling import CandidateSpec

__all__ = ["StepItem", "Row", "Pass", "PassHost", "bucket_rows"]


def bucket_rows(n: int, cap: int, small: int, buckets: Sequence[int] = ()) -> int:
    """Rows a pass of `n` real rows is padded to (one plan per bucket): 1, 2, 4, then multiples
    of 4 up to 16, of 16 up to `small` (the few-token path), then of 32, at most `cap`. A
    backend's own `buckets` (`Backend.row_buckets`, e.g. the CUDA graph sizes) replace those up
    to `small`: the first that holds `n`."""
    fit = [b for b in buckets if b >= n] if n <= small else []
    if fit:
        return max(n, min(fit[0], cap))
    if n <= 2:
        b = n
    elif n <= 16:
        b = -(-n // 4) * 4
    elif n <= small:
        b = -(-n // 16) * 16
    else:
        b = -(-n // 32) * 32
    return max(n, min(b, cap))


@dataclass
class StepItem:
    """One sequence's part of a step: `tokens` at its next positions; which logits it wants:
    "last" (the row sampled next), "all" (scoring), "none" (a prompt chunk that is not the end)
    or "argmax" (the last row's greedy token only: read from a vocabulary split without
    gathering it, `backends.logits_read`; its logits come back only where one is not finite),
    or a `CandidateSpec` (the last row sampled from its candidates: a vocabulary split comes
    back as `RowCandidates` where they cover the request's pick, `backends.candidates`; else,
    and without a split, as the row); or "hidden" (embedding: every row's final normed hidden
    state, [len(tokens), n_embd], from passes of their own whose graphs end before the lm head)."""

    seq: SeqCells
    tokens: list[int]
    logits: str | CandidateSpec = "last"


@dataclass
class Row:
    """One token of a step: which item it belongs to, where, and what is read at it."""

    item: int           # index into the step's items
    pos: int            # position in its sequence
    token: int
    out: bool           # logits wanted here
    greedy: bool = False    # ... and only their argmax
    spec: CandidateSpec | None = None    # ... or the candidates this spec samples from


class PassHost(Protocol):
    """What a pass needs from the engine that builds it (`Engine` is one)."""

    model: Model
    n_batch: int
    small_rows: int         # rows of the few-token path (`Backend.step_rows`)
    row_buckets: tuple[int, ...]    # ... and the sizes its passes pad to (`Backend.row_buckets`)
    cells: KVCells
    passes: int             # statistics a pass adds to: passes run,
    logits_bytes: int       # logits bytes gathered to this process,
    candidate_rows: int     # rows sampled from their candidates

    def plan_for(self, spec: BatchSpec, slot: int = 0) -> tuple[Plan, Executable]:
        ...

    def kv_span(self, n_used: int, n_rows: int) -> int:
        ...


class Pass:
    """One forward pass over some rows of a step: `issue()` runs it, `read()` returns the logits
    of its rows that want them (in row order); `run()` is both. Several passes may be issued
    before any is read (`metatp.pipeline`): each then has an executable of its own."""

    def __init__(self, host: PassHost, items: list[StepItem], rows: list[Row], keep: dict[int, int]) -> None:
        self.host = host
        self.items = items
        self.rows = rows
        self.keep = keep            # sequence id -> cells it keeps (padding rows use none of them)
        self._issued: tuple | None = None

    def run(self) -> list:
        """Issue the pass and read its logits (the one place that feeds an executable)."""
        self.issue()
        return self.read()

    def issue(self, in_flight: dict | None = None) -> None:
        """Pad the rows to a bucket and run the executable of that shape. `in_flight`: the shapes
        already issued and not read yet in this window (shape key -> count); a shape in flight
        takes another slot, so that it does not overwrite an earlier pass's buffers."""
        host, items, rows = self.host, self.items, self.rows
        T = len(rows)
        cap = min(host.small_rows, host.n_batch) if T <= host.small_rows else host.n_batch
        T_pad = bucket_rows(T, max(cap, T), host.small_rows, host.row_buckets)
        scratch = host.cells.scratch_cells(T_pad - T, self.keep) if T_pad > T else np.zeros(0, np.int32)
        if scratch.size < T_pad - T:            # a full cache: no room for padding rows
            T_pad, scratch = T, scratch[:0]
        out_rows = [i for i, r in enumerate(rows) if r.out]
        n_out = len(out_rows)
        n_out_pad = min(bucket_rows(n_out, T_pad, host.small_rows, host.row_buckets), T_pad) if n_out else 1
        cells = np.empty(T_pad, dtype=np.int32)
        pos = np.zeros(T_pad, dtype=np.int32)
        ids = np.zeros(T_pad, dtype=np.int32)
        for i, r in enumerate(rows):
            cells[i] = items[r.item].seq.cells[r.pos]
            pos[i], ids[i] = r.pos, r.token
        cells[T:] = scratch
        hi = max(int(cells.max()), max((int(items[r.item].seq.cells[: r.pos + 1].max()) for r in rows), default=0))
        hidden = items[rows[0].item].logits == "hidden"     # the engine never mixes them with logits rows
        spec = BatchSpec(T_pad, host.kv_span(hi + 1, T_pad), n_out_pad, hidden)
        slot = 0
        if in_flight is not None:
            key = spec.key()
            slot = in_flight.get(key, 0)
            in_flight[key] = slot + 1
        plan, ex = host.plan_for(spec, slot)
        inp = graph_inputs(plan.graph)
        seen = [items[r.item].seq.cells[: r.pos + 1] for r in rows]
        seen += [cells[i:i + 1] for i in range(T, T_pad)]    # a padding row sees only its own scratch cell
        if inp.out_ids is not None:
            sel = out_rows + [out_rows[-1] if out_rows else 0] * (n_out_pad - n_out)
        else:
            sel = list(range(T_pad))
        values = step_values(inp, ids, pos, cells, seen, host.model.hparams.sliding_window, sel)
        ex.run(make_feed(inp, values, plan.graph))
        host.passes += 1
        self._issued = (plan, ex, sel, out_rows, n_out)

    def read(self) -> list:
        """The logits of the issued pass's rows that want them (every process reads alike): per
        row its greedy token, its `RowCandidates` or its logits row."""
        if self._issued is None:
            raise RuntimeError("Pass.read before Pass.issue")
        plan, ex, sel, out_rows, n_out = self._issued
        host, rows = self.host, self.rows
        if not n_out:
            return []
        t = plan.graph.meta["output"]             # the logits, or an embedding pass's hidden states
        at = {row: k for k, row in reversed(list(enumerate(sel)))}
        got: dict[int, object] = {}                 # out row -> its greedy token or RowCandidates
        if any(rows[i].greedy for i in out_rows):
            picks, received = ex.read_argmax(t)
            host.logits_bytes += received
            got.update((i, picks[at[i]]) for i in out_rows if rows[i].greedy and picks[at[i]] is not None)
        specs = [i for i in out_rows if rows[i].spec is not None and ex.candidates_pay(t, rows[i].spec.k)]
        if specs:                                   # every process decides `covers` alike on the same numbers
            by = [rows[j].spec if j < len(rows) else None for j in sel]       # per logits row
            temps = [s.temperature if s is not None and s.temperature > 0 else 1.0 for s in by]
            adjs = [s.adjust if s is not None else None for s in by]
            cands, received = ex.read_candidates(t, max(rows[i].spec.k for i in specs), temps, adjs)
            host.logits_bytes += received
            for i in specs if cands is not None else ():
                rc = cands[at[i]].narrowed(rows[i].spec.k)     # what this row alone would read
                if rows[i].spec.covers(rc):
                    got[i] = rc
                    host.candidate_rows += 1
        if len(got) == n_out:
            return [got[i] for i in out_rows]
        logits = ex.read(t)                         # every process makes this read alike: the picks agree
        host.logits_bytes += logits.nbytes if len(ex.devices) < plan.n_devices else 0
        logits = logits.reshape(-1, logits.shape[-1])
        # rows of the read's own array (`read` returns a fresh one), not copies of them: a step of
        # 16 sequences copied 3 MB more a step that way
        return [got[i] if i in got else logits[at[i]] for i in out_rows]
