"""`metatp bench`: llama-bench-shaped rows, field names, formats and the -sm none comparison."""

from __future__ import annotations

import csv
import io
import json

import pytest

from metatp.cli import main
from metatp.tools.bench import BenchConfig, format_rows, run_bench
from metatp.testing.synth import SynthSpec
from support.require import require

FIELDS = {"model_filename", "backend", "n_devices", "split_mode", "tensor_split", "n_prompt", "n_gen", "n_depth",
          "avg_ts", "stddev_ts", "samples_ts", "reductions_per_token", "peak_memory_bytes", "test", "vs_none",
          "allreduce", "allreduce_bytes_per_token"}


def test_rows_carry_llama_bench_fields_and_ratios(synth_factory):
    path, _ = synth_factory(SynthSpec(seed=41))
    cfg = BenchConfig(model=str(path), n_prompt=[8], n_gen=[4], n_depth=[0, 16], repetitions=2, backend="numpy",
                      n_devices=[2], split_mode=["tensor"])
    rows = run_bench(cfg)
    assert {r["test"] for r in rows} == {"pp8", "tg4", "pp8 @ d16", "tg4 @ d16"}
    assert [r["split_mode"] for r in rows].count("none") == 4       # the baseline joins a tensor run
    for r in rows:
        assert FIELDS <= r.keys() and len(r["samples_ts"]) == 2 and r["avg_ts"] > 0
        assert r["reductions_per_token"] == (0 if r["split_mode"] == "none" else 2 * 2)
        # two devices: the butterfly is one exchange of each F32 [n_embd] vector
        assert r["allreduce"] == ("none" if r["split_mode"] == "none" else "butterfly")
        assert r["allreduce_bytes_per_token"] == (0 if r["split_mode"] == "none" else 2 * 2 * 64 * 4)
    base = {r["test"]: r["avg_ts"] for r in rows if r["split_mode"] == "none"}
    for r in rows:
        assert abs(r["vs_none"] - r["avg_ts"] / base[r["test"]]) < 1e-9
    md = format_rows(rows, "md").splitlines()
    assert md[0].startswith("| model |") and len(md) == 2 + len(rows)
    # the MPI_Allreduce columns are mpiexec's (tests/test_mpi_tools.py); in one process they stay out
    assert all(r["allreduce_us_per_call"] is None and r["allreduce_ms_per_token"] is None for r in rows)
    assert "MPI_Allreduce" not in md[0]
    parsed = list(csv.DictReader(io.StringIO(format_rows(rows, "csv"))))
    assert len(parsed) == len(rows) and "avg_ts" in parsed[0]


def test_cli_json_output(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(seed=42))
    rc = main(["bench", "-m", str(path), "-p", "8", "-n", "2", "-r", "1", "--backend", "numpy", "-o", "json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["test"] for r in rows] == ["pp8", "tg2"] and FIELDS <= rows[0].keys()


def test_bad_flags_are_one_line_errors(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(seed=43))
    for argv in (["-r", "0"], ["-p", "x"], ["-sm", "row"]):
        rc = main(["bench", "-m", str(path), *argv])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 1 and len(err) == 1 and err[0].startswith("metatp: error:"), err


class _FakeLlamaCpp:
    """Stands in for llama-cpp-python: records the calls so the interleaving can be checked."""

    calls: list = []

    def __init__(self, model_path: str, n_ctx: int, n_threads: int) -> None:
        self.n_vocab = 300
        _FakeLlamaCpp.calls.append(("init", n_ctx))

    def reset(self) -> None:
        _FakeLlamaCpp.calls.append(("reset",))

    def forward(self, tokens):
        import numpy as np

        _FakeLlamaCpp.calls.append(("forward", len(tokens)))
        return np.zeros(self.n_vocab, np.float32)


def test_compare_rows_interleave_and_carry_ratios(synth_factory, monkeypatch):
    import sys
    import types

    from metatp.tools import llamacpp
    from metatp.tools.bench import slots

    path, _ = synth_factory(SynthSpec(seed=44))
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="fake"))
    monkeypatch.setattr(llamacpp, "LlamaCppEngine", _FakeLlamaCpp)
    order = []
    real_measure = slots.measure
    monkeypatch.setattr(slots, "measure", lambda eng, *a: order.append(type(eng).__name__) or real_measure(eng, *a))
    _FakeLlamaCpp.calls = []
    cfg = BenchConfig(model=str(path), n_prompt=[8], n_gen=[3], repetitions=2, backend="numpy",
                      numerics=["exact", "llamacpp"], compare="llama-cpp", interleave=True)
    rows = run_bench(cfg)
    assert [(r["backend"], r["numerics"], r["test"]) for r in rows] == [
        ("numpy", "exact", "pp8"), ("numpy", "exact", "tg3"), ("numpy", "llamacpp", "pp8"),
        ("numpy", "llamacpp", "tg3"), ("llama.cpp", "llama.cpp", "pp8"), ("llama.cpp", "llama.cpp", "tg3")]
    # every repetition (and the warm-up) visits metatp's setups and then llama.cpp's
    assert order == ["Engine", "Engine", "_FakeLlamaCpp"] * 6
    assert ("forward", 8) in _FakeLlamaCpp.calls
    ref = {r["test"]: r["avg_ts"] for r in rows if r["backend"] == "llama.cpp"}
    for r in rows:
        assert abs(r["vs_llama_cpp"] - r["avg_ts"] / ref[r["test"]]) < 1e-9
        assert (r["vs_none"] is None) == (r["backend"] == "llama.cpp")
    md = format_rows(rows, "md").splitlines()
    assert md[0].endswith("| vs llama.cpp |") and all(line.endswith("x |") for line in md[2:])


def test_compare_without_llama_cpp_is_a_one_line_error(synth_factory, monkeypatch, capsys):
    import sys

    path, _ = synth_factory(SynthSpec(seed=45))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)           # import llama_cpp raises ImportError
    rc = main(["bench", "-m", str(path), "-p", "8", "-n", "0", "-r", "1", "--backend", "numpy",
               "--compare", "llama-cpp"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 1 and len(err) == 1 and "llama-cpp-python" in err[0], err


@pytest.mark.slow
def test_compare_with_the_real_llama_cpp(default_model):
    """The real llama-cpp-python on the default model, when it is installed (skipped otherwise)."""
    require("bench")
    model = str(default_model)
    rows = run_bench(BenchConfig(model=model, n_prompt=[8], n_gen=[2], repetitions=1, backend="numpy",
                                 compare="llama-cpp"))
    assert [r["backend"] for r in rows] == ["numpy", "numpy", "llama.cpp", "llama.cpp"]
    assert all(r["avg_ts"] > 0 and r["vs_llama_cpp"] > 0 for r in rows)
