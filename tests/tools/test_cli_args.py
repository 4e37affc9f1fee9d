"""metatp.cli_args: the argument builders every subcommand shares, vLLM's -tp / -pp spellings
wherever --tp / --pp exist, and no tool importing the `metatp` command itself (no cli <-> tools cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from metatp import cli
from metatp.cli_args import layout_kwargs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cmd", [["generate", "-p", "x"], ["serve"], ["batched-bench"], ["dump"],
                                 ["pipeline-bench"], ["bench"]])
@pytest.mark.parametrize("spelling", [("--pp", "--tp"), ("-pp", "-tp"),
                                      ("--pipeline-parallel-size", "--tensor-parallel-size")])
def test_vllm_spellings_are_aliases(cmd, spelling):
    pp, tp = spelling
    args = cli._build_parser().parse_args([*cmd, "-sm", "layer,tensor", pp, "2", tp, "3"])
    assert (args.pp, args.tp) == (2, 3)


@pytest.mark.parametrize("pp, tp", [("-pp", "-tp"), ("--pipeline-parallel-size", "--tensor-parallel-size")])
def test_serve_aliases_give_the_same_layout(pp, tp):
    ours = cli._build_parser().parse_args(["serve", "-sm", "layer,tensor", "--pp", "2", "--tp", "2", "-ts", "1,3"])
    vllm = cli._build_parser().parse_args(["serve", "-sm", "layer,tensor", pp, "2", tp, "2", "-ts", "1,3"])
    assert layout_kwargs(vllm) == layout_kwargs(ours)
    assert layout_kwargs(vllm)["n_devices"] == 4 and layout_kwargs(vllm)["tensor_split"] == (1.0, 3.0)


def test_the_cli_still_names_the_builders():
    """Callers of metatp.cli's builders keep working: they are cli_args' own functions."""
    from metatp import cli_args

    for name in ("add_model_args", "add_layout_args", "add_split_args", "layout_kwargs", "stage_layout"):
        assert getattr(cli, name) is getattr(cli_args, name)


def test_no_tool_imports_the_cli():
    """tools/ imports the builders from metatp.cli_args; importing metatp.cli there would be a cycle."""
    offenders = []
    for f in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{f.relative_to(ROOT)}: {n}" for n in names if n == "metatp.cli"]
    assert not offenders


def test_a_tools_main_runs_without_loading_the_cli():
    """batched-bench's own `main` parses and reports a bad flag on one line, and metatp.cli stays unloaded."""
    code = ("import sys\nfrom metatp.tools import batched_bench, pipeline_bench\n"
            "rc = (batched_bench.main(['-npl', '1', '--frobnicate']), pipeline_bench.main(['--help']))\n"
            "assert 'metatp.cli' not in sys.modules, 'metatp.cli was imported'\nprint(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "(2, 0)"
    # as `metatp batched-bench` says it
    assert r.stderr == "metatp: error: unrecognized arguments: --frobnicate (see --help)\n"
