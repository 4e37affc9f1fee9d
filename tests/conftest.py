"""Shared fixtures: synthetic GGUF models and the real default model (when it is cached).

A test module names its synthetic model once, as a module-level `SPEC` (a `SynthSpec`), and
takes it as `path` (the GGUF file, a str), `synth_model` (loaded) or `llm` (an `LLM` on the
numpy backend with the module's `LLM_OPTIONS`). Files are written once per session per spec
(`synth_factory`). `tests/test_fixtures.py` checks that no fixture is declared twice.

Prerequisites (`tests/support/require.py`): a test that needs something this machine may lack
is marked `@requires(name)` (or calls `require(name)`), never a bare skip. It skips, saying
why, unless `METATP_REQUIRE` (comma-separated names, or `all`) names it: then it fails with
the reason (a broken C build: the compiler's message). `.ci/run` sets it for what CI installs.
The names:

- `cpu_kernels`: the numpy backend's C kernels build and load ($CC or cc);
- `emulator`: a host C++ compiler ($CXX or g++) for the CUDA-kernel emulator;
- `mpi`: mpi4py and `mpiexec` on PATH (the `mpi` extra);
- `serve`: fastapi, uvicorn, openai and httpx (the `serve` and `test` extras);
- `nvrtc`: cupy with a loadable NVRTC (the `nvrtc` extra; no GPU needed);
- `nvcc`: the CUDA toolkit's nvcc (CI requires it where its image has one on PATH);
- `cuda_bindings`: NVIDIA's cuda-bindings, the cupy backend's pdl launch path (the `pdl` and `nvrtc`
  extras; no GPU needed);
- `gpu`: a usable CUDA GPU (not in CI's list: CI has none);
- `nccl`: cupy with NCCL (not in CI's list);
- `model`: the real models read from the model cache, the default model and gemma3-270m (not in
  CI's list: the default model is fetched at session start when there is a network);
- `refs`: the reference outputs in shared/refs beside the checkout (made on the development
  machine; not in CI's list);
- `bench`: llama-cpp-python (the `bench` extra, not installed by CI);
- `graphviz`: Graphviz's `dot`; `cpp`: a C preprocessor; `git`: git and a git checkout;
  `ssh`: an ssh client (MPICH reaches other hosts through it);
- `browser`: headless Chromium for the chat page's tests (chromium and chromedriver on PATH, selenium).
- `lm_eval`: lm-evaluation-harness's local-completions model (tests/serving/test_tokenization.py).
An unknown name is a usage error (a typo must not turn the switch off).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# the workshop scripts (scripts/, not installed) import as `scripts` from the checkout's root
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a failure there is reproducible, never a coin toss);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from metatp.testing.synth import SynthSpec, write_synthetic_gguf  # noqa: E402
from support.prebuild import prebuild  # noqa: E402
from support.require import NAMES, apply_markers, require, required_names  # noqa: E402


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-requests", type=int, default=None,
                     help="requests of the serving soak (tests/serving/test_serving_soak.py; default "
                          "$METATP_SOAK_REQUESTS, else the test's own bound)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "requires(*names, why=...): needs these prerequisites "
                            f"(skip, or fail when METATP_REQUIRE names them): {', '.join(NAMES)}")
    try:
        required_names()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_collection_finish(session) -> None:
    """The compiled libraries the collected tests need, built in parallel before the first test
    (tests/support/prebuild.py); not for --collect-only."""
    if session.items and not session.config.option.collectonly:
        prebuild(session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    apply_markers(item)


@pytest.fixture(scope="session")
def synth_factory(tmp_path_factory):
    """make(spec) -> (path, float32 weights); files are cached per spec within the session."""
    cache: dict[str, tuple[Path, dict]] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(spec: SynthSpec):
        key = repr(spec)
        if key not in cache:
            path = root / f"m{len(cache)}.gguf"
            cache[key] = (path, write_synthetic_gguf(path, spec))
        return cache[key]
    return make


def _module_attr(request, name: str):
    try:
        return getattr(request.module, name)
    except AttributeError:
        raise pytest.UsageError(f"{request.module.__name__} uses a fixture that needs a module-level {name}") from None


@pytest.fixture(scope="module")
def path(request, synth_factory) -> str:
    """The test module's synthetic model (its `SPEC`), as a path string."""
    return str(synth_factory(_module_attr(request, "SPEC"))[0])


@pytest.fixture(scope="module")
def synth_model(path):
    """The test module's synthetic model (its `SPEC`), loaded."""
    from metatp.ir.loader import load_model

    return load_model(path)


@pytest.fixture(scope="module")
def llm(request, path):
    """An LLM on the module's synthetic model: numpy backend, the module's `LLM_OPTIONS` (n_ctx...)."""
    from metatp import LLM

    return LLM(path, backend="numpy", **_module_attr(request, "LLM_OPTIONS"))


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model, fetched once if needed (CI fetches it; the download is ~90 MB); the
    tests that take it skip without a network and a cached copy."""
    from metatp.models import resolve_model

    try:
        return resolve_model(None, quiet=True)
    except Exception as e:  # no network and no cache: the real-model tests cannot run
        require("model", f"default model unavailable: {e}")


@pytest.fixture(scope="module")
def default_llm(default_model):
    """An LLM on the default model: numpy backend, n_ctx 512."""
    from metatp import LLM

    return LLM(str(default_model), n_ctx=512, backend="numpy")


def pytest_sessionstart(session) -> None:
    """Fetch the default model once up front (a fresh CI machine has no cache), so tests that
    look for the cached file run instead of skipping. Without a network they skip."""
    from metatp.models import resolve_model

    try:
        resolve_model(None, quiet=True)
    except Exception:
        pass
