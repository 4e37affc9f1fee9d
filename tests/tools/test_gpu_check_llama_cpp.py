"""gpu_check's llama-cpp section (issue 44 item 5): its rows beside metatp's, its skip lines, the
child it starts (a stand-in child here: llama.cpp's CUDA build needs the GPU machine), and the
carry plan with the llama.cpp wheel."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.gpu_check import carry
from scripts.gpu_check import llama_cpp as section
from scripts.gpu_check.config import Budget, Config
from scripts.gpu_check.llama_cpp_child import offloaded_layers
from scripts.gpu_check.report import Report
from support.require import requires

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for llama_cpp_child.py: llama.cpp's load log on stderr, its JSON result last on stdout.
FAKE_CHILD = textwrap.dedent("""
    import json, sys
    args = json.loads(sys.argv[1])
    if "FAIL" in args["model"]:
        print("llama_model_load: error loading model: missing tensor 'blk.0.attn_q.weight'", file=sys.stderr)
        sys.exit(1)
    open(args["model"], "rb").read(4)                     # the file the section wrote is there
    print("load_tensors: offloaded 3/3 layers to GPU", file=sys.stderr)
    print("chatter on stdout first")
    print(json.dumps({"version": "0.3.36", "gpu_offload": True, "load_s": 0.5, "n_ctx": 512,
                      "decode": {str(k): 1000.0 + k for k in args["kv_lengths"]},
                      "prefill": 4000.0 if args["prefill"] else None}))
""")


@pytest.fixture
def llamacpp_fake_child(tmp_path, monkeypatch):
    """The section's child replaced by FAKE_CHILD, and llama_cpp reported importable."""
    child = tmp_path / "fake_child.py"
    child.write_text(FAKE_CHILD)
    monkeypatch.setattr(section, "CHILD", child)
    monkeypatch.setattr(section, "llama_cpp_importable", lambda: True)
    return child


def test_a_comparison_row_reads_metatp_then_llama_cpp_then_the_ratio():
    assert section.Comparison("decode 1B Q8_0 KV 128", 2345.0, 3000.0).text() == \
        "metatp 2,345 tok/s vs llama.cpp 3,000 tok/s = 0.78x"
    assert section.Comparison("prefill 1B Q8_0 pp512", None, 12345.6).text() == \
        "metatp not measured vs llama.cpp 12,346 tok/s"


def test_the_section_is_skipped_with_the_reason():
    gpu, emu = Config(), Config.dry_run()
    no_module = section.skip_reason(gpu, Budget(600), importable=False)
    assert "not importable" in no_module and ".whl/" in no_module and "build_llama_cpp.sh" in no_module
    assert "CPU build is not installed" in section.skip_reason(emu, Budget(600), importable=False)
    assert "time budget" in section.skip_reason(gpu, Budget(30), importable=True)
    assert section.skip_reason(gpu, Budget(600), importable=True) is None
    assert section.skip_reason(emu, Budget(30), importable=True) is None


def test_without_llama_cpp_the_section_adds_one_skip_row(tmp_path, monkeypatch):
    monkeypatch.setattr(section, "llama_cpp_importable", lambda: False)
    rep = Report()
    section.section_llama_cpp(rep, Config.dry_run(), Budget(600), tmp_path)
    assert [(r["section"], r["status"]) for r in rep.rows] == [("llama-cpp", "info")]
    assert rep.rows[0]["result"].startswith("skipped: llama-cpp-python is not importable")
    assert not list(tmp_path.iterdir())


def test_metatp_rate_reads_the_tok_s_that_starts_a_row():
    rep = Report()
    rep.add("speed", "decode 1B Q8_0 KV 128 CUDA graph", "2,345 tok/s (426 µs/token, ...)", True)
    rep.add("speed", "prefill 512 tokens N=1", "18,000.5 tok/s (28.4 ms)", None)
    rep.add("speed", "decode 1B Q8_0 KV 4096 CUDA graph", "skipped (time budget)", None)
    assert section.metatp_rate(rep, "decode 1B Q8_0 KV 128 CUDA graph") == 2345.0
    assert section.metatp_rate(rep, "prefill 512 tokens N=1") == 18000.5
    assert section.metatp_rate(rep, "decode 1B Q8_0 KV 4096 CUDA graph") is None
    assert section.metatp_rate(rep, "decode 8B Q4_K KV 128 CUDA graph") is None


def test_comparisons_pair_each_llama_cpp_number_with_metatp_s_row():
    rep = Report()
    rep.add("speed", "decode 135M Q4_1 KV 128 CUDA graph", "3,000 tok/s (...)", True)
    rep.add("speed", "prefill 512 tokens N=1", "20,000 tok/s (25.6 ms)", None)
    result = {"decode": {"128": 6000.0, "4096": 4000.0}, "prefill": 40000.0}
    rows = section.comparisons(rep, "135M", "Q4_1", result, 512)
    assert [(c.check, c.metatp, c.llama_cpp) for c in rows] == [
        ("decode 135M Q4_1 KV 128", 3000.0, 6000.0), ("decode 135M Q4_1 KV 4096", None, 4000.0),
        ("prefill 135M Q4_1 pp512", 20000.0, 40000.0)]
    one_b = section.comparisons(rep, "1B", "Q8_0", result, 512)     # the speed section's prefill is 135M's
    assert one_b[-1].check == "prefill 1B Q8_0 pp512" and one_b[-1].metatp is None


def test_offloaded_layers_are_read_from_llama_cpp_s_log():
    log = "llama_model_load: ...\nload_tensors: offloaded 17/17 layers to GPU\nload_tensors: CUDA0 model buffer"
    assert offloaded_layers(log) == (17, 17)
    assert offloaded_layers("load_tensors: CPU_Mapped model buffer size = 90.1 MiB") is None


def test_cuda_library_dirs_finds_the_nvidia_packages_libraries(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "lib" / "libcublas.so.13").write_bytes(b"")
    (site / "nvidia" / "cuda_runtime" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12").write_bytes(b"")
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)                       # neither library: left out
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert section.cuda_library_dirs([str(site), str(tmp_path / "absent")]) == [
        str(site / "nvidia" / "cu13" / "lib"), str(site / "nvidia" / "cuda_runtime" / "lib")]
    env = section.child_env(["/a", "/b"])
    assert env["LD_LIBRARY_PATH"].split(":")[:2] == ["/a", "/b"] and env["GGML_NO_BACKTRACE"] == "1"


def test_run_child_returns_its_json_and_the_offload_and_names_a_failure(tmp_path, llamacpp_fake_child):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = {"model": str(model), "n_gpu_layers": -1, "kv_lengths": [128], "steps": 4, "prefill": 0}
    result = section.run_child(args, tmp_path / "m.log", 60)
    assert result["decode"] == {"128": 1128.0} and result["offloaded"] == (3, 3)
    assert "offloaded 3/3" in (tmp_path / "m.log").read_text()
    with pytest.raises(RuntimeError, match=r"exited with 1: .*missing tensor 'blk.0.attn_q.weight'"):
        section.run_child(dict(args, model=str(tmp_path / "FAIL.gguf")), tmp_path / "f.log", 60)


def test_emulated_section_writes_both_shapes_rows_and_removes_the_files(tmp_path, llamacpp_fake_child):
    cfg = Config.dry_run()
    rep = Report()
    rep.add("speed", "decode 1B Q8_0 KV 16 CUDA graph", "500 tok/s (...)", True)
    section.section_llama_cpp(rep, cfg, Budget(600), tmp_path / "work")
    rows = {r["check"]: r for r in rep.rows if r["section"] == "llama-cpp"}
    for name in ("135M Q4_1", "1B Q8_0"):
        load = rows[f"llama.cpp {name} load"]
        assert load["status"] == "info" and "3/3 layers on the GPU" in load["result"], load
        for kv in cfg.shape_kv_lengths:
            assert f"decode {name} KV {kv}" in rows
        assert rows[f"prefill {name} pp{cfg.prefill_len}"]["result"].endswith("llama.cpp 4,000 tok/s")
    assert rows["decode 1B Q8_0 KV 16"]["result"] == "metatp 500 tok/s vs llama.cpp 1,016 tok/s = 0.49x"
    assert rows["decode 135M Q4_1 KV 16"]["result"] == "metatp not measured vs llama.cpp 1,016 tok/s"
    assert not list((tmp_path / "work").glob("*.gguf"))


def test_on_a_gpu_a_partial_offload_fails_the_load_row():
    assert section._offload_ok(Config(), {"gpu_offload": True, "offloaded": (17, 17)}) is True
    assert section._offload_ok(Config(), {"gpu_offload": True, "offloaded": (10, 17)}) is False
    assert section._offload_ok(Config(), {"gpu_offload": False, "offloaded": None}) is False
    assert section._offload_ok(Config.dry_run(), {"gpu_offload": False, "offloaded": None}) is None


@requires("bench")
def test_the_real_child_runs_llama_cpp_on_a_synthetic_gguf(tmp_path):
    """With llama-cpp-python installed (a CPU build is enough): llama.cpp loads the file the
    section writes (every tensor, the metadata, the tokenizer) and decodes at two depths."""
    from scripts.gpu_check.fast_gguf import write_fast_gguf
    from scripts.gpu_check.shapes import SHAPES

    path = tmp_path / "small.gguf"
    write_fast_gguf(path, SHAPES[0].small)
    args = {"model": str(path), "n_gpu_layers": 0, "kv_lengths": [16, 64], "steps": 2, "prefill": 24}
    result = section.run_child(args, tmp_path / "small.log", 300)
    assert set(result["decode"]) == {"16", "64"} and all(v > 0 for v in result["decode"].values())
    assert result["prefill"] > 0


@requires("git")
def test_the_carry_plan_with_the_llama_cpp_wheel_fits_the_budget(tmp_path, capsys):
    wheels = carry.plan(("llama-cpp",))
    base = tuple(w for w in carry.WHEELS if w.name not in {"mpich", "mpi4py"})    # that call runs no MPI
    assert wheels[:len(base)] == base and len(base) == len(carry.WHEELS) - 2
    assert {w.name for w in wheels[len(base):]} == {"llama-cpp-python", "diskcache"}
    items, problems = carry.measure(ROOT, tmp_path, wheels)
    assert not problems and carry.total_mib(items) < carry.BUDGET_MIB
    built_by = r"llama-cpp-python==0\.3\.36 \(not built: .*build_llama_cpp\.sh wheel\)"
    assert any(re.search(built_by, i.what) for i in items)
    assert carry.main(["--root", str(ROOT), "--wheels", str(tmp_path), "--with", "llama-cpp"]) == 0
    (tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"x" * 2**20)
    items, _ = carry.measure(ROOT, tmp_path, wheels)
    assert {i.what: i.how for i in items}["llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"] == "measured"
    with pytest.raises(KeyError):
        carry.plan(("llama-cp",))


@requires("git")
def test_the_carry_plan_with_llama_cpp_s_source_counts_the_archive(tmp_path):
    wheels = carry.plan(("llama-cpp-src",))
    items, _ = carry.measure(ROOT, tmp_path, wheels)
    assert any(i.what.startswith("llama-cpp-python-src==0.3.36 (not built: ") and i.how == "estimate" for i in items)
    (tmp_path / "llama_cpp_python-0.3.36-src.tar.gz").write_bytes(b"x" * 3 * 2**20)
    items, problems = carry.measure(ROOT, tmp_path, wheels)
    src = {i.what: i for i in items}["llama_cpp_python-0.3.36-src.tar.gz"]
    assert not problems and src.how == "measured" and src.nbytes == 3 * 2**20
    assert carry.total_mib(items) < carry.BUDGET_MIB


def test_download_leaves_the_built_wheel_to_its_script(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(carry.subprocess, "run", lambda *a, **k: calls.append(a))
    carry.download(tmp_path, carry.EXTRAS["llama-cpp"][:1])
    assert calls == [] and "build it with scripts/gpu_check/build_llama_cpp.sh" in capsys.readouterr().err


def test_the_build_script_parses_and_pins_the_version_and_sm_90_only():
    script = ROOT / "scripts" / "gpu_check" / "build_llama_cpp.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "VERSION=0.3.36" in text and "-DCMAKE_CUDA_ARCHITECTURES=90 " in text
    assert "-DGGML_CUDA_FA_ALL_QUANTS=off" in text and "install.strip=true" in text


def test_the_build_script_refuses_an_unknown_mode_and_a_device_build_without_the_source(tmp_path):
    script = ROOT / "scripts" / "gpu_check" / "build_llama_cpp.sh"
    env = {"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work"), "WHEEL_DIR": str(tmp_path / "out")}
    bad = subprocess.run(["bash", str(script), "install"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "usage:" in bad.stdout
    device = subprocess.run(["bash", str(script), "device"], capture_output=True, text=True, env=env)
    assert device.returncode == 1 and "llama_cpp_python-0.3.36-src.tar.gz: run" in device.stdout


def test_the_command_line_runs_the_section_after_shapes_in_an_emulated_dry_run(tmp_path):
    """`python3 scripts/gpu_check --emulate` with the other sections skipped: the llama-cpp rows
    come (its skip row without llama-cpp-python; with a CPU build, a load row per shape and the
    comparisons), and the run passes. The throughput section, which runs after this one and reads
    none of its rows, is skipped too: tests/tools/test_gpu_check.py runs it (a minute emulated)."""
    import json

    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check"), "--emulate", "--skip",
                        "kernels,model,speed,profile,shapes,throughput,nccl,mpi", "--workdir", str(tmp_path), "--out",
                        str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [row for row in json.loads(out.with_suffix(".json").read_text())["rows"] if row["section"] == "llama-cpp"]
    if section.llama_cpp_importable():
        checks = {row["check"] for row in rows}
        assert {"llama.cpp 135M Q4_1 load", "llama.cpp 1B Q8_0 load", "decode 1B Q8_0 KV 64"} <= checks, rows
    else:
        assert len(rows) == 1 and rows[0]["result"].startswith("skipped: llama-cpp-python is not importable")


def _fake_llama_wheel(path: Path) -> None:
    """A wheel laid out as scikit-build-core writes llama-cpp-python's: each library three times
    (libX.so, .so.0, .so.0.25.3) in llama_cpp/lib and again under a top-level lib/."""
    import zipfile

    dist = "llama_cpp_python-0.3.36.dist-info"
    libs = {"libllama.so": b"L" * 3000, "libggml.so": b"G" * 100, "libggml-base.so": b"B" * 500,
            "libggml-cuda.so": b"C" * 9000}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llama_cpp/__init__.py", '__version__ = "0.3.36"\n')
        z.writestr("llama_cpp/py.typed", "")
        for name, data in libs.items():
            for suffix in ("", ".0", ".0.25.3"):
                z.writestr(f"llama_cpp/lib/{name}{suffix}", data)
                z.writestr(f"lib/{name}{suffix}", data)
        z.writestr("include/llama.h", "/* header */")
        z.writestr("lib/cmake/llama/llama-config.cmake", "")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                    "Tag: py3-none-linux_x86_64\n")
        z.writestr(f"{dist}/RECORD", "stale,,\n")


def test_slim_wheel_keeps_one_copy_of_each_library_and_a_true_record(tmp_path):
    import base64
    import hashlib
    import zipfile

    from scripts.gpu_check import slim_wheel

    src, dst = tmp_path / "in.whl", tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    _fake_llama_wheel(src)
    before, after = slim_wheel.slim(src, dst)
    assert after < before
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        assert {n for n in names if n.startswith("llama_cpp/lib/")} == {
            "llama_cpp/lib/libllama.so", "llama_cpp/lib/libllama.so.0", "llama_cpp/lib/libggml.so",
            "llama_cpp/lib/libggml.so.0", "llama_cpp/lib/libggml-base.so.0", "llama_cpp/lib/libggml-cuda.so.0"}
        assert not [n for n in names if n.startswith(("lib/", "include/"))]
        assert {"llama_cpp/__init__.py", "llama_cpp/py.typed"} <= names
        record = z.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode().splitlines()
        assert len(record) == len(names) and "llama_cpp_python-0.3.36.dist-info/RECORD,," in record
        for line in record:
            name, digest, size = line.rsplit(",", 2)
            if digest:
                data = z.read(name)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                    b"=").decode() and int(size) == len(data)
    site = tmp_path / "site"              # pip takes it as it is
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(site), str(dst)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (site / "llama_cpp" / "lib" / "libggml-cuda.so.0").read_bytes() == b"C" * 9000
    with pytest.raises(ValueError, match="not a wheel"):
        zipfile.ZipFile(tmp_path / "bare.zip", "w").close()
        slim_wheel.slim(tmp_path / "bare.zip", tmp_path / "out.whl")
