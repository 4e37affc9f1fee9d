"""What travels to the GPU machine, measured against what one call may carry (64 MiB).

The lent machine has no network: whatever gpu_check and the GPU tests import that its image
lacks travels with the working tree, as wheels in the git-ignored folder `.whl/` (named in the
call's `carry`). The image (see docs/gpu-results.md) has Python 3.12, numpy, networkx, CuPy,
pytest, hypothesis, PyYAML, tqdm, requests and an mpi4py, but no gguf, no MPI library and no
serving stack (fastapi, uvicorn, the openai client).

    python3 scripts/gpu_check/carry.py              # the table: tree + wheels vs the budget
    python3 scripts/gpu_check/carry.py --download   # fetch the wheels not yet in .whl/ (once)
    python3 scripts/gpu_check/carry.py --with llama-cpp   # the same with the llama-cpp section's wheels
    python3 scripts/gpu_check/carry.py --with llama-cpp-src   # ... or its source, built there

Standard library only, so it runs as a file from a bare source tree. Exit status 1 when what
would travel is over the budget or `.whl/` holds two versions of one package.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUDGET_MIB = 64.0
ROOT = Path(__file__).resolve().parent.parent.parent
WHEEL_DIR = ".whl"
PYTHON = "3.12"            # the device image's python3
# pip's platform tags for that machine (x86-64, glibc 2.28 or newer); pip matches them exactly
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


@dataclass(frozen=True)
class Wheel:
    """One wheel to carry; `mib` is its size as measured (2026-12), used until it is downloaded."""

    name: str
    version: str
    why: str
    mib: float
    built_by: str = ""       # not on PyPI as a wheel: the script that builds it into .whl/


WHEELS = (
    Wheel("gguf", "0.19.0", "the GGUF reader and writer: not in the image", 0.11),
    Wheel("pyyaml", "6.0.3", "gguf imports it at once; in the image's list, carried so a change there costs nothing",
          0.77),
    Wheel("mpi4py", "4.1.2", "step 6 and tests/mpi/test_mpi_gpu.py; the version known to load the carried MPICH",
          1.30),
    Wheel("mpich", "5.0.2", "the MPI library and mpiexec (its bin/): the image has none", 12.67),
    Wheel("cuda-bindings", "12.9.10", "the pdl option's cuLaunchKernelEx (the pdl variant, tests/cuda/test_pdl.py): "
          "CuPy cannot set launch attributes; cuda-pathfinder comes with the image's cupy", 7.3),
) + tuple(Wheel(name, version, why, mib) for name, version, mib, why in (
    # the throughput section's `metatp serve` and its official openai client (issue 46): the image has
    # neither; the versions the CPU machine's tests ran with, and everything they need (sizes estimated)
    ("fastapi", "0.165.0", 0.11, "metatp serve"),
    ("starlette", "1.10.0", 0.08, "fastapi"),
    ("annotated-doc", "0.0.7", 0.01, "fastapi"),
    ("opentelemetry-api", "1.45.2", 0.07, "fastapi"),
    ("pydantic", "2.13.4", 0.45, "fastapi, openai"),
    ("pydantic-core", "2.46.4", 2.00, "pydantic (cp312 manylinux)"),
    ("annotated-types", "0.7.0", 0.01, "pydantic"),
    ("typing-inspection", "0.4.2", 0.02, "pydantic, fastapi"),
    ("typing-extensions", "4.16.0", 0.05, "pydantic, openai"),
    ("uvicorn", "0.55.0", 0.07, "metatp serve"),
    ("click", "8.5.1", 0.10, "uvicorn"),
    ("h11", "0.16.0", 0.04, "uvicorn, httpcore2"),
    ("anyio", "4.16.0", 0.11, "starlette, openai"),
    ("sniffio", "1.3.1", 0.01, "openai"),
    ("idna", "3.20", 0.07, "anyio, httpx2"),
    ("openai", "3.3.0", 1.10, "the official client of the serve comparison"),
    ("httpx2", "2.16.2", 0.08, "openai"),
    ("httpcore2", "2.16.2", 0.08, "httpx2"),
    ("truststore", "0.10.5", 0.02, "httpx2"),
    ("jiter", "0.14.0", 0.35, "openai (cp312 manylinux)"),
    ("distro", "1.9.0", 0.02, "openai"),
))
# Carried only for the calls that run them (`--with NAME`): gpu_check's llama-cpp section.
EXTRAS = {
    "llama-cpp": (
        # not built yet: 41 MiB is the estimate from the objects compiled here (docs/gpu-results.md)
        Wheel("llama-cpp-python", "0.3.36", "the llama-cpp section: llama.cpp's CUDA build for sm_90 (no cuBLAS in "
              "it: the image's is used)", 41.0, built_by="scripts/gpu_check/build_llama_cpp.sh wheel"),
        Wheel("diskcache", "5.6.3", "llama_cpp imports it at once: not in the image", 0.04),
    ),
    # or its trimmed source, built on the GPU machine's 16 cores (`build_llama_cpp.sh device`)
    "llama-cpp-src": (
        Wheel("llama-cpp-python-src", "0.3.36", "llama.cpp's trimmed source, built there in one call",
              4.0, built_by="scripts/gpu_check/build_llama_cpp.sh pack"),
        Wheel("diskcache", "5.6.3", "llama_cpp imports it at once: not in the image", 0.04),
    ),
}
# What a call with an extra leaves out of .whl/ to stay under the budget: the llama.cpp wheel (~41 MiB)
# beside every base wheel is ~64.3 MiB, so that call carries no MPI (its `mpi` section is skipped).
LEAVES_OUT = {"llama-cpp": ("mpich", "mpi4py")}
SOURCE_SUFFIX = "-src.tar.gz"     # a source archive in the wheel folder: NAME-VERSION-src.tar.gz


def plan(extras: tuple[str, ...] = ()) -> tuple[Wheel, ...]:
    """The wheels one call carries: the base ones, less what an extra leaves out (`LEAVES_OUT`), and
    those of each extra named (a KeyError names a wrong one)."""
    added = tuple(w for name in extras for w in EXTRAS[name])
    left = {n for name in extras for n in LEAVES_OUT.get(name, ())}
    return tuple(w for w in WHEELS if w.name not in left) + added


@dataclass(frozen=True)
class Item:
    """One row of the measurement: what, bytes, and whether the size is measured or the estimate."""

    what: str
    nbytes: int
    how: str

    @property
    def mib(self) -> float:
        return self.nbytes / 2**20


def tree_files(root: Path = ROOT) -> list[Path]:
    """What the device call sends of the checkout: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return [root / p for p in sorted(set(out.decode().split("\0"))) if p and (root / p).is_file()]


def _norm(name: str) -> str:
    """A distribution name normalised: llama_cpp_python, llama-cpp-python and Llama.Cpp-Python are one."""
    return name.lower().replace("_", "-").replace(".", "-")


def _dist_name(filename: str) -> str:
    """A wheel file's distribution name, normalised (PyYAML-6.0.3-... and pyyaml-6.0.3-... are one)."""
    return _norm(filename.split("-")[0])


def measure(root: Path = ROOT, wheel_dir: Path | None = None,
            wheels: tuple[Wheel, ...] = WHEELS) -> tuple[list[Item], list[str]]:
    """The rows (the tree, then each wheel: measured when present in `wheel_dir`, else its
    estimate, then anything else found there) and the problems (two versions of one package)."""
    wheel_dir = root / WHEEL_DIR if wheel_dir is None else wheel_dir
    files = tree_files(root)
    items = [Item(f"project tree ({len(files)} files)", sum(f.stat().st_size for f in files), "git ls-files")]
    found: dict[str, list[Path]] = {}
    for f in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        found.setdefault(_dist_name(f.name), []).append(f)
    for f in sorted(wheel_dir.glob(f"*{SOURCE_SUFFIX}")) if wheel_dir.is_dir() else []:
        found.setdefault(_dist_name(f.name) + "-src", []).append(f)
    problems = [f"{name}: {len(fs)} wheels in {wheel_dir} ({', '.join(f.name for f in fs)}); keep one"
                for name, fs in found.items() if len(fs) > 1]
    for w in wheels:
        have = found.pop(_norm(w.name), [])
        if have:
            items.append(Item(have[0].name, sum(f.stat().st_size for f in have), "measured"))
        else:
            state = f"not built: {w.built_by}" if w.built_by else "not downloaded"
            items.append(Item(f"{w.name}=={w.version} ({state})", int(w.mib * 2**20), "estimate"))
    for fs in found.values():
        items.extend(Item(f.name, f.stat().st_size, "measured, not in the plan") for f in fs)
    return items, problems


def total_mib(items: list[Item]) -> float:
    return sum(i.nbytes for i in items) / 2**20


def table(items: list[Item], budget_mib: float = BUDGET_MIB) -> str:
    """The measurement as markdown (the format of docs/gpu-results.md's carry section)."""
    lines = ["| item | MiB | size |", "| --- | ---: | --- |"]
    lines += [f"| {i.what} | {i.mib:.2f} | {i.how} |" for i in items]
    total = total_mib(items)
    lines.append(f"| **total** | **{total:.2f}** | of {budget_mib:.0f} MiB ({budget_mib - total:.1f} left) |")
    return "\n".join(lines)


def download(wheel_dir: Path, wheels: tuple[Wheel, ...] = WHEELS) -> None:
    """pip download (no dependencies, binary only, for the device's Python and platform) each
    wheel not already in `wheel_dir`: each is fetched once."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    present = {_dist_name(f.name) for f in wheel_dir.glob("*.whl")}
    for w in wheels:
        if w.built_by and _norm(w.name) not in present:
            print(f"{w.name}=={w.version} is not on PyPI as a wheel: build it with {w.built_by}", file=sys.stderr)
    missing = [f"{w.name}=={w.version}" for w in wheels if _norm(w.name) not in present and not w.built_by]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(wheel_dir),
           *missing]
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="what travels to the GPU machine, against the carry budget")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout that travels (default: this one)")
    ap.add_argument("--wheels", type=Path, default=None, help=f"the wheel folder (default: ROOT/{WHEEL_DIR})")
    ap.add_argument("--download", action="store_true", help="fetch the wheels not yet there first (needs a network)")
    ap.add_argument("--budget", type=float, default=BUDGET_MIB, help="MiB one call may carry in all")
    ap.add_argument("--with", dest="extras", action="append", default=[], choices=sorted(EXTRAS),
                    help="also the wheels of this section (llama-cpp: the llama.cpp build and diskcache; "
                         "llama-cpp-src: its source to build there, and diskcache)")
    args = ap.parse_args(argv)
    wheel_dir = args.wheels or args.root / WHEEL_DIR
    wheels = plan(tuple(args.extras))
    if args.download:
        download(wheel_dir, wheels)
    items, problems = measure(args.root, wheel_dir, wheels)
    print(table(items, args.budget))
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    over = total_mib(items) > args.budget
    if over:
        print(f"over budget: {total_mib(items):.1f} MiB > {args.budget:.0f} MiB", file=sys.stderr)
    return 1 if (over or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
