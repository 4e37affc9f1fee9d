"""The METATP_REQUIRE switch (tests/conftest.py, tests/support/require.py): a prerequisite it names
turns that prerequisite's skips into failures that say what is missing and why.

The switch is checked from outside, as CI uses it: pytest runs in a subprocess on one CPU-kernel
test file with the C compiler hidden (`CC=false`, or a `CC` that is not on PATH) and a fresh
kernel cache (no cached build to fall back on)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.require import NAMES, have, require, required_names

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILE = "tests/numpy/test_batch_invariance.py"     # every test in it needs the CPU kernels


def _pytest(tmp_path: Path, require_env: str, cc: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "METATP_REQUIRE": require_env, "CC": cc, "METATP_KERNEL_CACHE": str(tmp_path / "cache"),
           "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfsE", "-p", "no:cacheprovider", "-o", "addopts=",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _counts(out: str) -> dict[str, int]:
    """{"passed": n, "failed": n, "skipped": n, "errors": n} from pytest's last summary line (a
    failure in a test's setup, where the prerequisite is checked, counts as an error)."""
    last = out.strip().splitlines()[-1]
    return {word.rstrip("s") if word.startswith("error") else word: int(n)
            for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


def test_names_parse_and_a_typo_is_refused():
    assert required_names("") == frozenset()
    assert required_names(" mpi, serve ,") == {"mpi", "serve"}
    assert required_names("all") == set(NAMES) and {"cpu_kernels", "emulator", "mpi", "serve", "nvrtc"} <= set(NAMES)
    with pytest.raises(ValueError, match="cpu_kernel"):
        required_names("cpu_kernel")


def test_a_typo_in_the_environment_stops_the_session(tmp_path):
    r = _pytest(tmp_path, "cpu_kernels,mpy", "cc", "--collect-only", "tests/test_fixtures.py")
    assert r.returncode == 4, r.stdout + r.stderr           # pytest's usage error
    assert "mpy" in r.stderr and "known:" in r.stderr


def test_an_explicit_reason_skips_or_fails(monkeypatch):
    monkeypatch.setenv("METATP_REQUIRE", "")
    require("model", None)                                  # present: nothing happens
    assert have("model", None) and not have("model", "not here")
    with pytest.raises(pytest.skip.Exception, match=r"\[model\] not here"):
        require("model", "not here")
    monkeypatch.setenv("METATP_REQUIRE", "model")
    with pytest.raises(pytest.fail.Exception, match="METATP_REQUIRE requires 'model'.*but not here"):
        require("model", "not here")
    with pytest.raises(pytest.fail.Exception, match="not here"):
        have("model", "not here")


@pytest.mark.parametrize("cc", ["false", "no-such-compiler-metatp"], ids=["broken-build", "no-compiler"])
def test_cpu_kernel_tests_fail_without_a_compiler_when_required(tmp_path, cc):
    r = _pytest(tmp_path, "cpu_kernels", cc, KERNEL_FILE)
    out = r.stdout + r.stderr
    counts = _counts(r.stdout)
    assert r.returncode == 1 and set(counts) == {"error"} and counts["error"] > 100, out   # none skips or runs
    assert out.count("METATP_REQUIRE requires 'cpu_kernels'") >= counts["error"], out
    why = "building cpu_kernels.c with false failed" if cc == "false" else f"no C compiler '{cc}' on PATH"
    assert why in out, out                                  # the compiler's own words, or the missing one


def test_cpu_kernel_tests_skip_without_the_switch(tmp_path):
    r = _pytest(tmp_path, "", "false", KERNEL_FILE)
    out = r.stdout + r.stderr
    counts = _counts(r.stdout)
    assert r.returncode == 0 and set(counts) == {"skipped"} and counts["skipped"] > 100, out
    assert "[cpu_kernels] the CPU kernels did not build" in out
