"""The wheel is the product: `pip install .` ships neither `metatp.testing` (test support) nor
`scripts/` (the workshop), every shipped `metatp.tools` module imports without them, and the chat
page's files (metatp/server/static/) are in it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from metatp.server.chat_page import PAGE_FILES

ROOT = Path(__file__).resolve().parents[2]
WORKSHOP = ("metatp/testing/", "scripts/")


def _config() -> dict:
    try:
        import tomllib
    except ImportError:            # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _can_build_offline() -> str | None:
    """Why a wheel cannot be built here without a network, or None: pip without build isolation
    needs setuptools >= 69 (pyproject's build requirement) and its bdist_wheel (built in from
    setuptools 70.1, else the `wheel` package)."""
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed"
    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    if version < (69,):
        return f"setuptools {setuptools.__version__} is older than the build's setuptools>=69"
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:
        return "the wheel package is not installed (setuptools < 70.1 needs it for bdist_wheel)"
    return None


def test_configured_packages_leave_the_workshop_out():
    """What setuptools is told to ship: no metatp.testing, no scripts; every listed package exists."""
    packages = _config()["packages"]
    dirs = _config()["package-dir"]
    assert not [p for p in packages if p.startswith("metatp.testing") or p.split(".")[0] == "scripts"]
    for name in packages:
        top = max((k for k in dirs if name == k or name.startswith(k + ".")), key=len)
        folder = ROOT / dirs[top] / Path(*name[len(top):].split(".")[1:]) if name != top else ROOT / dirs[top]
        assert (folder / "__init__.py").is_file() or name == "metatp.cuda", name
    # every Python package below the mapped folders is listed (or deliberately left out)
    listed = set(packages)
    for top, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([top, *rel.parts]) if rel.parts else top
            if not name.startswith("metatp.testing") and "__pycache__" not in rel.parts:
                assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is not in pyproject's packages"


def test_the_wheel_holds_no_workshop_file(tmp_path):
    why = _can_build_offline()
    if why:
        pytest.skip(f"cannot build the wheel offline: {why}")
    src = tmp_path / "src"                 # a copy: the build writes build/ and egg-info, and stale ones leak in
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                             ".whl", ".hypothesis", ".pytest_cache", "*.gguf",
                                                             "test-artifacts"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("metatp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("metatp/tools/") and n.endswith(".py")]      # the product is there
    assert "metatp/cli_args.py" in names and [n for n in names if n.startswith("metatp/cuda/") and n.endswith(".cu")]
    assert not [n for n in names if n.startswith(WORKSHOP)]
    # the chat page (metatp.server.chat_page): every file of static/, and every file the page is made of
    page = {f"metatp/server/static/{f.name}" for f in (ROOT / "metatp" / "server" / "static").iterdir() if f.is_file()}
    assert page >= {f"metatp/server/static/{name}" for name in PAGE_FILES} and page <= set(names), sorted(page - set(names))


def test_shipped_tools_import_without_the_workshop():
    """Each module of metatp.tools (and the command) imports with metatp.testing and scripts blocked."""
    modules = sorted({"metatp.tools." + ".".join(p.relative_to(ROOT / "tools").with_suffix("").parts)
                      .removesuffix(".__init__") for p in (ROOT / "tools").rglob("*.py")} | {"metatp.cli"})
    code = f"""
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "scripts" or name.startswith(("scripts.", "metatp.testing")):
            raise ImportError(f"{{name}} is not shipped")

sys.meta_path.insert(0, Blocked())
for m in {modules!r}:
    importlib.import_module(m)
print(len({modules!r}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout) == len(modules) > 10
