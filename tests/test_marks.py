"""The `process` mark: every test in tests/mpi and tests/serving has it (their conftest.py), no
other test does, so `pytest -m "not process"` is the fast inner loop without child processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _split_by_mark(expression: str) -> tuple[set[str], set[str]]:
    """(files of the tests `-m expression` selects, files of those it deselects) over tests/mpi,
    tests/serving and tests/test_fixtures.py, from one --collect-only run (tests/support/mark_split.py)."""
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "mark_split.py"), expression,
                        "tests/mpi", "tests/serving", "tests/test_fixtures.py"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    halves: dict[str, set[str]] = {"selected": set(), "deselected": set()}
    for line in r.stdout.splitlines():
        half, _, path = line.partition(" ")
        if half in halves and "/" in path:
            halves[half].add(path)
    return halves["selected"], halves["deselected"]


def test_process_mark_covers_the_mpi_and_serving_folders():
    unmarked, marked = _split_by_mark("not process")
    assert unmarked == {"tests/test_fixtures.py"}
    on_disk = {p.relative_to(ROOT).as_posix() for d in ("mpi", "serving")
               for p in (ROOT / "tests" / d).glob("test_*.py")}
    assert marked and marked <= on_disk      # a module skipped at collection (a missing extra) is not listed
