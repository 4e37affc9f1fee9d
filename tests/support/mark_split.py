"""One collection, split by a `-m` expression (tests/test_marks.py): which test files the
expression selects and which it deselects. Two `--collect-only` runs (`-m X`, then `-m "not X"`)
would collect the same folders twice; pytest's own `-m` deselection reports both halves at once.

Run as a script from the repository root: `python tests/support/mark_split.py EXPR PATH...` prints
one `selected <file>` or `deselected <file>` line per collected test and exits with pytest's code.
"""

from __future__ import annotations

import sys

import pytest


class _Split:
    """Records the tests `-m` deselects (pytest_deselected) and those left (the collection's items)."""

    def __init__(self) -> None:
        self.selected: list[str] = []
        self.deselected: list[str] = []

    def pytest_deselected(self, items) -> None:
        self.deselected += [item.nodeid for item in items]

    def pytest_collection_finish(self, session) -> None:
        self.selected = [item.nodeid for item in session.items]


def main(argv: list[str]) -> int:
    """Collect `argv[1:]` with `-m argv[0]` and print each test's file under its half."""
    split = _Split()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "-m", argv[0], *argv[1:]], plugins=[split])
    for half, nodeids in (("selected", split.selected), ("deselected", split.deselected)):
        for nodeid in nodeids:
            print(half, nodeid.split("::")[0])
    return int(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
