"""The server goes through the API's public names only (LLM.submit, LLM.prompt_ids,
LLM.tokenizer): no attribute or import of the server reaches a private name of the API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import metatp.server
from metatp.testing.synth import SynthSpec
from support.require import requires

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=33, default_type="Q8_0")

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


@requires("serve")
def test_serving_an_llm_keeps_its_own_limits(path):
    """`LLM(max_num_seqs=32)` served stays 32 (the server once rewrote the scheduler's limits to
    its own --parallel); the per-request cap defaults to n_ctx // max_num_seqs."""
    from metatp import LLM
    from metatp.server import create_app

    llm = LLM(path, n_ctx=256, backend="numpy", max_num_seqs=32, max_waiting=3)
    create_app(llm)
    assert (llm.scheduler.max_num_seqs, llm.scheduler.max_waiting) == (32, 3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_max_waiting_is_a_config_error(path, bad):
    from metatp import LLM
    from metatp.ir.errors import ConfigError

    with pytest.raises(ConfigError, match="max_waiting"):
        LLM(path, n_ctx=64, backend="numpy", max_waiting=bad)


def test_the_openai_shapes_are_written_once():
    """Every OpenAI response object ("text_completion", "chat.completion", its chunks) is built in
    metatp/openai_api.py, which the Python completions and the HTTP routes share."""
    root = Path(metatp.server.__file__).parent.parent
    shapes = {"text_completion", "chat.completion", "chat.completion.chunk"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "openai_api.py" or "testing" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in shapes:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert not found, found
