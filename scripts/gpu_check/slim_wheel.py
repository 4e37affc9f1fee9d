"""Shrink the llama-cpp-python wheel that build_llama_cpp.sh makes, so it can travel in 64 MiB.

A zip has no symlinks, so each library CMake installs as libX.so -> libX.so.0 -> libX.so.0.25.3
lands in the wheel three times, and llama.cpp's own install rules put a second set under a
top-level lib/ (with include/ and CMake files) beside llama_cpp/lib/: six copies of
libggml-cuda.so, the largest file. What runs needs one: the dynamic linker asks for each
library by its soname (libggml.so.0, found through the RUNPATH $ORIGIN), and llama_cpp's ctypes
loads libllama.so and libggml.so by those names. So llama_cpp/lib keeps the soname files and
those two, everything outside llama_cpp/ and the dist-info goes, and RECORD is written anew.

    python3 scripts/gpu_check/slim_wheel.py .whl/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl

Standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

PACKAGE = "llama_cpp"
LOADED_BY_NAME = ("libllama.so", "libggml.so", "libmtmd.so")     # what llama_cpp's ctypes opens
_SONAME = re.compile(r"lib[\w.+-]+?\.so\.\d+$")                   # libggml-cuda.so.0


def keep(name: str) -> bool:
    """Whether the wheel entry `name` is needed at run time."""
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return not name.endswith("/RECORD")          # written anew
    if top != PACKAGE:
        return False                                 # lib/, include/, bin/: the C library's install
    if name.startswith(f"{PACKAGE}/lib/"):
        base = name.rsplit("/", 1)[1]
        return base in LOADED_BY_NAME or bool(_SONAME.fullmatch(base))
    return True


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: Path, dst: Path) -> tuple[int, int]:
    """Write the needed entries of wheel `src` to `dst` with a new RECORD; (bytes before, after)."""
    with zipfile.ZipFile(src) as zin:
        names = [n for n in zin.namelist() if not n.endswith("/")]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{src}: not a wheel (found {len(records)} RECORD files)")
        lines = []
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for name in names:
                if not keep(name):
                    continue
                data = zin.read(name)
                info = zin.getinfo(name)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                lines.append(_record_line(name, data))
            lines.append(f"{records[0]},,")
            zout.writestr(records[0], "\n".join(lines) + "\n")
    return src.stat().st_size, dst.stat().st_size


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: slim_wheel.py WHEEL (rewritten in place)", file=sys.stderr)
        return 2
    src = Path(args[0])
    tmp = src.with_name(src.name + ".slim")
    before, after = slim(src, tmp)
    tmp.replace(src)
    print(f"{src.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
