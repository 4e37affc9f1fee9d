"""No import cycle among the shipped modules.

A plain import graph is blind here: the package-dir mapping in pyproject.toml puts
`metatp.ir` in ir/, `metatp.backends` in backends/ ..., so a tool that resolves `metatp.ir`
to metatp/ir/ sees no edge between the folders. This graph resolves the mapping, and counts
every import a module can make: at module level and inside functions (lazy imports run too),
`from pkg import sub` where `sub` is a submodule; only `if TYPE_CHECKING:` blocks are left out
(they never run). Shipped = the packages of [tool.setuptools] packages, minus `metatp.testing`.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("metatp.testing",)


def package_dirs(root: Path) -> dict[str, Path]:
    """Every listed package -> its folder, through [tool.setuptools.package-dir] (longest prefix wins)."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = cfg.get("package-dir", {})
    out: dict[str, Path] = {}
    for pkg in cfg["packages"]:
        parts = pkg.split(".")
        for n in range(len(parts), -1, -1):
            prefix = ".".join(parts[:n])
            if prefix in mapping or n == 0:
                base = mapping.get(prefix, "")
                out[pkg] = root.joinpath(base, *parts[n:])
                break
    return out


def shipped_modules(root: Path, exclude: tuple[str, ...] = NOT_SHIPPED) -> dict[str, Path]:
    """Module name -> file, for every .py file directly inside a shipped package's folder."""
    modules: dict[str, Path] = {}
    for pkg, folder in package_dirs(root).items():
        if any(pkg == e or pkg.startswith(e + ".") for e in exclude):
            continue
        for f in sorted(folder.glob("*.py")):
            modules[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node that can run (TYPE_CHECKING-only branches skipped)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _deepest_known(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def import_graph(modules: dict[str, Path]) -> nx.DiGraph:
    """module -> the shipped modules it imports (anywhere in its body)."""
    known = set(modules)
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in modules.items():
        is_pkg = path.stem == "__init__"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(filter(None, (_deepest_known(a.name, known) for a in node.names)))
                continue
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                base_parts = here[:len(here) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in known else _deepest_known(base, known)
                if target is not None:
                    targets.add(target)
        g.add_edges_from((name, t) for t in targets if t != name)
    return g


def cycles(g: nx.DiGraph, limit: int = 200) -> list[list[str]]:
    """The simple cycles of every strongly connected component (at most `limit` in all)."""
    out: list[list[str]] = []
    for scc in nx.strongly_connected_components(g):
        if len(scc) < 2:
            continue
        for c in nx.simple_cycles(g.subgraph(scc)):
            out.append(c)
            if len(out) >= limit:
                return out
    return out


def test_the_mapping_is_resolved():
    mods = shipped_modules(ROOT)
    assert mods["metatp.ir.graph"] == ROOT / "ir" / "graph.py"
    assert mods["metatp.passes.plan"] == ROOT / "passes" / "plan.py"
    assert mods["metatp.backends.cuda.nccl"] == ROOT / "backends" / "cuda" / "nccl.py"
    assert mods["metatp.engine"] == ROOT / "metatp" / "engine.py"
    assert not any(m.startswith("metatp.testing") for m in mods)
    g = import_graph(mods)
    assert g.has_edge("metatp.backends.base", "metatp.passes.plan")     # across folders


def test_no_import_cycle_among_shipped_modules():
    found = cycles(import_graph(shipped_modules(ROOT)))
    assert not found, "import cycles among shipped modules:\n" + "\n".join(
        " -> ".join(c + [c[0]]) for c in sorted(found, key=lambda c: (len(c), c)))


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["top", "top.low", "top.testing"]\n'
        '[tool.setuptools.package-dir]\n"top" = "top"\n"top.low" = "low"\n"top.testing" = "top/testing"\n')
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("a_imports", [
    "from top.low import b\n",                            # from pkg import submodule
    "def f():\n    import top.low.b\n",                   # a lazy import
    "from .low import b\n",                               # relative, resolved through the mapping
])
def test_a_cycle_across_mapped_folders_is_found(tmp_path, a_imports):
    root = _project(tmp_path, {"top/__init__.py": "", "top/a.py": a_imports, "low/__init__.py": "",
                               "low/b.py": "from top.a import x\n", "top/testing/__init__.py": ""})
    assert cycles(import_graph(shipped_modules(root, exclude=("top.testing",)))) in ([["top.a", "top.low.b"]], [["top.low.b", "top.a"]])


def test_type_checking_imports_and_unshipped_packages_do_not_count(tmp_path):
    root = _project(tmp_path, {
        "top/__init__.py": "", "low/__init__.py": "",
        "top/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from top.low import b\n",
        "low/b.py": "from top.a import x\nfrom top.testing import t\n",
        "top/testing/__init__.py": "", "top/testing/t.py": "import top.low.b\n"})
    mods = shipped_modules(root, exclude=("top.testing",))
    assert "top.testing.t" not in mods and "top.low.b" in mods
    assert cycles(import_graph(mods)) == []
