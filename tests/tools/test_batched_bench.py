"""`metatp batched-bench --compare llama-cpp`: llama.cpp's rows beside metatp's, with ratios; a
comparison that cannot run (not installed, the child killed by a signal) is one line on stderr
and metatp's rows still come. No speed is asserted."""

from __future__ import annotations

import json

from metatp.cli import main
from metatp.testing.synth import SynthSpec
from metatp.tools import batched_bench, llamacpp
from support.llamacpp_child import crashing_child
from support.require import requires

SPEC = SynthSpec(seed=46)

ARGS = ["--backend", "numpy", "-npp", "8", "-ntg", "3", "-npl", "1,3"]


def _rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("metatp:")]


@requires("bench")
def test_compare_rows_carry_ratios(path, capsys):
    # B=3 prompts of 100: 300 tokens, over the n_ctx (256) of the context llama-cpp-python loads with
    assert main(["batched-bench", "-m", path, *ARGS, "-npp", "100", "-r", "2", "--compare", "llama-cpp",
                 "-o", "jsonl"]) == 0
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert [(r["program"], r["b"]) for r in rows] == [("metatp", 1), ("llama.cpp", 1), ("metatp", 3), ("llama.cpp", 3)]
    assert _warnings(captured.err) == []
    for ours, ref in zip(rows[::2], rows[1::2]):
        assert (ref["pp"], ref["tg"], ref["n_kv"]) == (ours["pp"], ours["tg"], ours["n_kv"])
        assert ref["s_pp"] > 0 and ref["s_tg"] > 0 and ref["vs_llama_cpp_s_tg"] is None
        assert abs(ours["vs_llama_cpp_s_pp"] - ours["s_pp"] / ref["s_pp"]) < 1e-9 * ours["vs_llama_cpp_s_pp"]
        assert abs(ours["vs_llama_cpp_s_tg"] - ours["s_tg"] / ref["s_tg"]) < 1e-9 * ours["vs_llama_cpp_s_tg"]


@requires("bench")
def test_compare_table_has_the_ratio_columns(path, capsys):
    assert main(["batched-bench", "-m", path, *ARGS, "--compare", "llama-cpp"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| program ") and lines[0].endswith("| S_TG vs llama.cpp |")
    body = lines[2:]
    assert [line.split("|")[1].strip() for line in body] == ["metatp", "llama.cpp"] * 2
    assert all(line.endswith("x |") for line in body[::2]) and all(line.endswith("- |") for line in body[1::2])


@requires("bench")
def test_a_child_killed_by_sigill_is_one_line_and_metatps_rows_stay(path, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp.LlamaCppChild, "target", staticmethod(crashing_child))
    assert main(["batched-bench", "-m", path, *ARGS, "--compare", "llama-cpp", "-o", "jsonl"]) == 0
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert [(r["program"], r["b"]) for r in rows] == [("metatp", 1), ("metatp", 3)]
    assert all(r["vs_llama_cpp_s_tg"] is None and r["s_tg"] > 0 for r in rows)
    warnings = _warnings(captured.err)
    assert len(warnings) == 1, warnings
    assert "SIGILL" in warnings[0] and "-mno-amx-tile" in warnings[0] and "metatp's rows follow" in warnings[0]


def test_without_llama_cpp_the_table_is_metatps_after_one_line(path, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert main(["batched-bench", "-m", path, *ARGS, "--compare", "llama-cpp"]) == 0
    captured = capsys.readouterr()
    warnings = _warnings(captured.err)
    assert len(warnings) == 1 and "llama-cpp-python" in warnings[0], warnings
    table = [line for line in captured.out.splitlines() if line.startswith("|")]
    assert table[0].startswith("|    PP |") and len(table) == 2 + 2     # metatp's two rows, no compare columns


class _FakeChild:
    """Stands in for the llama.cpp child: records when it runs, relative to metatp's runs."""

    version = "fake"

    def __init__(self, model_path: str, n_threads: int, n_batch: int) -> None:
        _FakeChild.made = (n_threads, n_batch)

    def timed(self, pp: int, tg: int, b: int, seed: int = 0) -> tuple[float, float]:
        _FakeChild.order.append(("llama.cpp", b))
        return 0.5, 0.25

    def close(self) -> None:
        _FakeChild.order.append(("closed",))


def test_llama_cpp_runs_interleave_with_metatps(path, capsys, monkeypatch):
    real_timed = batched_bench._timed
    _FakeChild.order = []
    monkeypatch.setattr(llamacpp, "LlamaCppChild", _FakeChild)
    monkeypatch.setattr(batched_bench, "_timed",
                        lambda eng, pp, tg, b, rng: _FakeChild.order.append(("metatp", b)) or real_timed(eng, pp, tg, b, rng))
    assert main(["batched-bench", "-m", path, *ARGS, "-r", "2", "-t", "1", "--compare", "llama-cpp",
                 "-o", "jsonl"]) == 0
    # per configuration: warm-up, then two repetitions, each metatp's run then llama.cpp's
    assert _FakeChild.order == [("metatp", 1), ("llama.cpp", 1)] * 3 + [("metatp", 3), ("llama.cpp", 3)] * 3 + [("closed",)]
    assert _FakeChild.made == (1, 512)                     # metatp's kernel threads, its n_batch
    ref = [r for r in _rows(capsys.readouterr().out) if r["program"] == "llama.cpp"]
    assert [(r["b"], r["t_pp"], r["t_tg"], r["s_tg"]) for r in ref] == [(1, 0.5, 0.25, 12.0), (3, 0.5, 0.25, 36.0)]


def test_numerics_reach_the_backend(path, capsys):
    """`--numerics q8` runs the rows on the integer kernels (the header reads the backend's own setting)."""
    assert main(["batched-bench", "-m", path, *ARGS, "--numerics", "q8"]) == 0
    out = capsys.readouterr().out
    assert ", numerics q8," in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("|")][2:]      # past the header and rule
    assert len(rows) == 2 and all(float(line.split("|")[8]) > 0 for line in rows)  # B=1 and B=3, S_TG > 0
