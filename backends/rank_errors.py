"""What every rank of an MPI job agrees on about errors, as plain functions.

`distributed` (the world) and `watchdog` (the heartbeat and the start-up version check) both
mark errors every rank raises alike and look for the rank that disagrees; the two live here so
that neither module imports the other for them. `distributed` re-exports both names.
"""

from __future__ import annotations

from metatp.ir.errors import MetatpError

__all__ = ["every_rank", "first_disagreeing"]


def first_disagreeing(seen: list[tuple]) -> int | None:
    """The first rank whose entry (its first field) differs from rank 0's in an allgather of
    per-rank facts; None when every rank agrees."""
    return next((r for r, entry in enumerate(seen) if entry[0] != seen[0][0]), None)


def every_rank(err: MetatpError) -> MetatpError:
    """Mark an error that every rank raises identically (rank 0 alone reports it)."""
    err.every_rank = True        # type: ignore[attr-defined]
    return err
