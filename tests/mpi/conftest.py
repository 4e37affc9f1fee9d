"""Every test here is marked `process`: it starts other processes (mpiexec ranks and `python -m metatp` children), so it is the
slow part of the suite; `pytest -m "not process"` is the fast inner loop that leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.marks import mark_folder


def pytest_collection_modifyitems(config, items) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.process)
