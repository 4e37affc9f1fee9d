"""Each fixture has one definition: a fixture several test files need lives in a conftest.py
(tests/conftest.py, or a folder's own), never copied into two files. Read from the source
(every .py under tests/, parsed), so it holds for tests that skip here too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_fixture(decorator: ast.expr) -> bool:
    """`@pytest.fixture`, `@pytest.fixture(...)`, `@fixture` or `@fixture(...)`."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr == "fixture" and isinstance(target.value, ast.Name) and target.value.id == "pytest"
    return isinstance(target, ast.Name) and target.id == "fixture"


def _fixture_name(fn: ast.FunctionDef) -> str:
    """The fixture's name: `name=` in the decorator when given, else the function's."""
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and _is_fixture(d):
            for kw in d.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
    return fn.name


def fixture_definitions(root: Path = TESTS) -> dict[str, list[str]]:
    """{fixture name: ["file:line", ...]} for every fixture defined in a .py file under `root`."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_fixture, node.decorator_list)):
                found[_fixture_name(node)].append(f"{path.relative_to(root)}:{node.lineno}")
    return dict(found)


def test_no_fixture_is_defined_twice():
    defs = fixture_definitions()
    assert "synth_factory" in defs and "path" in defs      # the scan sees the shared fixtures
    twice = {name: where for name, where in defs.items() if len(where) > 1}
    assert not twice, f"fixtures defined more than once (move them to a conftest.py): {twice}"


def test_the_check_sees_a_copied_fixture(tmp_path):
    body = "import pytest\n\n@pytest.fixture(scope='module')\ndef model():\n    return 1\n"
    (tmp_path / "test_a.py").write_text(body)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_b.py").write_text(body.replace("@pytest.fixture(scope='module')", "@pytest.fixture"))
    assert sorted(fixture_definitions(tmp_path)["model"]) == ["sub/test_b.py:4", "test_a.py:4"]
