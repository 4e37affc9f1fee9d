"""Marks a folder gives all of its tests (its conftest.py calls `mark_folder`)."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_folder(items: list[pytest.Item], folder: Path, mark: pytest.MarkDecorator) -> None:
    """Add `mark` to the collected items under `folder`. pytest calls a folder conftest's
    collection hook with every item of the session, not only that folder's: hence the filter."""
    folder = folder.resolve()
    for item in items:
        if folder in Path(item.path).resolve().parents:
            item.add_marker(mark)
