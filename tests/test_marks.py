"""The `process` mark: every test in tests/mpi and tests/serving has it (their conftest.py), no
other test does, so `pytest -m "not process"` is the fast inner loop without child processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args,
                        "tests/mpi", "tests/serving", "tests/test_fixtures.py"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}


def test_process_mark_covers_the_mpi_and_serving_folders():
    marked = _collected("-m", "process")
    unmarked = _collected("-m", "not process")
    assert unmarked == {"tests/test_fixtures.py"}
    on_disk = {p.relative_to(ROOT).as_posix() for d in ("mpi", "serving")
               for p in (ROOT / "tests" / d).glob("test_*.py")}
    assert marked and marked <= on_disk      # a module skipped at collection (a missing extra) is not listed
