"""`metatp bench`: llama-bench-shaped rows, field names, formats and the -sm none comparison."""

from __future__ import annotations

import csv
import io
import json

from metatp.cli import main
from metatp.tools.bench import BenchConfig, format_rows, run_bench
from metatp.tools.synth import SynthSpec

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
