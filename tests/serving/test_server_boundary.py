"""The server goes through the API's public names only (LLM.submit, LLM.prompt_ids,
metatp.api.chat_messages): no attribute or import of the server reaches a private name of the API."""

from __future__ import annotations

import ast
from pathlib import Path

import metatp.server

API_OBJECTS = {"llm", "self.llm", "api"}


def test_the_server_uses_no_private_name_of_the_api():
    found = []
    for path in sorted(Path(metatp.server.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "metatp.api":
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("_")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and ast.unparse(node.value) in API_OBJECTS):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
