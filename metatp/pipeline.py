"""Pipelined engine steps: under -sm layer the stages work on different micro-batches at once.

With one process per device (`mpiexec`, `-sm layer` or `-sm layer,tensor`) every rank runs a
step's passes in the same order; a rank receives the hidden state of a pass from the stage
before it, computes its layers and sends the result on. Run one pass after another with the
logits read after each (a broadcast from the last stage), and every rank waits for the whole
pipeline on every pass: with P stages a rank idles (P-1)/P of the time.

Here a step's passes run in windows of M (GPipe's forward schedule): a rank issues the M
passes of a window back to back and the logits are read only once the window is issued, so
stage s computes micro-batch m+1 while stage s+1 computes m. What that needs:
- each pass of a window has buffers of its own (`step.Pass.issue(in_flight)`: another
  executable of the same shape), so a later pass cannot overwrite an earlier one's logits or a
  hidden state still being sent;
- a send does not wait for its receiver (links that declare `SendRecv.defers_sends`, such as
  `MpiSendRecv`: inside `deferred_sends` Isends, all completed before the window's logits are
  read and so before any of its buffers is written again);
- enough passes: the decode tokens and short chunks of a step (the rows of the few-token path)
  are split into up to M micro-batches of whole sequences (`split_small`); long prompt chunks
  keep their passes (n_batch rows each) and only pipeline with each other.

Deadlock: every rank posts the same sends, receives and reads in the same order, a send never
blocks, and a receive or read waits only for work that comes earlier in that order.

What holds (tests/numpy/test_pipeline.py, tests/mpi/test_mpi_pipeline.py): long chunks run the
same passes as without pipelining, so their logits are bit-identical. Splitting the few-token
rows into smaller passes changes the pass sizes: where those passes take the compiled kernels
(numpy backend, quantized weights) a row's sums do not depend on the other rows of its pass
(`Backend.step_rows`, batch invariance), so those logits are bit-identical too, as are the
greedy tokens; unquantized F32 weights go through BLAS, whose sums depend on the pass size, so
there the logits agree to float rounding only (as batching itself does). A pass longer than
`step_rows` is never split; a sequence's rows are never split between micro-batches.

The pipeline drives `step.Pass` objects (`issue()`, `read()`) and knows the engine only as
the `Pipelining` it declares (its setting, its stages, its deferrable links).

The setting: `Engine.micro_batches` (the CLI's `--micro-batches M`, or $METATP_MICRO_BATCHES);
None picks the default (`micro_batches`); 1 runs one pass after another as before. The split
is part of what every rank computes alike, so every rank must have the same setting (the
CLI's flag and the environment give every rank of an mpiexec job the same). Each pass in
flight beyond the first of its shape has an executable of its own: up to M-1 more activation
buffers per shape, which the memory plan (`--fit`) does not count.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from metatp.ir.errors import ConfigError

if TYPE_CHECKING:
    from metatp.backends.collectives.p2p import SendRecv
    from metatp.step import Pass, Row

__all__ = ["ENV", "Pipelining", "env_micro_batches", "parse_micro_batches", "micro_batches", "split_small",
           "run_passes"]

ENV = "METATP_MICRO_BATCHES"
MAX_MICRO_BATCHES = 64


@dataclass(frozen=True)
class Pipelining:
    """What pipelining a step needs to know about the engine that runs it (`Engine.pipelining`)."""

    setting: int | None                 # Engine.micro_batches: None picks the default
    stages: int                         # pipeline stages of the layout (1: no -sm layer)
    across_processes: bool              # the stages are processes (an MPI world)
    links: tuple[SendRecv, ...] = ()    # point-to-point links that declare `defers_sends`


def parse_micro_batches(value: Any, what: str = "micro_batches") -> int | None:
    """An integer from 1 to MAX_MICRO_BATCHES, or None for "auto" / empty (the default)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        m = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        m = value
    else:
        raise ConfigError(f"{what} must be an integer from 1 to {MAX_MICRO_BATCHES} or 'auto', got {value!r}")
    if not 1 <= m <= MAX_MICRO_BATCHES:
        raise ConfigError(f"{what} must be from 1 to {MAX_MICRO_BATCHES}, got {m}")
    return m


def env_micro_batches() -> int | None:
    """The setting of $METATP_MICRO_BATCHES (None when unset or "auto")."""
    return parse_micro_batches(os.environ.get(ENV), f"${ENV}")


def micro_batches(how: Pipelining, n_seqs: int) -> int:
    """Passes in flight at once for a step of `n_seqs` sequences: the engine's setting, else P
    (the layout's pipeline stages) where the stages are processes linked by deferrable sends
    (CPU ranks: MPI send / receive) and the step carries at least P sequences, else 1 (in one
    process the devices take turns anyway)."""
    if how.setting is not None:
        return parse_micro_batches(how.setting, "Engine.micro_batches")
    stages = how.stages
    return stages if stages > 1 and how.across_processes and n_seqs >= stages and how.links else 1


def split_small(how: Pipelining, small: list[Row], cap: int) -> list[list[Row]]:
    """The few-token rows (`small`, grouped by sequence) as passes: slices of `cap` rows, or,
    where more micro-batches are wanted than that gives, up to M passes of whole sequences with
    about equal rows (each at most `cap`)."""
    slices = [small[i:i + cap] for i in range(0, len(small), cap)]
    seqs: list[list] = []
    for row in small:
        if seqs and seqs[-1][0].item == row.item:
            seqs[-1].append(row)
        else:
            seqs.append([row])
    want = min(micro_batches(how, len(seqs)), len(seqs))
    if want <= len(slices) or any(len(s) > cap for s in seqs):
        return slices
    groups: list[list[list]] = [[] for _ in range(want)]
    done = 0
    for rows in seqs:             # by where the sequence's middle row falls: contiguous, about equal
        groups[min(want - 1, (2 * done + len(rows)) * want // (2 * len(small)))].append(rows)
        done += len(rows)
    out: list[list] = []
    for group in groups:
        for rows in group:        # a group over `cap` rows (uneven sequences) takes more passes
            if not out or not out[-1] or len(out[-1]) + len(rows) > cap:
                out.append([])
            out[-1].extend(rows)
        if out and out[-1]:
            out.append([])
    return [rows for rows in out if rows]


def run_passes(how: Pipelining, passes: Sequence[Pass], n_seqs: int) -> list[list]:
    """Every pass's logits (`Pass.read`'s), the passes run in windows of M for a step of
    `n_seqs` sequences."""
    m = micro_batches(how, n_seqs)
    if m <= 1 or len(passes) <= 1:
        return [p.run() for p in passes]
    out: list[list] = []
    for i in range(0, len(passes), m):
        window = passes[i:i + m]
        with ExitStack() as stack:
            for link in how.links:
                stack.enter_context(link.deferred_sends())
            in_flight: dict = {}
            for p in window:
                p.issue(in_flight)
        out.extend(p.read() for p in window)
    return out
