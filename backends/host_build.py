"""Compile C/C++ source text into a shared library once and cache it by content.

Used by the CPU kernels of the numpy backend and by the CUDA-kernel emulator: both ship source
with the package and build it on first use with the machine's own compiler, so nothing binary
is committed and the build matches the CPU it runs on.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

__all__ = ["build_shared_library", "host_cache_dir"]


def host_cache_dir(env_var: str, prefix: str) -> Path:
    """$env_var if set, else a per-user folder in the temp directory."""
    d = os.environ.get(env_var)
    path = Path(d) if d else Path(tempfile.gettempdir()) / f"{prefix}-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _folder_digest(folder: Path) -> str:
    """A hash of every file in `folder` (names and bytes): what `#include "..."` may read from it."""
    h = hashlib.sha1()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def build_shared_library(name: str, source: str, suffix: str, compiler: str, flags: Sequence[str],
                         cache: Path, salt: str = "", libs: Sequence[str] = (),
                         include_dir: Path | None = None, compile_flags: Sequence[str] = ()) -> Path:
    """The path of `name-<hash>.so` built from `source` (a `suffix` file) with `compiler flags`
    (`libs` go after the source, where the linker looks for them).

    The hash covers the source, compiler, flags and `salt` (e.g. the CPU model when building
    with -march=native), so a change of any of them builds anew. With `include_dir` the source
    may `#include "..."` the files of that folder (it is passed as -I) and the hash covers every
    file in it too, so a change in any of them also builds anew. `compile_flags` apply to compiling
    alone: with any, the source is compiled to an object (`-c`) first and linked without them (an
    instrumentation such as -fsanitize=alignment whose handlers the source defines itself, so its
    runtime library is not linked). Concurrent builders are safe:
    each writes in its own temporary folder and renames atomically. Raises RuntimeError with the
    compiler's message on failure."""
    parts = [source, compiler, *flags, salt, *libs, *compile_flags]
    if include_dir is not None:
        parts.append(_folder_digest(include_dir))
    digest = hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]
    out = cache / f"{name}-{digest}.so"
    if out.is_file():
        return out
    include = ["-I", str(include_dir)] if include_dir is not None else []
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / f"{name}{suffix}"
        src.write_text(source, encoding="utf-8")
        so = Path(tmp) / out.name
        if compile_flags:
            obj = Path(tmp) / f"{name}.o"
            _run_compiler(name, suffix, [compiler, *flags, *compile_flags, *include, "-c", "-o", str(obj), str(src)])
            _run_compiler(name, suffix, [compiler, *flags, "-o", str(so), str(obj), *libs])
        else:
            _run_compiler(name, suffix, [compiler, *flags, *include, "-o", str(so), str(src), *libs])
        os.replace(so, out)
    return out


def _run_compiler(name: str, suffix: str, cmd: list[str]) -> None:
    """One compiler call; RuntimeError with its message when it fails."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"building {name}{suffix} with {cmd[0]} failed: {e}") from None
    if r.returncode != 0:
        raise RuntimeError(f"building {name}{suffix} with {cmd[0]} failed:\n{r.stderr[-4000:]}")
