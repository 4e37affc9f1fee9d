"""Compatibility name for `tests/test_cupy_backend.py`: the host butterfly now lives in
`metatp.backends.collectives` (schedule.butterfly_schedule run by host.HostCollective)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from metatp.backends.collectives.host import HostCollective

__all__ = ["allreduce_butterfly"]

_BUTTERFLY = HostCollective("butterfly")


def allreduce_butterfly(bufs: list[np.ndarray], active: Sequence[bool] | None = None) -> None:
    """Sum `bufs` in place with the butterfly's bits (numpy runner, no compiled path)."""
    _BUTTERFLY.allreduce(bufs, active)
