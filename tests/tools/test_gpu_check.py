"""scripts/gpu_check: it runs as a folder from a bare source tree, and what it carries to the GPU
machine (the tree plus the wheels) fits the 64 MiB one call may carry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_check import carry
from support.require import requires

ROOT = Path(__file__).resolve().parents[2]
needs_git = requires("git")


def test_runs_as_a_folder():
    """`python3 scripts/gpu_check --help` (the documented call on the GPU machine) starts: the
    folder's __main__ maps the source tree before its first metatp import."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--help"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr
    assert "--emulate" in r.stdout and "--budget" in r.stdout


def test_pytest_runs_through_the_folder():
    """`python3 scripts/gpu_check --pytest ...` (how the GPU machine runs tests/cuda): the folder's
    own profile.py must not shadow the standard library's, which pytest imports."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--pytest", "-q", "--collect-only",
                        "-p", "no:cacheprovider", str(Path(__file__))], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_pytest_runs_through_the_folder" in r.stdout


def test_scripts_map_metatp_onto_a_bare_tree():
    """With no install at all (`python -S`: no .pth, so no editable finder; the dependencies on
    PYTHONPATH), `import scripts` maps metatp onto this tree's folders, as on the GPU machine."""
    import numpy

    deps = str(Path(numpy.__file__).resolve().parent.parent)
    code = "import scripts, metatp.backends, metatp.tools.dump; print(metatp.backends.__file__)"
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=deps))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(ROOT / "backends" / "__init__.py")
    r = subprocess.run([sys.executable, "-S", "-c", "import metatp.backends"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=deps))
    assert r.returncode != 0          # the check can fail: without `import scripts` the tree is not importable


def test_source_tree_finder_maps_the_package_dirs():
    """Without an install, `metatp.tools` etc. resolve to the tree's folders (pyproject's package-dir)."""
    from scripts._source_tree import PACKAGE_DIRS, SourceTreeFinder

    finder = SourceTreeFinder(ROOT)
    for name, folder in PACKAGE_DIRS.items():
        spec = finder.find_spec(name)
        assert spec.submodule_search_locations == [str(ROOT / folder)], name
    assert finder.find_spec("metatp.tools.dump") is None       # found below the mapped folder as usual
    text = (ROOT / "pyproject.toml").read_text()
    assert all(f'"{name}" = "{folder}"' in text for name, folder in PACKAGE_DIRS.items())


@needs_git
def test_carry_plan_fits_the_budget_on_this_tree(tmp_path):
    """The real tree plus every planned wheel (at its measured size) fits 64 MiB with room left."""
    items, problems = carry.measure(ROOT, tmp_path)
    assert not problems
    tree = items[0]
    files = carry.tree_files(ROOT)
    assert tree.nbytes == sum(f.stat().st_size for f in files) and len(files) > 50
    assert [i.how for i in items[1:]] == ["estimate"] * len(carry.WHEELS)
    assert carry.total_mib(items) == pytest.approx(tree.mib + sum(w.mib for w in carry.WHEELS), abs=1e-3)
    assert carry.total_mib(items) < carry.BUDGET_MIB - 16       # headroom: the tree may grow
    assert carry.main(["--root", str(ROOT), "--wheels", str(tmp_path)]) == 0


@needs_git
def test_carry_counts_the_wheels_there_and_refuses_two_versions(tmp_path, capsys):
    (tmp_path / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"x" * 2**20)
    (tmp_path / "extra-1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    items, problems = carry.measure(ROOT, tmp_path)
    by_name = {i.what: i for i in items}
    assert by_name["gguf-0.19.0-py3-none-any.whl"].nbytes == 2**20
    assert by_name["gguf-0.19.0-py3-none-any.whl"].how == "measured"
    assert by_name["extra-1.0-py3-none-any.whl"].how == "measured, not in the plan"
    assert not problems
    (tmp_path / "PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "pyyaml-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    _, problems = carry.measure(ROOT, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("pyyaml: 2 wheels")
    assert carry.main(["--root", str(ROOT), "--wheels", str(tmp_path)]) == 1
    with open(tmp_path / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl", "wb") as f:
        f.truncate(70 * 2**20)                                   # sparse: over the budget alone
    (tmp_path / "PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.whl").unlink()
    assert carry.main(["--root", str(ROOT), "--wheels", str(tmp_path)]) == 1
    assert "over budget" in capsys.readouterr().err


def test_profile_groups_a_steps_launches_by_kernel():
    """The decode-step profile: launches of one kernel summed, the largest total first, the
    slowest launch's geometry kept, shares of the whole step in the written table."""
    from scripts.gpu_check.profile import LaunchTime, by_kernel, table

    times = [LaunchTime("matvec_q4_1", (72,), (32, 8), 3e-6), LaunchTime("rms_norm", (1,), (256,), 1e-6),
             LaunchTime("matvec_q4_1", (192,), (32, 8), 5e-6), LaunchTime("rms_norm", (1,), (256,), 1e-6)]
    rows = by_kernel(times)
    assert [(name, n) for name, n, _, _ in rows] == [("matvec_q4_1", 2), ("rms_norm", 2)]
    assert abs(rows[0][2] - 8e-6) < 1e-12 and rows[0][3].grid == (192,)
    text = table(times)
    assert "| matvec_q4_1 | 2 | 8.0 | 80.0% | 0.0 | 0.00 | - | 5.00 | (192,) | (32, 8) |" in text
    assert "| rms_norm | 2 | 2.0 | 20.0% |" in text


def test_fast_gguf_writes_the_planned_tensors_with_sane_values(tmp_path):
    """The fast writer's file holds exactly `tensor_plan`'s tensors (names, shapes, types, bytes),
    the loader takes it, and every quant type dequantises to finite weights of spread ~0.02."""
    import gguf
    import numpy as np

    from metatp.ir.loader import load_model
    from scripts.gpu_check.fast_gguf import tensor_plan, write_fast_gguf
    from scripts.gpu_check.shapes import SHAPES

    for shape in SHAPES:
        path = tmp_path / f"{shape.name}.gguf"
        size = write_fast_gguf(path, shape.small, chunk_bytes=3000)      # many chunks a tensor
        plan = tensor_plan(shape.small)
        reader = gguf.GGUFReader(path)
        assert [t.name for t in reader.tensors] == [t.name for t in plan]
        assert size >= sum(t.nbytes for t in plan)
        for got, want in zip(reader.tensors, plan):
            assert tuple(int(n) for n in got.shape) == want.ne and got.tensor_type.name == want.type_name
            assert int(got.n_bytes) == want.nbytes
            if want.type_name != "F32":
                w = gguf.quants.dequantize(np.array(got.data), got.tensor_type)
                assert np.isfinite(w).all() and 0.005 < float(w.std()) < 0.05, want.name
        assert ("output.weight" in [t.name for t in plan]) == (not shape.small.tied)
        model = load_model(path)
        assert model.hparams.n_layer == shape.small.n_layer


def test_fast_gguf_refuses_a_width_its_blocks_do_not_divide():
    from scripts.gpu_check.fast_gguf import TensorSpec

    with pytest.raises(ValueError, match="Q4_K blocks of 256"):
        _ = TensorSpec("blk.0.ffn_down.weight", (576, 192), "Q4_K").nbytes


def test_bytes_read_per_token_of_the_1b_shapes():
    """Llama-3.2-1B shapes in Q8_0, tied: 16 layers of q,k,v,o,gate,up,down read whole, the tied
    embedding read whole as the output, F32 norms; K and V in f16 at KV 4096."""
    from scripts.gpu_check.shapes import SHAPES, bytes_read_per_token

    spec = next(s for s in SHAPES if s.name == "1B").spec
    per_layer = 2048 * (2048 + 512 + 512 + 2048 + 3 * 8192)
    want_w = (16 * per_layer + 128256 * 2048) // 32 * 34 + (16 * 2 + 1) * 2048 * 4
    weights, kv = bytes_read_per_token(spec, 4096)
    assert weights == want_w
    assert kv == 2 * 16 * 4096 * 8 * 64 * 2
    big = next(s for s in SHAPES if s.name == "8B").spec      # untied: one embedding row + the output
    w8, _ = bytes_read_per_token(big, 128)
    per_layer8 = 4096 * (4096 + 1024 + 1024 + 4096 + 3 * 14336)
    assert w8 == (32 * per_layer8 + 128256 * 4096 + 4096) // 256 * 144 + (32 * 2 + 1) * 4096 * 4


#: a default-variant decode row of the shapes section (what row_text writes)
DECODE_ROW = (r"[\d,]+ tok/s \([\d,]+ µs/token, \d+ launches/token, [\d,.]+ MB weights \+ [\d,.]+ MB KV "
              r"read/token = [\d,.]+ GB/s, \d+\.\d\d of the copy's [\d,]+ GB/s; whole\)")


def assert_shape_rows(rows: dict, name: str) -> None:
    """A shape's model row and its CUDA-graph decode row at each KV length (default variant)."""
    import re

    assert rows[f"decode {name} model"]["status"] == "info"
    for kv in (16, 64):
        row = rows[f"decode {name} KV {kv} CUDA graph"]
        assert row["status"] == "pass" and re.fullmatch(DECODE_ROW, row["result"]), row


def test_emulated_dry_run_writes_the_model_size_rows(tmp_path):
    """`python3 scripts/gpu_check --emulate --big --variants default --shapes 1B,8B`, the shapes section
    alone: a copy-bandwidth row, then per shape a model row and a CUDA-graph decode row at each KV
    length, each with tok/s, launches and bytes a token and the fraction of the copy bandwidth. The
    135M shape's rows are checked alike by test_emulated_dry_run_compares_the_kernel_variants, whose
    run has them (its default variant): not run twice."""
    import json
    import re

    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--big", "--variants",
                        "default", "--shapes", "1B,8B", "--budget", "100000", "--skip",
                        "kernels,model,speed,profile,llama-cpp,throughput,nccl,mpi", "--workdir", str(tmp_path),
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert re.fullmatch(r"[\d,]+ GB/s", rows["device-to-device copy bandwidth (read + written)"]["result"])
    for name in ("1B Q8_0", "8B Q4_K"):
        assert_shape_rows(rows, name)
    assert "decode 135M Q4_1 model" not in rows                  # --shapes 1B,8B
    assert not list(tmp_path.glob("shape-*.gguf"))          # each file removed after its rows


@requires("emulator", "serve")
def test_emulated_dry_run_writes_the_throughput_rows(tmp_path):
    """`python3 scripts/gpu_check --emulate`, the throughput section alone: batched-bench rows per B
    with S_PP/S_TG/S, the S_TG ratios named as the issue names them, which plans replay a graph
    (every decode bucket does), the long-prompt rows, and the serve comparison through `metatp serve
    --backend cupy` (emulated) and the openai client. The llama-cpp section (before it, and
    independent) is skipped: tests/tools/test_gpu_check_llama_cpp.py runs it alone."""
    import json
    import re

    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--skip",
                        "kernels,model,speed,profile,shapes,llama-cpp,nccl,mpi", "--workdir", str(tmp_path), "--out",
                        str(out)], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    rate = r"[\d,.]+(e[-+]\d+)?"
    for b in (1, 2, 4):
        row = rows[f"batched-bench 1B Q8_0 PP 4 TG 3 B={b}"]
        want = rf"S_PP {rate} t/s, S_TG {rate} t/s, S {rate} t/s \(T_PP .*N_KV {b * 7}\)"
        assert re.fullmatch(want, row["result"]), row
    for b in (2, 4):
        assert re.fullmatch(r"\d+\.\dx", rows[f"S_TG B={b} / B=1, 1B Q8_0"]["result"])
    row = rows["batched-bench 1B Q8_0 PP 4 TG 3 B=4 batch_invariant"]        # what batch invariance costs
    assert re.fullmatch(rf"S_PP {rate} t/s, S_TG {rate} t/s, S {rate} t/s \(T_PP .*N_KV 28\)", row["result"]), row
    assert re.fullmatch(r"\d+\.\d\dx", rows["S_TG B=4 batch_invariant / default, 1B Q8_0"]["result"])
    graphs = dict(part.split(": ") for part in rows["plans by rows, 1B Q8_0"]["result"].split(", "))
    assert all(graphs[str(b)] == "whole" for b in (1, 2, 4))          # each decode bucket replays its graph
    assert rows["cuBLAS GEMM in CUDA graphs, 1B Q8_0"]["result"] == "yes"    # the emulator captures its GEMMs
    for n in (16, 40):
        assert re.fullmatch(rf"{rate} tok/s \(.*\)", rows[f"pp{n} 1B Q8_0"]["result"])
    serve = rows["serve 4 concurrent vs serial, 1B Q8_0"]
    assert serve["status"] == "info" and re.fullmatch(
        rf"\d+\.\dx \({rate} tok/s for 4 at once, {rate} tok/s one after another over 4 of them; 4 tokens each\)",
        serve["result"]), serve
    assert rows["pp 8B Q4_K"]["result"] == "not run (needs --big)"
    # the many-token products, each path checked against its reference (untimed on the emulator)
    for t in (1, 9, 17):
        assert rows[f"MUL_MAT tiny q8_0 70x64 q8_0 T={t}"]["result"] == ("matvec -, mmq -, gemm -, mmq_h -, mmq_i8 - "
                                                                      "µs (emulator: untimed)")
    assert "is the fastest exact path on every shape at no T (default T = 9..16" in rows[
        "many-token products, 1B Q8_0"]["result"]
    assert rows["batched-bench 1B Q8_0 tuned"]["result"].startswith("not run")
    assert not [row for row in rows.values() if row["status"] == "FAIL"]
    assert not list(tmp_path.glob("throughput-*"))          # each file removed after its rows


def test_tuned_rows_run_the_many_row_steps_again_with_the_measured_choice(tmp_path, monkeypatch):
    """Where the crossover rows found the tiled kernel fastest up to T=64 and the int8 tiles too, the
    many-row batched-bench steps run again with mmq_min_tokens..mmq_max_tokens = 9..64, and the B<=64
    one with numerics q8, each row named by its choice with its S_TG against the default row's; where
    the tensor-core tiles won, they are what runs (the f32 tiles' range is then not tried)."""
    import re

    from scripts.gpu_check import throughput
    from scripts.gpu_check.config import Budget, Config
    from scripts.gpu_check.report import Report
    from scripts.gpu_check.shapes import SHAPES

    assert throughput._tuned_range(None, (9, 16)) is None
    assert throughput._tuned_range((16, 16), (9, 16)) is None   # the default range already
    assert throughput._tuned_range((1, 4), (9, 16)) is None     # never won above the matvec kernel's rows
    assert throughput._tuned_range((16, 64), (9, 16)) == (9, 64)
    assert throughput._tuned_range((16, 16), None) == (9, 16)   # an option off by default: any range is new
    cfg = Config.dry_run()
    cfg.bench_batches = (1, 9)
    made = []
    real_llm = throughput.cupy_llm

    def spy(cfg_, path, **kw):
        made.append(kw)
        return real_llm(cfg_, path, **kw)
    monkeypatch.setattr(throughput, "cupy_llm", spy)
    rep = Report()
    path = throughput._model_file(cfg, SHAPES[1], tmp_path)
    throughput._tuned_rows(rep, cfg, Budget(1e6), path, "1B Q8_0", {"mmq": (16, 64), "int8": (9, 256)}, {9: 1.0})
    rows = {r["check"]: r for r in rep.rows}
    assert [kw.get("backend_options") or kw.get("numerics") for kw in made] == [
        {"mmq_min_tokens": 9, "mmq_max_tokens": 64}, "q8"]
    assert re.fullmatch(r"S_PP .* t/s, S_TG .* t/s, S .* t/s \(.*\)", rows["batched-bench 1B Q8_0 PP 4 TG 3 B=9 "
                                                                          "[mmq 9..64]"]["result"])
    assert "batched-bench 1B Q8_0 PP 4 TG 3 B=1 [mmq 9..64]" not in rows      # one row: the matvec kernel's
    for tag in ("mmq 9..64", "q8"):
        assert re.fullmatch(r"\d+\.\d\dx", rows[f"S_TG B=9 [{tag}] / default, 1B Q8_0"]["result"])
    assert not [r for r in rep.rows if r["status"] == "FAIL"]
    made.clear()
    rep = Report()
    throughput._tuned_rows(rep, cfg, Budget(1e6), path, "1B Q8_0", {"mmq": (16, 64), "mmq_h": (9, 256)}, {9: 1.0})
    assert [kw.get("backend_options") for kw in made] == [{"mmq_tensor_cores": True, "mmq_min_tokens": 9,
                                                           "mmq_max_tokens": 256}]
    rows = {r["check"]: r for r in rep.rows}
    assert re.fullmatch(r"\d+\.\d\dx", rows["S_TG B=9 [mmq_h 9..256] / default, 1B Q8_0"]["result"])
    assert not [r for r in rep.rows if r["status"] == "FAIL"]


def test_plan_of_the_throughput_call_fits_its_budget():
    """The throughput call of docs/gpu-results.md (issue 44's sections and llama-cpp left out: they are
    other calls) fits its --budget 420 with every part of the section, the crossover and tuned rows too."""
    from scripts.gpu_check import plan
    from scripts.gpu_check.__main__ import part_names
    from scripts.gpu_check.config import Config

    skip = {"kernels", "model", "speed", "shapes", "profile", "llama-cpp", "nccl", "mpi"}
    estimates = plan.estimate(Config(), skip, part_names(Config(), skip, split_shapes=True))
    assert [e.section for e in estimates] == ["preflight", "env", "throughput", "part processes"]
    assert "crossover, bench, tuned" in estimates[2].what
    assert sum(e.seconds for e in estimates) <= 420


def test_emulated_dry_run_compares_the_kernel_variants(tmp_path):
    """The shapes and profile sections on the 135M stand-in with every variant: each one this tree's
    cupy backend takes has its decode rows (the default's under the usual names, the others suffixed
    and with their ratio to the default) and, when profiled, its kernel summary row and table; each
    one it refuses (an option that did not land) is one info row saying why, never a crash."""
    import json
    import re

    from scripts.gpu_check.variants import VARIANTS, refusal

    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--budget", "100000",
                        "--shapes", "135M", "--variants", "default,before,q8,pdl", "--skip",
                        "kernels,model,speed,llama-cpp,throughput,nccl,mpi", "--workdir", str(tmp_path), "--out",
                        str(out)], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    written = out.read_text()
    # launches of the 2-layer stand-in's decode step: 8 a layer before this round's kernels, 5 with them
    # (norm+q/k/v+RoPE+KV write; attention with its merge; o+add; norm+gate/up+GLU; down+add), 7 with the
    # int8 twins (q8 keeps RoPE and the KV write apart); + get_rows and the output head
    launches = {"before": 18, "default": 12, "pdl": 12, "q8": 16}

    def variant_row(n: int) -> str:
        return (rf"[\d,]+ tok/s \([\d,]+ µs/token, {n} launches, {n / 2:.1f} launches/layer, \d+% of copy "
                r"bandwidth; whole\); \d+\.\d\dx \[default\]")

    def summary(n: int) -> str:
        return (r"kernels sum [\d,]+ µs of a [\d,]+ µs step \(whole\), [\d,]+ µs with the L2 warm; top 3: \S+ \d+%, "
                r"\S+ \d+%, \S+ \d+%; weights [\d.,]+ MB read at [\d,]+ GB/s \([\d.]+ of the copy\); "
                rf"{n} launches/token, {n / 2:.1f}/layer")
    ran = 0
    for v in VARIANTS:
        why = refusal(v)
        if why is not None:
            assert rows[f"decode variant [{v.name}]"] == {"section": "speed", "check": f"decode variant [{v.name}]",
                                                          "result": f"skipped: {why}", "status": "info"}
            assert not [c for c in rows if c.endswith(f"[{v.name}]") and "KV" in c]
            continue
        ran += 1
        for kv in (16, 64):
            row = rows[f"decode 135M Q4_1 KV {kv} CUDA graph{v.suffix()}"]
            assert row["status"] == "pass", row
            if v.name != "default":
                assert re.fullmatch(variant_row(launches[v.name]), row["result"]), row
        if v.profiled:
            label = f"decode 135M Q4_1 KV 16 kernels{v.suffix()}"
            n = launches[v.name]
            assert re.fullmatch(summary(n), rows[label]["result"]), rows[label]
            assert f"### {label}: kernels one by one\n\n{n} launches a token, {n / 2:.1f} a layer (2 layers)" in written
    assert ran >= 2                                  # default and before exist on every tree of this round
    assert_shape_rows(rows, "135M Q4_1")             # the default's rows, as the other shapes' in the shapes-only run
    assert ("| kernel | launches | µs a step | share | of the step | µs L2 warm | weights MB | weights read at |"
            in written)
    assert "decode 1B Q8_0 model" not in rows and "decode 8B Q4_K" not in rows      # --shapes 135M
    assert not [row for row in rows.values() if row["status"] == "FAIL"]


class _SimulatedBudget:
    """A Budget whose clock moves only when a stubbed variant 'runs' for its estimated seconds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds


def _run_shapes_on_a_simulated_clock(monkeypatch, tmp_path, seconds: float):
    """section_shapes over 135M and 1B with all four variants taken, each variant's work replaced by
    spending its estimate; returns (the (shape, variant) pairs run, the report)."""
    from scripts.gpu_check import shapes
    from scripts.gpu_check.config import Config
    from scripts.gpu_check.report import Report

    cfg = Config.dry_run()
    cfg.shapes = ("135M", "1B")
    budget, ran = _SimulatedBudget(seconds), []

    def fake_variant(rep, cfg, budget, shape, spec, model, variant, decode, profile, copy_bps, rates):
        ran.append((shape.name, variant.name))
        budget.seconds -= shapes.variant_need(shape, cfg, variant, decode, profile)

    monkeypatch.setattr(shapes, "runnable", lambda vs: (vs, {}))
    monkeypatch.setattr(shapes, "_one_variant", fake_variant)
    rep = Report()
    shapes.section_shapes(rep, cfg, budget, tmp_path, decode=True, profile=True)
    return ran, rep


def test_shapes_keep_the_default_rows_of_later_shapes_inside_the_budget(monkeypatch, tmp_path):
    """With time for the default variant of each shape and no more, the other variants of the first
    shape are skipped with a row (the time is kept for the next shape's default rows); with time for
    everything, every shape runs every variant, in the table's order."""
    from scripts.gpu_check import shapes
    from scripts.gpu_check.config import Config
    from scripts.gpu_check.variants import VARIANTS

    cfg = Config.dry_run()
    small, big = (s for s in shapes.SHAPES if s.name in ("135M", "1B"))
    defaults = shapes.shape_need(small, cfg, VARIANTS[:1], True, True) + shapes.shape_need(big, cfg, VARIANTS[:1],
                                                                                            True, True)
    ran, rep = _run_shapes_on_a_simulated_clock(monkeypatch, tmp_path, defaults)
    assert ran == [("135M", "default"), ("1B", "default")]
    skipped = {r["check"]: r["result"] for r in rep.rows if r["result"].startswith("skipped (time budget")}
    assert set(skipped) == {f"decode {s} [{v}]" for s in ("135M Q4_1", "1B Q8_0") for v in ("before", "q8", "pdl")}
    ran, rep = _run_shapes_on_a_simulated_clock(monkeypatch, tmp_path, 1e6)
    assert ran == [(s, v.name) for s in ("135M", "1B") for v in VARIANTS]
    assert not [r for r in rep.rows if "skipped" in r["result"]]
    ran, rep = _run_shapes_on_a_simulated_clock(monkeypatch, tmp_path, 5.0)       # not even the first file
    assert ran == [] and [r["check"] for r in rep.rows if "skipped" in r["result"]] == ["decode 135M Q4_1",
                                                                                          "decode 1B Q8_0"]
    assert not list(tmp_path.glob("shape-*.gguf"))


def test_plan_of_the_issue_44_call_fits_its_budget(monkeypatch):
    """The plan docs/gpu-results.md gives for issue 44's call (every variant taken, as on a tree where
    q8 and pdl landed; each part in a process of its own, as on a GPU) fits its --budget 440 with the
    machine's start inside the call's timeout_s 500, and a plan that does not fit says so and exits 1."""
    from scripts.gpu_check import plan, variants
    from scripts.gpu_check.__main__ import main, part_names
    from scripts.gpu_check.config import Config

    monkeypatch.setattr(variants, "runnable", lambda vs: (vs, {}))
    skip = {"llama-cpp", "throughput", "nccl", "mpi"}
    estimates = plan.estimate(Config(), skip, part_names(Config(), skip, split_shapes=True))
    assert [e.section for e in estimates] == ["preflight", "env", "kernels", "model", "speed", "shapes 135M",
                                              "shapes 1B", "part processes"]
    total = sum(e.seconds for e in estimates)
    assert 200 < total <= 440
    text = plan.plan_text(estimates, 440)
    assert f"| **total** | **{total:.0f}** | against --budget 440: fits |" in text
    assert "timeout_s 500" in text
    assert main(["--emulate", "--plan", "--skip", ",".join(skip), "--budget", "440"]) == 0
    assert main(["--plan", "--budget", "100"]) == 1
    assert "OVER by" in plan.plan_text(plan.estimate(Config(), set()), 100)


def test_variants_are_refused_by_the_registry_not_assumed():
    """A variant whose option the backend does not declare, or whose value it refuses, is named with
    the reason; an unknown variant name is a ConfigError."""
    from metatp.ir.errors import ConfigError
    from scripts.gpu_check.variants import Variant, by_names, refusal

    assert refusal(Variant("before", {"attn_merge": False, "fuse_qkv_rope": False})) is None
    assert refusal(Variant("x", {"no_such_option": True})) == "this tree's cupy backend has no option no_such_option"
    assert "not one of" in refusal(Variant("x", {"kv_dtype": "f8"}))
    assert [v.name for v in by_names(["q8", "default"])] == ["default", "q8"]
    with pytest.raises(ConfigError, match="unknown variant nope"):
        by_names(["nope"])


def test_profile_summary_names_the_top_kernels_and_launches_per_layer():
    from scripts.gpu_check.profile import LaunchTime, summary, table

    times = [LaunchTime("matvec_q4_1", (72,), (32, 8), 3e-6), LaunchTime("rms_norm", (1,), (256,), 1e-6),
             LaunchTime("matvec_q4_1", (192,), (32, 8), 5e-6), LaunchTime("attn_decode", (9, 4), (128,), 1e-6)]
    assert summary(times, 20.0, "whole", 4, 2) == ("kernels sum 10 µs of a 20 µs step (whole), 0 µs with the L2 "
                                                   "warm; top 3: matvec_q4_1 80%, rms_norm 10%, attn_decode 10%; "
                                                   "4 launches/token, 2.0/layer")
    assert "(time budget: the first 4 of 9 launches)" in summary(times, 20.0, "whole", 9, 2)
    assert "| matvec_q4_1 | 2 | 8.0 | 80.0% | 40.0% | 0.0 | 0.00 | - | 5.00 | (192,) | (32, 8) |" in table(times, 20e-6)


def test_profile_gives_each_kernel_its_weight_bandwidth_cold_and_warm():
    """With the L2 warm and cold times and the weight bytes of each launch: per kernel the warm total,
    the weights read and their bandwidth (against the copy's when given); in the summary the warm sum
    and the weights' bandwidth over the launches that read weights."""
    from scripts.gpu_check.profile import LaunchTime, summary, table

    times = [LaunchTime("matvec_q8_0", (1024,), (128, 2), 4e-6, 2e-6, 8_000_000),
             LaunchTime("matvec_q8_0", (1024,), (128, 2), 6e-6, 3e-6, 12_000_000),
             LaunchTime("attn_decode", (4, 8), (64,), 5e-6, 9e-6, 0)]
    text = table(times, 30e-6, copy_bps=4e12)
    assert ("| matvec_q8_0 | 2 | 10.0 | 66.7% | 33.3% | 5.0 | 20.00 | 2,000 GB/s (0.50 of the copy) | 6.00 | "
            "(1024,) | (128, 2) |") in text
    assert "| attn_decode | 1 | 5.0 | 33.3% | 16.7% | 9.0 | 0.00 | - | 5.00 |" in text
    assert summary(times, 30.0, "whole", 3, 1, copy_bps=4e12) == (
        "kernels sum 15 µs of a 30 µs step (whole), 14 µs with the L2 warm; top 3: matvec_q8_0 67%, attn_decode 33%; "
        "weights 20.0 MB read at 2,000 GB/s (0.50 of the copy); 3 launches/token, 3.0/layer")
    # the shapes section's copy bandwidth is NaN when its copy failed: the bandwidth without the fraction
    assert "weights 20.0 MB read at 2,000 GB/s; " in summary(times, 30.0, "whole", 3, 1, copy_bps=float("nan"))


def test_profile_counts_every_weight_a_decode_step_reads_once(tmp_path):
    """The weight bytes the profile gives a decode step's launches add up to what the shapes rows say a
    token reads (every layer matrix and norm, the tied output matrix whole; the embedding gather
    reads one row, counted by neither), and the L2 flush is one launch reading at least what it is asked."""
    import numpy as np

    from scripts.gpu_check.config import Budget, Config, cupy_engine
    from scripts.gpu_check.fast_gguf import write_fast_gguf
    from scripts.gpu_check.profile import flush_launch, launch_times, weight_bytes_of
    from scripts.gpu_check.shapes import SHAPES, bytes_read_per_token
    from scripts.gpu_check.speed import time_decode
    from metatp.ir.loader import load_model

    cfg = Config.dry_run()
    shape = SHAPES[0]
    path = tmp_path / "m.gguf"
    write_fast_gguf(path, shape.small)
    eng = cupy_engine(cfg, load_model(path), 64, cuda_graphs=True)
    ex = time_decode(cfg, eng, 8, 1, vocab=shape.small.n_vocab)["executable"]
    d = ex.devices[0]
    weights = weight_bytes_of(ex, d)
    steps = [s for per_dev in ex.steps for s in per_dev[d]]
    assert sum(weights(s) for s in steps) == bytes_read_per_token(shape.small, 0)[0]
    assert [weights(s) for s in steps if s.name.startswith("get_rows")] == [0]
    flush = flush_launch(ex.rt, ex.devs[d], 100_000)
    w = flush.args[0]
    assert flush.name.startswith("matvec_q8_0") and w.dtype == np.uint8 and 100_000 - w.shape[1] < w.nbytes <= 100_000
    times = launch_times(ex, Budget(1e6), *cfg.profile_copies, flush_bytes=cfg.profile_flush_bytes)
    assert [t.name for t in times] == [s.name for s in steps]
    assert all(t.seconds >= 0 and t.warm is not None and t.warm >= 0 for t in times)
    assert [t.weight_bytes for t in times] == [weights(s) for s in steps]


def test_virtual_device_rows_compare_with_n1_on_the_emulator(tmp_path):
    """Issue 44 item 6's rows: N=2 and N=3 -sm tensor and N=2 -sm layer on one (emulated) GPU, each
    with its ratio to the run's N=1 rate and the issue's bar; without an N=1 rate it is measured first."""
    import re

    from scripts.gpu_check.config import Budget, Config
    from scripts.gpu_check.model import write_model
    from scripts.gpu_check.report import Report
    from scripts.gpu_check.speed import ratio_text, virtual_device_rows

    assert ratio_text(600.0, 792.0, 0.8) == "0.76x N=1 (792 tok/s): below the 0.8x bar"
    assert ratio_text(780.0, 792.0, 0.95) == "0.98x N=1 (792 tok/s): meets the 0.95x bar"
    cfg = Config.dry_run()
    cfg.decode_steps, cfg.kv_lengths = 1, (8, 16)
    rep = Report()
    model = write_model(rep, cfg, tmp_path)
    virtual_device_rows(rep, cfg, model, Budget(1e6), None)
    rows = {r["check"]: r for r in rep.rows}
    assert re.fullmatch(r"\d+ tok/s \(.*whole\)", rows["decode N=1 KV 8 CUDA graph (the virtual-device rows' "
                                                     "reference)"]["result"])
    for n, mode, bar in cfg.virtual_cases:
        row = rows[f"decode N={n} virtual devices -sm {mode} KV 8 CUDA graph"]
        assert row["status"] == "info" and re.fullmatch(
            rf"\d+ tok/s \([\d]+ µs/token, \d+ launches over {n} devices, whole.*\); \d+\.\d\dx N=1 \(\d+ tok/s\): "
            rf"(meets|below) the {bar}x bar", row["result"]), row


def test_each_variant_s_logits_are_checked_against_numpy_on_the_emulator(tmp_path):
    """The model section's variant rows: N=1 logits and greedy tokens of each non-default variant the
    tree takes against numpy (a pass here), one skip row naming the reason for each it refuses."""
    import numpy as np

    from scripts.gpu_check.config import Budget, Config
    from scripts.gpu_check.model import variant_logits, write_model
    from scripts.gpu_check.report import Report
    from scripts.gpu_check.variants import VARIANTS, refusal

    cfg = Config.dry_run()
    cfg.greedy_steps = 2
    rep = Report()
    model = write_model(rep, cfg, tmp_path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(300, cfg.vocab, 6)]
    variant_logits(rep, cfg, model, Budget(1e6), prompt, {})
    rows = {r["check"]: r for r in rep.rows[1:]}
    assert len(rows) == len(VARIANTS) - 1
    for v in VARIANTS[1:]:
        row = next(r for check, r in rows.items() if check.startswith(f"logits vs numpy, N=1 [{v.name}] ("))
        why = refusal(v)
        assert (row["status"], row["result"]) == (("info", f"skipped: {why}") if why else ("pass", row["result"])), row
        if not why:
            assert row["result"].startswith("3/3 same greedy token"), row
