"""Prerequisite skips that can be made failures: `METATP_REQUIRE` (see tests/conftest.py).

A test that cannot run without something the machine may lack (the C kernels, g++, MPI, the
serving extras...) says so through this module, never through a bare `skipif`/`pytest.skip`:

- `requires(name)` marks a test, class or module (`pytestmark = requires("mpi")`); the check
  runs at setup time (tests/conftest.py's hook), once per name per session;
- `requires(name, why=...)` when the test file computes its own reason (a model file that is not
  cached): `why` is None when the prerequisite is present;
- `require(name)` inside a test or fixture, `have(name)` for an optional part of a test.

Without `name` in METATP_REQUIRE a missing prerequisite skips, saying why; with it, the test
fails with the same words (for a broken build, the compiler's own message).
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Callable

import pytest

__all__ = ["NAMES", "CHECK", "required_names", "missing", "require", "requires", "have", "apply_markers"]

#: every name METATP_REQUIRE knows, and what it stands for (documented in tests/conftest.py too)
NAMES: dict[str, str] = {
    "cpu_kernels": "the numpy backend's C kernels build and load (a C compiler, $CC or cc)",
    "emulator": "a host C++ compiler ($CXX or g++) for the CUDA-kernel emulator",
    "mpi": "mpi4py and an mpiexec on PATH (the mpi extra)",
    "serve": "fastapi, uvicorn, openai and httpx (the serve and test extras)",
    "structured": "llguidance and jsonschema (structured output; the structured and test extras)",
    "nvrtc": "cupy with a loadable NVRTC (the nvrtc extra; no GPU needed)",
    "nvcc": "the CUDA toolkit's nvcc on PATH",
    "cuda_bindings": "NVIDIA's cuda-bindings, the pdl option's launch path (the pdl and nvrtc extras; no GPU needed)",
    "gpu": "a usable CUDA GPU",
    "nccl": "cupy with NCCL",
    "model": "the real models the tests read from the model cache (the default model, gemma3-270m)",
    "refs": "the reference outputs in shared/refs beside the checkout (made on the development machine)",
    "bench": "llama-cpp-python (the bench extra)",
    "graphviz": "Graphviz's `dot` on PATH",
    "cpp": "a C preprocessor (`cpp`) on PATH",
    "git": "git on PATH and a git checkout of the project",
    "ssh": "an ssh client on PATH (MPICH's launcher reaches other hosts through it)",
    "browser": "headless Chromium: chromium and chromedriver on PATH, and selenium (the test extra)",
    "lm_eval": "lm-evaluation-harness's local-completions model (lm-eval installed --no-deps, and the eval extra)",
}

ENV = "METATP_REQUIRE"


class _Check:
    """The default `why`: ask this module's check for the name."""

    def __repr__(self) -> str:
        return "CHECK"


CHECK = _Check()


def required_names(value: str | None = None) -> frozenset[str]:
    """The names in METATP_REQUIRE (or `value`): comma-separated, `all` for every name.
    Raises ValueError naming an unknown name (a typo must not turn the switch off)."""
    raw = os.environ.get(ENV, "") if value is None else value
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(NAMES)
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise ValueError(f"{ENV} names unknown prerequisites {unknown}; known: all, {', '.join(NAMES)}")
    return frozenset(names)


def _cpu_kernels() -> str | None:
    from metatp.backends.numpy import native

    if native.available():
        return None
    info = native.kernel_info()
    if "build failed" not in info:
        return f"the CPU kernels are unavailable: {info}"
    try:    # the library keeps only a warning: build once more, plainly, for the compiler's message
        native.build_library(("-O3", "-fPIC", "-shared", "-std=gnu11", "-w"))
    except (RuntimeError, OSError) as e:
        return f"the CPU kernels did not build ({info}): {e}"
    return f"the CPU kernels are unavailable ({info}), though a plain build succeeds now"


def _emulator() -> str | None:
    cxx = os.environ.get("CXX", "g++")
    return None if shutil.which(cxx) else f"no host C++ compiler {cxx!r} on PATH for the CUDA-kernel emulator"


def _mpi() -> str | None:
    from support.helpers import mpi_missing

    return mpi_missing()


def _modules(names: tuple[str, ...], extra: str) -> str | None:
    for mod in names:
        try:
            __import__(mod)
        except ImportError as e:
            return f"{mod} is not importable ({e}; pip install 'metatp[{extra}]')"
    return None


def _nvrtc() -> str | None:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - ImportError, or CuPy failing to load libnvrtc
        return f"cupy with NVRTC is not importable ({type(e).__name__}: {e}); pip install -e '.[nvrtc]'"
    return None


def _gpu() -> str | None:
    from metatp.backends.cuda.runtime import gpu_probe

    ok, why = gpu_probe()
    return None if ok else f"no usable CUDA GPU ({why or 'cupy absent or no device'})"


def _nccl() -> str | None:
    try:
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001 - cupy absent, or no CUDA runtime to load
        return f"cupy is not importable ({type(e).__name__})"
    return None if getattr(nccl, "available", False) else "cupy has no NCCL (pip install nvidia-nccl-cu12)"


def _model() -> str | None:
    from metatp.models import resolve_model

    try:
        resolve_model(None, quiet=True)
    except Exception as e:  # noqa: BLE001 - no network and no cache
        return f"default model unavailable: {e}"
    return None


def _on_path(tool: str, what: str) -> Callable[[], str | None]:
    return lambda: None if shutil.which(tool) else f"no {what} (`{tool}`) on PATH"


def _refs() -> str | None:
    from pathlib import Path

    refs = Path(__file__).resolve().parents[3] / "shared" / "refs"
    return None if refs.is_dir() else f"no reference data at {refs}"


def _browser() -> str | None:
    """The chat page's browser tests: selenium drives the system's Chromium through its chromedriver
    (Debian's chromium and chromium-driver packages; .ci/run installs them)."""
    try:
        import selenium  # noqa: F401
    except ImportError as e:
        return f"selenium is not importable ({e}; pip install 'metatp[test]')"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no Chromium (`chromium`) on PATH (apt-get install chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no `chromedriver` on PATH (apt-get install chromium-driver)"
    return None


def _lm_eval() -> str | None:
    """lm-evaluation-harness's API models run without torch: .ci/run installs lm-eval with --no-deps
    (its declared dependencies bring torch, datasets, evaluate) and the eval extra brings what they
    import at run time."""
    try:
        import lm_eval.models.openai_completions  # noqa: F401
    except ImportError as e:
        return (f"lm_eval's local-completions model is not importable ({e}; pip install --no-deps lm-eval "
                f"and pip install 'metatp[eval]')")
    return None


def _git() -> str | None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        return f"needs git and a git checkout ({root})"
    return None


_CHECKS: dict[str, Callable[[], str | None]] = {
    "cpu_kernels": _cpu_kernels,
    "emulator": _emulator,
    "mpi": _mpi,
    "serve": lambda: _modules(("fastapi", "uvicorn", "openai", "httpx"), "serve,test"),
    "structured": lambda: _modules(("llguidance", "jsonschema"), "structured,test"),
    "nvrtc": _nvrtc,
    "nvcc": _on_path("nvcc", "CUDA compiler"),
    "cuda_bindings": lambda: _modules(("cuda.bindings.driver",), "pdl"),
    "gpu": _gpu,
    "nccl": _nccl,
    "model": _model,
    "refs": _refs,
    "bench": lambda: _modules(("llama_cpp",), "bench"),
    "graphviz": _on_path("dot", "Graphviz"),
    "cpp": _on_path("cpp", "C preprocessor"),
    "git": _git,
    "ssh": _on_path("ssh", "ssh client"),
    "browser": _browser,
    "lm_eval": _lm_eval,
}
assert set(_CHECKS) == set(NAMES)


@functools.lru_cache(maxsize=None)
def missing(name: str) -> str | None:
    """Why `name` is absent here, or None (checked once per session)."""
    if name not in _CHECKS:
        raise ValueError(f"unknown prerequisite {name!r}; known: {', '.join(NAMES)}")
    return _CHECKS[name]()


def _why(name: str, why: object) -> str | None:
    if name not in NAMES:
        raise ValueError(f"unknown prerequisite {name!r}; known: {', '.join(NAMES)}")
    return missing(name) if why is CHECK else why  # type: ignore[return-value]


def require(name: str, why: str | None | _Check = CHECK, *, _at_item: bool = False) -> None:
    """Skip the running test when `name` is missing, or fail it when METATP_REQUIRE names it.
    (The skip is reported at the caller's line; a marker's at the test's.)"""
    __tracebackhide__ = True
    reason = _why(name, why)
    if reason is None:
        return
    if name in required_names():
        pytest.fail(f"{ENV} requires {name!r} ({NAMES[name]}), but {reason}", pytrace=False)
    raise pytest.skip.Exception(f"[{name}] {reason}", _use_item_location=_at_item)


def have(name: str, why: str | None | _Check = CHECK) -> bool:
    """For an optional part of a test: True when `name` is present; False when it is missing (or
    the test fails when METATP_REQUIRE names it)."""
    __tracebackhide__ = True
    reason = _why(name, why)
    if reason is not None and name in required_names():
        pytest.fail(f"{ENV} requires {name!r} ({NAMES[name]}), but {reason}", pytrace=False)
    return reason is None


def requires(*names: str, why: str | None | _Check = CHECK) -> pytest.MarkDecorator:
    """The marker: the test needs every one of `names` (checked at setup, see `require`)."""
    for name in names:
        if name not in NAMES:
            raise ValueError(f"unknown prerequisite {name!r}; known: {', '.join(NAMES)}")
    return pytest.mark.requires(*names, why=why)


def apply_markers(item: pytest.Item) -> None:
    """Run `require` for every `requires` marker on a test (conftest's setup hook)."""
    for mark in item.iter_markers("requires"):
        for name in mark.args:
            require(name, mark.kwargs.get("why", CHECK), _at_item=True)
