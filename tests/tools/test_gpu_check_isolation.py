"""`scripts/gpu_check --isolate` (the default on a GPU): each part in a process of its own, so a kernel
fault that poisons one process's CUDA context costs that part's rows, not the run's. The parent
echoes a part's output, reads back the rows it streamed, and turns a part that dies or overruns
into one FAIL row (its exit status and last lines in the report) before starting the next."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from scripts.gpu_check import __main__ as gpu_check_main
from scripts.gpu_check import isolate, kernels
from scripts.gpu_check.__main__ import part_names
from scripts.gpu_check.config import Config
from scripts.gpu_check.isolate import load_rows, run_child
from scripts.gpu_check.report import Report

ROOT = Path(__file__).resolve().parents[2]


def _fake_part(tmp_path: Path, body: str) -> list[str]:
    """A part's command line: a script that streams rows as a part's process does, then `body`."""
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent(f"""
        import argparse, os, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import scripts
        from scripts.gpu_check.isolate import RowSink
        from scripts.gpu_check.report import Report
        ap = argparse.ArgumentParser()
        for flag in ("--rows", "--prior", "--t0-offset"):
            ap.add_argument(flag)
        args = ap.parse_args()
        rep = Report()
        rep.sink = RowSink(Path(args.rows))
        rep.add("speed", "decode 1B Q8_0 KV 128 CUDA graph", "2,345 tok/s", True)
        print("a line before the end", flush=True)
    """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_a_part_that_finishes_gives_its_rows_to_the_parent(tmp_path, capsys):
    rep = Report()
    argv = _fake_part(tmp_path, """
        rep.add("speed", "decode 1B Q8_0 KV 4096 CUDA graph", "1,900 tok/s", True)
        rep.extra.append("### a profile")
        rep.sink.finish(rep)
    """)
    assert run_child(rep, "shapes:1B", "speed", argv, 60, tmp_path) == (True, [])
    assert [r["check"] for r in rep.rows] == ["decode 1B Q8_0 KV 128 CUDA graph", "decode 1B Q8_0 KV 4096 CUDA graph"]
    assert rep.extra == ["### a profile"] and rep.passed
    assert "a line before the end" in capsys.readouterr().out        # the part's output is echoed


def test_a_part_that_dies_is_one_fail_row_with_its_last_lines(tmp_path):
    rep = Report()
    argv = _fake_part(tmp_path, """
        print("CUDARuntimeError: cudaErrorIllegalAddress", flush=True)
        os.abort()
    """)
    assert run_child(rep, "shapes:135M", "speed", argv, 60, tmp_path) == (False, [])
    got = {r["check"]: r for r in rep.rows}
    assert got["decode 1B Q8_0 KV 128 CUDA graph"]["status"] == "pass"        # what it streamed is kept
    fail = got["shapes:135M: its process"]
    assert fail["status"] == "FAIL" and "signal SIGABRT" in fail["result"] and "after 1 rows" in fail["result"]
    assert "cudaErrorIllegalAddress" in rep.details[-1]


def test_a_part_past_its_time_is_killed_with_what_it_started(tmp_path):
    rep = Report()
    argv = _fake_part(tmp_path, """
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # a server it started
        time.sleep(600)
    """)
    assert run_child(rep, "throughput", "throughput", argv, 1.0, tmp_path, grace=1.0) == (False, [])
    fail = rep.rows[-1]
    assert fail["status"] == "FAIL" and fail["result"].startswith("killed after")


def test_a_part_that_wrote_nothing_has_no_rows():
    path = Path(__file__).parent / "__no_such_rows__.jsonl"
    assert load_rows(path) == {"rows": [], "details": [], "kernel_table": [], "extra": [], "resume": [],
                               "done": False}


def test_a_line_torn_by_a_death_is_skipped(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"rows": {"check": "a"}}) + "\n" + '{"rows": {"che', encoding="utf-8")
    got = load_rows(f)
    assert got["rows"] == [{"check": "a"}] and not got["done"]


def test_parts_split_the_model_sizes_only_when_isolated():
    cfg = Config(variants=("default",), shapes=("135M", "1B", "8B"))
    skip = {"llama-cpp", "throughput", "nccl", "mpi"}
    assert part_names(cfg, skip, split_shapes=True) == ["kernels", "model", "shapes:135M", "shapes:1B"]
    assert part_names(cfg, skip, split_shapes=False) == ["kernels", "model", "shapes"]
    cfg.big = True
    assert part_names(cfg, skip | {"kernels", "model", "speed"}, split_shapes=True) == \
        ["shapes:135M", "shapes:1B", "shapes:8B"]


def test_an_isolated_dry_run_runs_its_parts_as_processes(tmp_path):
    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--isolate", "--skip",
                        "kernels,model,speed,profile,shapes,throughput,nccl,mpi", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["parts"]["result"] == "each in a process of its own: llama-cpp"
    assert rows["llama.cpp beside metatp"]["section"] == "llama-cpp"          # the part's row, read back
    assert r.stdout.count("llama.cpp beside metatp") == 2                      # echoed live, then in the table


def test_a_part_can_hand_what_it_left_to_a_fresh_process(tmp_path):
    rep = Report()
    argv = _fake_part(tmp_path, """
        rep.resume("kernels:mmq,attn")
        rep.sink.finish(rep)
    """)
    assert run_child(rep, "kernels", "kernels", argv, 60, tmp_path) == (True, ["kernels:mmq,attn"])


def test_kernel_checks_stop_at_a_lost_context_and_hand_on_the_groups_left(monkeypatch):
    from metatp.testing import kernel_checks as gkc

    lost, ran = [], []

    def check(names, **kw):
        ran.extend(names)
        ok = names != ["qkv_rope_kv"]
        lost.extend([] if ok else names)              # the faulting kernel leaves a sticky error
        return [{"name": f"{names[0]}:case", "dtype": "f32", "shape": "-", "max_rel_err": None if ok else 1.0,
                 "threshold": 1e-5, "pass": ok, "time_us": 1.0, "error": None if ok else "illegal address"}]

    monkeypatch.setattr(gkc, "CHECK_NAMES", ("compile", "matvec", "qkv_rope_kv", "mmq_q8", "attn_decode"))
    monkeypatch.setattr(gkc, "check_all_kernels", check)
    monkeypatch.setattr(kernels, "_precompiled_runtime", lambda rep: None)
    monkeypatch.setattr(isolate, "gpu_answers", lambda cfg: not lost)
    rep, handed = Report(), []
    rep.resume = handed.append
    kernels.section_kernels(rep, Config())
    assert ran == ["compile", "matvec", "qkv_rope_kv"]
    assert handed == ["kernels:mmq_q8,attn_decode"]
    rows = {r["check"]: r["status"] for r in rep.rows}
    assert rows["after qkv_rope_kv"] == "FAIL" and rows["qkv_rope_kv"] == "FAIL" and rows["matvec"] == "pass"
    ran.clear()
    kernels.section_kernels(Report(), Config(), ["mmq_q8", "attn_decode"])       # the fresh process's part
    assert ran == ["mmq_q8", "attn_decode"]


def test_a_shape_stops_at_a_lost_context_and_hands_on_its_variants_left(monkeypatch, tmp_path):
    from scripts.gpu_check import shapes
    from scripts.gpu_check.config import Budget

    lost, ran = [], []

    def one_variant(rep, cfg, budget, shape, spec, model, variant, *rest):
        ran.append(variant.name)
        if variant.name == "before":
            rep.add("speed", f"{shape.label} KV 16 CUDA graph [before]", "CUDARuntimeError: illegal address", False)
            lost.append(variant.name)

    monkeypatch.setattr(shapes, "_one_variant", one_variant)
    monkeypatch.setattr(isolate, "gpu_answers", lambda cfg: not lost)
    cfg = Config.dry_run()
    cfg.variants, cfg.shapes = ("default", "before", "q8"), ("135M", "1B")
    rep, handed = Report(), []
    rep.resume = handed.append
    shapes.section_shapes(rep, cfg, Budget(1e6), tmp_path, only="135M")
    assert ran == ["default", "before"] and handed == ["shapes:135M:q8"]
    assert any(r["check"] == "after decode 135M Q4_1 [before]" and r["status"] == "FAIL" for r in rep.rows)
    ran.clear(), lost.clear()
    again = Report()
    shapes.section_shapes(again, cfg, Budget(1e6), tmp_path, only="135M", resume=("q8",))   # the fresh process
    assert ran == ["q8"]
    assert not any(r["check"].startswith("decode variant") for r in again.rows)   # said once, by the first process


def test_the_parent_runs_a_handed_on_part_next(monkeypatch):
    calls = []

    def fake_child(rep, part, section, argv, seconds, folder, grace=0.0):
        calls.append((part, argv[argv.index("--part") + 1]))
        return True, (["kernels:attn_decode"] if part == "kernels" else [])

    monkeypatch.setattr("scripts.gpu_check.isolate.run_child", fake_child)
    skip = {"speed", "profile", "shapes", "llama-cpp", "throughput", "nccl"}
    from scripts.gpu_check.config import Budget

    gpu_check_main._run_isolated(Report(), Config(), Budget(600), skip, ["--layers", "30"])
    assert [c[0] for c in calls] == ["kernels", "kernels:attn_decode", "model", "mpi"]


def test_a_parent_ended_by_timeout_takes_its_part_and_the_part_s_servers_along(tmp_path):
    """`timeout` ends the run with SIGTERM; a part runs in a session of its own (the device machine keeps
    such processes alive into the next call), so the parent must end it and what it started."""
    import signal
    import time

    part = _fake_part(tmp_path, """
        import subprocess
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("pids", os.getpid(), server.pid, flush=True)
        time.sleep(600)
    """)
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import scripts
        from scripts.gpu_check.isolate import run_child
        from scripts.gpu_check.report import Report
        run_child(Report(), "throughput", "throughput", {part!r}, 600, Path({str(tmp_path)!r}))
    """))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True)
    pids = []
    for line in proc.stdout:
        if line.startswith("pids "):
            pids = [int(p) for p in line.split()[1:]]
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert pids and not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed server whose parent died waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_run_ended_by_timeout_still_writes_its_report(tmp_path):
    """`timeout` sends SIGTERM: the rows so far are written to --out, with a FAIL row saying why it stopped."""
    import signal

    out = tmp_path / "r.md"
    # the emulated model section runs long enough on this machine to be stopped inside it
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--skip",
                             "kernels,speed,profile,shapes,llama-cpp,throughput,nccl,mpi", "--out", str(out)],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    for line in proc.stdout:
        if " env " in line and "gpu:" in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    assert proc.wait(timeout=60) == 1
    rows = {r["check"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["stopped"]["status"] == "FAIL" and "exit status 143" in rows["stopped"]["result"]
    assert rows["gpu"]["section"] == "env"                        # what came before is kept


def test_the_model_part_hands_its_sections_left_to_a_fresh_process(monkeypatch, tmp_path):
    """A fault in the model checks (the q8 variant's logits, say) loses the context: the -sm layer check
    and the speed rows run in the next process, after the model file is written again there."""
    from scripts.gpu_check import config, model, speed

    lost, ran = [], []

    def checks(rep, cfg, loaded, budget):
        ran.append("checks")
        rep.add("model", "logits vs numpy, N=1 [q8]", "CUDARuntimeError: misaligned address", False)
        lost.append(True)

    monkeypatch.setattr(model, "write_model", lambda rep, cfg, folder: ran.append("write") or object())
    monkeypatch.setattr(model, "section_model", checks)
    monkeypatch.setattr(model, "section_layer", lambda *a: ran.append("layer"))
    monkeypatch.setattr(speed, "section_speed", lambda *a: ran.append("speed"))
    monkeypatch.setattr(isolate, "gpu_answers", lambda cfg: not lost)
    rep, handed = Report(), []
    rep.resume = handed.append
    gpu_check_main.run_part("model", rep, Config(), config.Budget(600), set(), tmp_path)
    assert ran == ["write", "checks"] and handed == ["model:layer,speed"]
    assert rep.rows[-1]["check"] == "after model checks" and rep.rows[-1]["status"] == "FAIL"
    ran.clear(), lost.clear()
    gpu_check_main.run_part("model:layer,speed", Report(), Config(), config.Budget(600), set(), tmp_path)
    assert ran == ["write", "layer", "speed"]
    ran.clear()
    monkeypatch.setattr(model, "section_model", lambda *a: ran.append("checks"))
    gpu_check_main.run_part("model", Report(), Config(), config.Budget(600), {"speed"}, tmp_path)
    assert ran == ["write", "checks", "layer"]                 # nothing lost: every section, `skip` obeyed


def test_the_throughput_part_hands_its_parts_left_to_a_fresh_process(monkeypatch, tmp_path):
    from scripts.gpu_check import throughput
    from scripts.gpu_check.config import Budget

    lost, ran = [], []

    def bench(rep, *a):
        ran.append("bench")
        rep.add("throughput", "batched-bench 1B Q8_0 PP 128 TG 32 B=256", "CUDARuntimeError: illegal address", False)
        lost.append(True)
        return {}

    monkeypatch.setattr(throughput, "_model_file", lambda cfg, shape, folder: tmp_path / "m.gguf")
    monkeypatch.setattr(throughput, "_crossover_rows", lambda *a: ran.append("crossover") or {})
    monkeypatch.setattr(throughput, "_bench_rows", bench)
    monkeypatch.setattr(throughput, "_tuned_rows", lambda *a: ran.append("tuned"))
    monkeypatch.setattr(throughput, "_invariant_rows", lambda *a: ran.append("invariant"))
    monkeypatch.setattr(throughput, "_prompt_rows", lambda *a: ran.append("prompts"))
    monkeypatch.setattr(throughput, "_serve_rows", lambda *a: ran.append("serve"))
    monkeypatch.setattr(throughput, "_free_device_memory", lambda cfg: None)
    monkeypatch.setattr(isolate, "gpu_answers", lambda cfg: not lost)
    rep, handed = Report(), []
    rep.resume = handed.append
    throughput.section_throughput(rep, Config(), Budget(600), tmp_path)
    assert ran == ["crossover", "bench"] and handed == ["throughput:tuned,invariant,prompts,serve,8B"]
    ran.clear(), lost.clear()
    again = Report()
    throughput.section_throughput(again, Config(), Budget(600), tmp_path, ("invariant", "prompts", "serve", "8B"))
    assert ran == ["invariant", "prompts", "serve"]
    assert again.rows[-1]["result"] == "not run (needs --big)"
