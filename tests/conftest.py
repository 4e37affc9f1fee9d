"""Shared fixtures: synthetic GGUF models and the real default model (when it is cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a failure there is reproducible, never a coin toss);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from metatp.testing.synth import SynthSpec, write_synthetic_gguf  # noqa: E402


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


def default_model_path() -> Path | None:
    """The default model, fetched once if needed (CI fetches it; the download is ~90 MB)."""
    from metatp.models import resolve_model

    try:
        return resolve_model(None, quiet=True)
    except Exception as e:  # no network and no cache: the real-model tests cannot run
        pytest.skip(f"default model unavailable: {e}")


def pytest_sessionstart(session) -> None:
    """Fetch the default model once up front (a fresh CI machine has no cache), so tests that
    look for the cached file run instead of skipping. Without a network they skip."""
    from metatp.models import resolve_model

    try:
        resolve_model(None, quiet=True)
    except Exception:
        pass
