"""`metatp bench` and `metatp dump` under a real `mpiexec -n 2` (loopback, oversubscribed on 2 cores).

bench: the same rows as in one process (the -sm none baseline runs on rank 0 alone), one table
printed by rank 0, and the tensor-parallel rows carry the MPI_Allreduce time per call and per
token. dump: printed once, by rank 0, and the same text as the single-process dump of the same
layout. A --devices that disagrees with the world size is one error line, printed once.

Skips with a reason where mpi4py or mpiexec is missing (`pip install "metatp[mpi]"`).
"""

from __future__ import annotations

import json

import pytest

from support.require import requires
from support.mpi import check_ok, cli, error_lines
from metatp.testing.synth import SynthSpec
from metatp.tools.bench import MPI_COLUMNS, BenchConfig, run_bench

SYNTH = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=3,
                  types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})


pytestmark = requires("mpi")


def _md_table(text: str) -> list[dict]:
    """The rows of the one markdown table in `text` (asserting there is exactly one header)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert sum(line.startswith("| model |") for line in lines) == 1, text
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


BENCH = ["-p", "8", "-n", "4", "-r", "2", "--backend", "numpy"]


def test_bench_under_mpiexec_has_the_in_process_rows_and_allreduce_times(synth_factory):
    path, _ = synth_factory(SYNTH)
    r = cli("bench", "-m", str(path), *BENCH, "-sm", "tensor", n=2)
    check_ok(r)
    rows = _md_table(r.stdout)
    want = run_bench(BenchConfig(model=str(path), n_prompt=[8], n_gen=[4], repetitions=1, backend="numpy",
                                 n_devices=[2], split_mode=["tensor"]))
    assert [(row["devices"], row["sm"], row["test"]) for row in rows] == \
        [(str(w["n_devices"]), w["split_mode"], w["test"]) for w in want]
    for row in rows:
        assert float(row["t/s"].split("±")[0]) > 0
        if row["sm"] == "tensor":
            assert row["reductions/tok"] == "4"
            assert all(float(row[c]) > 0 for c in MPI_COLUMNS), row
        else:
            assert all(row[c] == "" for c in MPI_COLUMNS), row
    # progress lines come from rank 0 only: one per row
    assert sum(line.startswith("  tensor x2 tg4:") for line in r.stderr.splitlines()) == 1, r.stderr


def test_bench_under_mpiexec_json_with_tensor_split_and_interleave(synth_factory):
    """An explicit --devices equal to the world size is accepted; -ts and --interleave work
    across processes (the baseline on rank 0 alternates with the 2-rank layout)."""
    path, _ = synth_factory(SYNTH)
    r = cli("bench", "-m", str(path), *BENCH, "--devices", "2", "-sm", "none,tensor", "-ts", "3/1",
             "--interleave", "-o", "json", n=2)
    check_ok(r)
    rows = json.loads(r.stdout)
    assert [(x["n_devices"], x["split_mode"], x["tensor_split"], x["test"]) for x in rows] == [
        (1, "none", "", "pp8"), (1, "none", "", "tg4"), (2, "tensor", "3/1", "pp8"), (2, "tensor", "3/1", "tg4")]
    for x in rows:
        assert len(x["samples_ts"]) == 2 and x["vs_none"] > 0
        if x["split_mode"] == "tensor":
            assert x["allreduce"] == "mpi" and x["allreduce_bytes_per_token"] == 2 * 2 * 64 * 4
            assert x["allreduce_us_per_call"] > 0 and x["allreduce_ms_per_token"] > 0
        else:
            assert x["allreduce_us_per_call"] is None and x["allreduce_ms_per_token"] is None


@pytest.mark.parametrize("flags, message", [
    (["--devices", "3"], "--devices 3 but mpiexec started 2 processes"),
    (["-ts", "1/2/1"], "-ts has 3 shares but mpiexec started 2 processes"),
    (["-sm", "none"], "under mpiexec bench measures -sm tensor"),
], ids=["devices", "tensor-split", "split-mode"])
def test_bench_layout_that_disagrees_with_the_world_is_one_line(synth_factory, flags, message):
    path, _ = synth_factory(SYNTH)
    r = cli("bench", "-m", str(path), *BENCH, *flags, n=2, timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "|" not in r.stdout


@pytest.mark.parametrize("flags", [[], ["-ts", "3,1"], ["--phase", "prefill", "--format", "json"]],
                         ids=["even", "ts-3,1", "prefill-json"])
def test_dump_under_mpiexec_prints_once_what_one_process_prints(synth_factory, flags):
    path, _ = synth_factory(SYNTH)
    one = cli("dump", "-m", str(path), "--devices", "2", *flags)
    check_ok(one)
    two = cli("dump", "-m", str(path), *flags, n=2)
    check_ok(two)
    assert two.stdout == one.stdout and one.stdout.strip()
    assert two.stderr == ""


def test_dump_devices_that_disagree_with_the_world_is_one_line(synth_factory):
    path, _ = synth_factory(SYNTH)
    r = cli("dump", "-m", str(path), "--devices", "3", n=2, timeout=60)
    assert r.returncode != 0 and r.stdout == ""
    lines = error_lines(r)
    assert len(lines) == 1 and "--devices 3 but mpiexec started 2 processes" in lines[0], r.stderr
