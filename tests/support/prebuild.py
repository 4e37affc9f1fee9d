"""Build the session's compiled libraries up front, several at once (conftest's
`pytest_collection_finish`).

The CPU kernels (the native build and every ISA build that tests/numpy's `build` fixture runs)
and the CUDA-kernel emulator's families are built on first use and cached by content
(backends/host_build.py). On a fresh machine (CI) the first tests that need them compiled them
one after another, each compile on one core; here they are compiled in a thread pool, one
compiler per core, before the first test. The same cache entries are made, so what the tests
build, load and check is unchanged. Under pytest-xdist every worker collects: a file lock lets
the first one build while the others wait, then find every library cached.

A failed build is left for the test that needs it to report (with the compiler's message).
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import pytest

Build = Callable[[], object]


def _cpu_kernel_builds(isa_builds: bool) -> list[Build]:
    """The native library, and every ISA build where `isa_builds` (x86-64 only, as tests/support/cpu.py)."""
    from metatp.backends.numpy.native import lib as native_lib

    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return []
    flag_sets = [native_lib._chosen_flag_sets()[0]]
    if isa_builds and platform.machine() in ("x86_64", "AMD64"):
        flag_sets += [native_lib.BASE_FLAGS + flags for flags, _ in native_lib.ISA_BUILDS.values()]
    return [lambda f=flags: native_lib.build_library(f, cc) for flags in dict.fromkeys(flag_sets)]


def _emulator_builds() -> list[Build]:
    """One build per CUDA kernel family (metatp.testing.cuda_emulator)."""
    from metatp.backends.cuda import kernels as ck
    from metatp.testing import cuda_emulator

    if not cuda_emulator.emulator_available():
        return []
    return [lambda fam=family: cuda_emulator.compile_family(fam) for family in ck.FAMILIES]


def _needs(items: Iterable[pytest.Item]) -> tuple[bool, bool]:
    """(the ISA builds, the emulator): what the collected tests will build."""
    isa = emu = False
    for item in items:
        isa = isa or "build" in getattr(item, "fixturenames", ())
        emu = emu or any("emulator" in m.args for m in item.iter_markers("requires")) \
            or "tests/cuda/" in Path(str(item.fspath)).as_posix()
        if isa and emu:
            break
    return isa, emu


def _run_all(builds: list[Build]) -> None:
    """Each build once, os.cpu_count() at a time; errors are left to the tests."""
    def attempt(build: Build) -> None:
        try:
            build()
        except Exception:  # noqa: BLE001 - the test that needs this library reports why it failed
            pass

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(attempt, builds))


def prebuild(items: list[pytest.Item]) -> None:
    """Compile what the collected tests will need, in parallel, unless there is only one thing
    (then nothing is gained over building it on first use)."""
    from metatp.backends.host_build import host_cache_dir

    isa, emu = _needs(items)
    if not (isa or emu):
        return
    builds = _cpu_kernel_builds(isa) + (_emulator_builds() if emu else [])
    if len(builds) < 2:
        return
    lock = host_cache_dir("METATP_KERNEL_CACHE", "metatp-kernels") / "prebuild.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)        # xdist: one worker builds, the others then hit the cache
        try:
            _run_all(builds)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
