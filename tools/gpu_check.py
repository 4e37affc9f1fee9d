"""One script for a session that has a GPU: metatp's cupy backend checked end to end.

    python3 tools/gpu_check.py --out gpu-results.md          # from a source tree, no install
    python3 -m metatp.tools.gpu_check --out gpu-results.md   # when metatp is installed
    python3 tools/gpu_check.py --pytest -q -m gpu tests/test_cupy_backend.py   # pytest, same import shim

Sections (each in its own try/except, so one failure does not hide the others; each
prints as it goes and the whole run stays inside --budget seconds, about 7 minutes):

0. preflight (about 10 seconds, one line per item): yaml and gguf import, numpy, CuPy,
   NVRTC and the CUDA headers CuPy compiles with, the GPU, a trivial RawKernel compiled and
   run, NCCL, free memory. On a GPU run a missing requirement (yaml, gguf, CuPy, a device, the
   trivial kernel) stops the script here, so a fresh machine fails fast and says why;
1. environment: GPU name, driver and runtime versions, CuPy, NVRTC, NCCL, cuBLAS;
2. kernels: every CUDA kernel against numpy on fresh random inputs (gpu_kernels_check);
3. model: a synthetic GGUF with the default model's shapes (SmolLM2-135M: 30 layers, n_embd
   576, 9 heads, 3 KV heads, n_ff 1536, vocab 49152, Q4_1 weights, Q8_0 token_embd; the
   real model cannot travel to the GPU machine), logits vs the numpy backend for N=1 and
   N=3 virtual devices, greedy tokens compared;
4. speed: decode tokens/s, eager vs CUDA graph, at KV lengths 128 and 2048 (N=1), CUDA graph
   replay == eager, N=3 virtual devices, prefill of 512 tokens;
5. NCCL: a 1-rank communicator, f32 and bf16 all-reduce, eagerly and inside a CUDA graph;
6. MPI+NCCL: one GPU rank under mpiexec (`mpiexec -n 1`, or an MPI singleton where there is no
   mpiexec), its NCCL communicator bootstrapped by broadcasting the unique id over MPI, the cupy
   backend owning device 0 of the world (`World.create_backend("cupy")`) generating greedy tokens
   on a small synthetic model, compared with the single-process cupy run; then the collective's
   step (f32 and bf16 wire, an inactive rank) eagerly and inside a CUDA graph. It runs in a
   subprocess bounded in time; with --emulate on the kernel emulator, NCCL replaced by the test
   stand-in that sums over MPI (`backends/testing/mpi_nccl.py`).

It prints a markdown table at the end and writes it to --out (with the full kernel table
and a JSON copy next to it). Exit status 0 when every check passed.

``--emulate`` is a dry run of this script on a machine without a GPU: the same sections
on the CPU kernel emulator with a tiny model (minutes), to catch mistakes in the script
before a GPU session spends its time on them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _register_source_packages() -> None:
    """Make `import metatp.<x>` work from a source tree without `pip install -e .`:
    setuptools maps the top-level folders ir/, passes/, backends/, tools/, cuda/ into the
    metatp package; this finder does the same mapping at import time."""
    try:
        import metatp.backends  # noqa: F401
        import metatp.tools  # noqa: F401
        return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "metatp" or m.startswith("metatp.")]:
        del sys.modules[name]
    root = Path(__file__).resolve().parent.parent
    mapping = {"metatp": root / "metatp", "metatp.ir": root / "ir", "metatp.ir.models": root / "ir" / "models",
               "metatp.passes": root / "passes", "metatp.backends": root / "backends",
               "metatp.tools": root / "tools", "metatp.cuda": root / "cuda"}

    class SourceTreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            folder = mapping.get(fullname)
            if folder is None:
                return None
            init = folder / "__init__.py"
            if init.is_file():
                return importlib.util.spec_from_file_location(fullname, init,
                                                              submodule_search_locations=[str(folder)])
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec

    sys.meta_path.insert(0, SourceTreeFinder())


_register_source_packages()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

SMOLLM2_TYPES = {r: "Q4_1" for r in ("q", "k", "v", "o", "gate", "up", "down")} | {"embd": "Q8_0"}


@dataclass
class Config:
    """What a run does: the real thing on a GPU, or a small dry run on the emulator."""

    emulate: bool = False
    n_layer: int = 30
    kv_lengths: tuple[int, ...] = (128, 2048)
    decode_steps: int = 64
    prompt_len: int = 16
    greedy_steps: int = 15
    prefill_len: int = 512

    def spec(self):
        from metatp.testing.synth import SynthSpec

        if self.emulate:       # SmolLM2's head geometry, small widths
            return SynthSpec(arch="llama", n_layer=self.n_layer, n_embd=192, n_head=6, n_head_kv=3,
                             n_ff=256, n_vocab=512, n_ctx_train=8192, rope_base=100000.0, norm_eps=1e-5,
                             tied=True, types=dict(SMOLLM2_TYPES), seed=0)
        return SynthSpec(arch="llama", n_layer=self.n_layer, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536,
                         n_vocab=49152, n_ctx_train=8192, rope_base=100000.0, norm_eps=1e-5, tied=True,
                         types=dict(SMOLLM2_TYPES), seed=0)

    def runtime(self):
        if self.emulate:
            from metatp.testing import EmuRuntime

            return EmuRuntime()
        return None

    @property
    def vocab(self) -> int:
        return self.spec().n_vocab


CFG = Config()


# ============================================================== report
@dataclass
class Report:
    """Rows of the results table, plus the environment and any tracebacks."""

    rows: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    kernel_table: str = ""
    t0: float = field(default_factory=time.perf_counter)

    def add(self, section: str, check: str, result: str, ok: bool | None) -> None:
        status = "pass" if ok else ("FAIL" if ok is False else "info")
        self.rows.append({"section": section, "check": check, "result": result, "status": status})
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section:8s} {check}: {result} ({status})", flush=True)

    def fail(self, section: str, what: str, e: BaseException) -> None:
        self.add(section, what, f"{type(e).__name__}: {e}"[:300], False)
        self.details.append(f"### {section}: {what}\n```\n{traceback.format_exc()}```")

    def markdown(self) -> str:
        lines = ["| section | check | result | status |", "| --- | --- | --- | --- |"]
        for r in self.rows:
            lines.append(f"| {r['section']} | {r['check']} | {r['result'].replace('|', '/')} | {r['status']} |")
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        return all(r["status"] != "FAIL" for r in self.rows)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# ============================================================== engines
def layout(n: int, ts=None):
    from metatp.passes.plan import DeviceLayout

    return DeviceLayout(n, "tensor" if n > 1 else "none", ts)


def cupy_engine(model, n_ctx: int, n: int = 1, ts=None, cache: str | None = None, **kw):
    """A cupy engine; `cache`: a KV cache type ("q8_0", ...) for K and V (default: the F32 graph
    cache, stored as kv_dtype)."""
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.engine import Engine

    lay = layout(n, ts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Engine(model, n_ctx, lay, CupyBackend(lay, runtime=CFG.runtime(), **kw))
    if cache is not None:
        from metatp.ir.models import ModelTensors
        from metatp.ir.models.common import cache_type

        eng.tensors = ModelTensors(model, n_ctx, cache_type(cache), cache_type(cache, "v"))
    return eng


def numpy_engine(model, n_ctx: int):
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine

    lay = layout(1)
    return Engine(model, n_ctx, lay, NumpyBackend(lay))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ============================================================== preflight
PREFLIGHT_SECONDS = 10.0


def preflight(rep: Report) -> bool:
    """One line per prerequisite, in about 10 seconds. True when the GPU run can go on (with
    --emulate: when the emulator can run; GPU items are then reported, absent or not)."""
    t_end = time.perf_counter() + PREFLIGHT_SECONDS
    state: dict = {}

    def item(name: str, fn, required: bool) -> bool:
        if time.perf_counter() > t_end:
            rep.add("preflight", name, f"skipped (preflight over {PREFLIGHT_SECONDS:.0f} s)", False if required else None)
            return False
        try:
            result, ok = fn(state)
        except Exception as e:  # noqa: BLE001 - each item says what went wrong
            result, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240], False
        if ok is False and not required:
            ok = None
        rep.add("preflight", name, result, ok)
        return ok is not False

    gpu_needed = not CFG.emulate
    ok = item("yaml", _pf_yaml, True)
    ok &= item("gguf", _pf_gguf, True)
    item("numpy", lambda st: (np.__version__, True), True)
    ok &= item("cupy", _pf_cupy, gpu_needed)
    item("nvrtc", _pf_nvrtc, gpu_needed)
    item("cuda headers", _pf_headers, gpu_needed)
    ok &= item("gpu", _pf_gpu, gpu_needed)
    ok &= item("trivial RawKernel", _pf_kernel, gpu_needed)
    item("nccl", _pf_nccl, False)
    item("free memory", _pf_memory, False)
    if CFG.emulate:
        from metatp.testing import emulator_available

        return item("kernel emulator (g++)", lambda st: ("available" if emulator_available() else "no g++",
                                                         emulator_available()), True) and bool(ok)
    return bool(ok)


def _absent(what: str) -> tuple[str, bool | None]:
    """A GPU item that cannot be had: a failure on a GPU run, a plain note with --emulate."""
    return (f"absent ({what})", None if CFG.emulate else False)


def _pf_yaml(st):
    import yaml

    return f"{yaml.__version__}", True


def _pf_gguf(st):
    from importlib.metadata import version

    import gguf  # noqa: F401 - imports yaml through gguf.metadata

    try:
        return version("gguf"), True
    except Exception:  # noqa: BLE001 - a wheel without metadata on the path
        return "imported", True


def _pf_cupy(st):
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return _absent(f"cupy not importable: {type(e).__name__}: {e}")
    st["cupy"] = cupy
    return cupy.__version__ + ("" if int(cupy.__version__.split(".")[0]) >= 14 else
                               " (13.x: None kernel arguments are not NULL; metatp passes 0 itself)"), True


def _pf_nvrtc(st):
    if "cupy" not in st:
        return _absent("no cupy")
    from cupy.cuda import nvrtc

    return ".".join(map(str, nvrtc.getVersion())), True


def _pf_headers(st):
    if "cupy" not in st:
        return _absent("no cupy")
    from cupy._core import core

    opts = core.assemble_cupy_compiler_options(())
    std = next((o for o in opts if "std=" in o), "?")
    return f"found ({std}, {len([o for o in opts if o.startswith('-I')])} include dirs)", True


def _pf_gpu(st):
    cupy = st.get("cupy")
    if cupy is None:
        return _absent("no cupy")
    if not cupy.cuda.is_available():
        return _absent("cupy sees no CUDA device")
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    st["gpus"] = rt.getDeviceCount()
    return (f"{st['gpus']} x {name} (sm {props['major']}.{props['minor']}), driver {rt.driverGetVersion()}, "
            f"runtime {rt.runtimeGetVersion()}"), True


def _pf_kernel(st):
    if "gpus" not in st:
        return _absent("no GPU")
    from metatp.backends.cuda import runtime

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        usable, why = runtime.gpu_probe()
    return (f"compiled and ran in {time.perf_counter() - t0:.1f} s" if usable else why), usable


def _pf_nccl(st):
    if "cupy" not in st:
        return _absent("no cupy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        return "not available to cupy (multi-GPU all-reduce uses the copy-and-add butterfly)", None
    return f"{nccl.get_version()}", True


def _pf_memory(st):
    if "gpus" not in st:
        return _absent("no GPU")
    cupy = st["cupy"]
    parts = []
    for g in range(st["gpus"]):
        with cupy.cuda.Device(g):
            free, total = cupy.cuda.runtime.memGetInfo()
        parts.append(f"GPU {g}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return "; ".join(parts), True


# ============================================================== sections
def section_env(rep: Report) -> bool:
    """GPU, driver, runtime, library versions. False when there is no usable GPU."""
    from metatp.backends.cuda import runtime
    from metatp.testing import emulator_available

    rep.env["python"] = sys.version.split()[0]
    rep.env["numpy"] = np.__version__
    if CFG.emulate:
        rep.env["gpu"] = "none: CPU kernel emulator (dry run)"
        rep.add("env", "gpu", rep.env["gpu"], None)
        return emulator_available()
    try:
        import cupy

        rep.env["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        rep.add("env", "cupy", f"not importable: {e}", False)
        return False
    if not runtime.gpu_available():
        rep.add("env", "GPU", "cupy sees no CUDA device", False)
        return False
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rep.env.update({"gpu": name, "gpus": rt.getDeviceCount(), "sm": f"{props['major']}.{props['minor']}",
                    "sms": props.get("multiProcessorCount"), "memory_GiB": round(props["totalGlobalMem"] / 2**30, 1),
                    "driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion()})
    try:
        from cupy.cuda import nvrtc

        rep.env["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:  # noqa: BLE001
        rep.env["nvrtc"] = f"unavailable ({type(e).__name__})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        rep.env["nccl"] = nccl.get_version() if nccl.available else "unavailable"
    except Exception as e:  # noqa: BLE001
        rep.env["nccl"] = f"unavailable ({type(e).__name__})"
    from metatp.backends.cuda.runtime import CupyRuntime

    rep.env["cublas"] = "yes" if CupyRuntime().gemm_available() else "no (prefill uses matvec)"
    for k in ("gpu", "gpus", "sm", "driver", "runtime", "cupy", "nvrtc", "nccl", "cublas"):
        rep.add("env", k, str(rep.env.get(k)), None)
    return True


def section_kernels(rep: Report, budget: Budget) -> None:
    from metatp.testing import kernel_checks as gkc

    t0 = time.perf_counter()
    results = gkc.check_all_kernels(time_reps=3, emulate=CFG.emulate)
    rep.kernel_table = gkc.markdown_table(results)
    by_group: dict[str, list[dict]] = {}
    for r in results:
        by_group.setdefault(r["name"].split(":")[0], []).append(r)
    for name, rows in by_group.items():
        bad = [r for r in rows if not r["pass"]]
        worst = max((r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None), default=None)
        res = f"{len(rows) - len(bad)}/{len(rows)} pass"
        if worst is not None:
            res += f", worst rel err {worst:.1e}"
        if bad:
            res += "; failing: " + ", ".join(f"{r['dtype']} ({r.get('error') or r.get('max_rel_err')})"
                                             for r in bad[:3])
        rep.add("kernels", name, res, not bad)
    rep.add("kernels", "time", f"{time.perf_counter() - t0:.1f} s (NVRTC compile included)", None)


def write_model(rep: Report, folder: Path, n_layer: int):
    from metatp.ir.loader import load_model
    from metatp.testing.synth import write_synthetic_gguf

    path = folder / f"smollm2-shape-{n_layer}l{'-emu' if CFG.emulate else ''}.gguf"
    t0 = time.perf_counter()
    write_synthetic_gguf(path, CFG.spec())
    rep.add("model", "synthetic GGUF", f"{n_layer} layers, {path.stat().st_size / 2**20:.0f} MiB, written in "
            f"{time.perf_counter() - t0:.1f} s", None)
    return load_model(path)


def teacher_forced(eng, ref, prompt, steps: int):
    got, want = [eng.forward(prompt)], [ref.forward(prompt)]
    for _ in range(steps):
        tok = int(np.argmax(want[-1]))
        got.append(eng.forward([tok]))
        want.append(ref.forward([tok]))
    return got, want


def greedy_report(got, want) -> tuple[str, bool]:
    """'k/n same greedy token' (+ worst rel err); a mismatch only counts where the
    reference's top two are further apart than the error."""
    same, bad = 0, 0
    for a, b in zip(got, want):
        ia, ib = int(np.argmax(a)), int(np.argmax(b))
        if ia == ib:
            same += 1
        elif b[ib] - b[ia] > 2 * np.abs(a - b).max():
            bad += 1
    worst = max(rel_err(a, b) for a, b in zip(got, want))
    return f"{same}/{len(got)} same greedy token, max rel err {worst:.1e}", bad == 0 and worst < 5e-2


def section_model(rep: Report, model, budget: Budget) -> None:
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(300, CFG.vocab, CFG.prompt_len)]
    ref = numpy_engine(model, 512)
    for n, ts, kw, label in ((1, None, {}, "N=1 (f16 KV, f16 GEMM)"),
                             (1, None, {"kv_dtype": "f32", "matmul_dtype": "f32"}, "N=1 exact (f32 KV, f32 GEMM)"),
                             (3, None, {}, "N=3 virtual devices"),
                             (3, (1.0, 2.0, 1.0), {}, "N=3 virtual, tensor_split 1,2,1"),
                             (3, (1.0, 2.0, 1.0), {"cache": "q8_0"}, "N=3 virtual, tensor_split 1,2,1, q8_0 KV cache")):
        if budget.left() < 120:
            rep.add("model", label, "skipped (time budget)", None)
            continue
        try:
            ref.reset()
            eng = cupy_engine(model, 512, n, ts, **kw)
            got, want = teacher_forced(eng, ref, prompt, CFG.greedy_steps)
            res, ok = greedy_report(got, want)
            rep.add("model", f"logits vs numpy, {label}", res, ok)
            del eng
        except Exception as e:  # noqa: BLE001
            rep.fail("model", label, e)


def decode_feed(plan, n_past: int, token: int) -> dict:
    """The engine's inputs for one decode token at position n_past."""
    inp = plan.graph.meta["inputs"]
    n_kv = plan.graph.meta["spec"].n_kv
    pos = np.array([n_past], dtype=np.int32)
    mask = np.full((1, n_kv), -np.inf, dtype=np.float32)
    mask[0, : n_past + 1] = 0.0
    feed = {inp["tokens"]: np.array([token], np.int32), inp["pos"]: pos, inp["kv_idxs"]: pos, inp["kq_mask"]: mask}
    if "out_ids" in inp:
        feed[inp["out_ids"]] = np.zeros(1, np.int32)
    return feed


def time_decode(eng, kv_len: int, steps: int | None = None) -> dict:
    """Fill the KV cache to kv_len, then time `steps` decode steps (one plan: the positions stay
    in one KV bucket). Returns tok/s of run+sync and of the engine's forward (logits to host)."""
    from metatp.engine import padded_kv
    from metatp.ir.models import BatchSpec

    steps = steps or CFG.decode_steps
    rng = np.random.default_rng(1)
    eng.reset()
    eng.backend.reset_kv()
    eng.forward([int(t) for t in rng.integers(300, CFG.vocab, kv_len)])
    spec = BatchSpec(1, padded_kv(kv_len + steps + 8, eng.n_ctx), 1)
    plan, ex = eng.plan_for(spec)
    feeds = [decode_feed(plan, kv_len + i, int(t)) for i, t in enumerate(rng.integers(300, CFG.vocab, steps + 4))]
    for f in feeds[:4]:                                 # warm-up: eager, then capture (graph mode)
        ex.run(f)
        ex.synchronize()
    t0 = time.perf_counter()
    for f in feeds[4:]:
        ex.run(f)
        ex.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    n_fwd = min(16, steps)          # the engine's sequence still holds kv_len tokens (ex.run bypasses it)
    t0 = time.perf_counter()
    for t in rng.integers(300, CFG.vocab, n_fwd):
        eng.forward([int(t)])
    fwd_s = (time.perf_counter() - t0) / n_fwd
    n_launch = sum(len(s) for per_dev in ex.steps for s in per_dev)
    return {"tok_s": 1.0 / step_s, "us": step_s * 1e6, "fwd_tok_s": 1.0 / fwd_s, "launches": n_launch,
            "graph": ex.graph_mode or "eager"}


def section_speed(rep: Report, model, budget: Budget) -> None:
    engines = {}
    for graphs in (False, True):
        try:
            engines[graphs] = cupy_engine(model, 4096, cuda_graphs=graphs)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", f"engine (cuda_graphs={graphs})", e)
    for kv_len in CFG.kv_lengths:
        for graphs, eng in engines.items():
            label = f"decode N=1 Q4_1 KV {kv_len} {'CUDA graph' if graphs else 'eager'}"
            if budget.left() < 60:
                rep.add("speed", label, "skipped (time budget)", None)
                continue
            try:
                r = time_decode(eng, kv_len)
                ok = None if not graphs else (r["graph"] == "whole")
                rep.add("speed", label, f"{r['tok_s']:.0f} tok/s ({r['us']:.0f} µs/token, {r['launches']} launches, "
                        f"{r['graph']}); with logits to host {r['fwd_tok_s']:.0f} tok/s", ok)
            except Exception as e:  # noqa: BLE001
                rep.fail("speed", label, e)
    if True in engines and False in engines and budget.left() > 45:
        try:
            a_eng, b_eng = engines[False], engines[True]
            same = True
            for eng in (a_eng, b_eng):
                eng.reset()
                eng.backend.reset_kv()
            a, b = a_eng.forward(list(range(300, 340))), b_eng.forward(list(range(300, 340)))
            same &= bool(np.array_equal(a, b))
            for _ in range(8):
                tok = int(np.argmax(a))
                a, b = a_eng.forward([tok]), b_eng.forward([tok])
                same &= bool(np.array_equal(a, b))
            rep.add("speed", "CUDA graph replay == eager (9 steps, bitwise)", "equal" if same else "DIFFERENT", same)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", "graph replay == eager", e)
    if True in engines and budget.left() > 45:
        try:
            eng = engines[True]
            eng.reset()
            eng.backend.reset_kv()
            ids = [int(t) for t in np.random.default_rng(2).integers(300, CFG.vocab, CFG.prefill_len)]
            eng.forward(ids[:8])                          # warm-up (cuBLAS handles, plans)
            eng.reset()
            eng.forward(ids)
            eng.reset()
            t0 = time.perf_counter()
            eng.forward(ids)
            dt = time.perf_counter() - t0
            rep.add("speed", f"prefill {len(ids)} tokens N=1", f"{len(ids) / dt:.0f} tok/s ({dt * 1e3:.1f} ms)", None)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", "prefill 512", e)
    engines.clear()
    if budget.left() > 60:
        try:
            eng = cupy_engine(model, 4096, 3)
            r = time_decode(eng, CFG.kv_lengths[0], max(4, CFG.decode_steps // 2))
            rep.add("speed", f"decode N=3 virtual devices KV {CFG.kv_lengths[0]} CUDA graph",
                    f"{r['tok_s']:.0f} tok/s ({r['us']:.0f} µs/token, {r['launches']} launches over 3 devices, "
                    f"{r['graph']}, all-reduce {eng.backend.allreduce_strategy})", None)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", "decode N=3 virtual", e)


def section_nccl(rep: Report) -> None:
    import cupy as cp

    from metatp.backends.cuda.runtime import CupyRuntime

    rt = CupyRuntime()
    if rt.nccl_module() is None:
        rep.add("nccl", "available", "no (cupy cannot load NCCL)", None)
        return
    comms = rt.nccl_comms([0])
    stream = rt.new_stream(0)
    x = cp.arange(4096, dtype=cp.float32)
    ref = np.arange(4096, dtype=np.float32)
    bits = (ref.view(np.uint32) >> 16).astype(np.uint16)
    b = cp.asarray(bits)
    cp.cuda.runtime.deviceSynchronize()
    with stream:
        rt.nccl_allreduce([(comms[0], x.data.ptr, x.size, "f32", stream)])
        rt.nccl_allreduce([(comms[0], b.data.ptr, b.size, "bf16", stream)])
    stream.synchronize()
    ok = np.array_equal(cp.asnumpy(x), ref) and np.array_equal(cp.asnumpy(b), bits)
    rep.add("nccl", "1-rank all-reduce f32 + bf16", "values unchanged" if ok else "WRONG values", ok)
    try:
        with stream:
            stream.begin_capture()
            try:
                rt.nccl_allreduce([(comms[0], x.data.ptr, x.size, "f32", stream)])
            finally:
                g = stream.end_capture()
            g.launch(stream=stream)
        stream.synchronize()
        ok = np.array_equal(cp.asnumpy(x), ref)
        rep.add("nccl", "1-rank all-reduce inside a CUDA graph", "ok" if ok else "WRONG values", ok)
    except Exception as e:  # noqa: BLE001
        rep.fail("nccl", "all-reduce inside a CUDA graph", e)


MPI_SMOKE_SECONDS = 150.0
MPI_SPEC = dict(n_layer=2, n_embd=192, n_head=6, n_head_kv=3, n_ff=256, n_vocab=512, seed=5,
                types=dict(SMOLLM2_TYPES))


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
        from mpi4py import MPI  # noqa: F401 - loads the MPI library
    except Exception as e:  # noqa: BLE001 - ImportError, or mpi4py without an MPI library
        return f"mpi4py not usable ({type(e).__name__}: {e}); carry the mpi4py and mpich wheels (docs/gpu-results.md)"
    return None


def mpi_command(args: list[str]) -> list[str]:
    """One rank of this script's MPI step: under mpiexec when it is on PATH, else an MPI
    singleton (mpi4py starts MPI itself in a lone process)."""
    import shutil

    rank = [sys.executable, str(Path(__file__).resolve()), "--mpi-rank", *args]
    exe = shutil.which("mpiexec")
    return [exe, "-n", "1", *rank] if exe else rank


def section_mpi(rep: Report, budget: Budget, workdir: Path | None) -> None:
    """One GPU rank under MPI with NCCL (section 6), in a subprocess bounded in time."""
    import subprocess

    missing = _mpi_missing()
    if missing is not None:
        rep.add("mpi", "1-rank MPI+NCCL smoke", f"skipped: {missing}", None if CFG.emulate else False)
        return
    limit = min(MPI_SMOKE_SECONDS, budget.left() - 10)
    if limit < 30:
        rep.add("mpi", "1-rank MPI+NCCL smoke", "skipped (time budget)", None)
        return
    from metatp.testing.synth import SynthSpec, write_synthetic_gguf

    folder = workdir or Path(tempfile.mkdtemp(prefix="metatp-gpu-check-mpi-"))
    folder.mkdir(parents=True, exist_ok=True)
    path, out = folder / "mpi-smoke.gguf", folder / "mpi-smoke"
    write_synthetic_gguf(path, SynthSpec(**MPI_SPEC))
    args = ["--model", str(path), "--out", str(out), "--smoke", "--n-gen", "8", "--n-ctx", "128"]
    if CFG.emulate:
        args.append("--emulate")
    cmd = mpi_command(args)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        rep.add("mpi", "1-rank MPI+NCCL smoke", f"timed out after {limit:.0f} s", False)
        return
    dt = time.perf_counter() - t0
    how = "mpiexec -n 1" if "mpiexec" in Path(cmd[0]).name else "MPI singleton"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        rep.add("mpi", f"1-rank MPI+NCCL smoke ({how})", f"exit {r.returncode}: {tail}"[:300], False)
        rep.details.append(f"### mpi: 1-rank smoke\n```\n{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}```")
        return
    smoke = json.loads((out / "smoke.json").read_text())
    facts = json.loads((out / "rank0.json").read_text())
    nccl = "NCCL stand-in over MPI (emulated)" if CFG.emulate else "NCCL"
    rep.add("mpi", f"world + {nccl} communicator ({how})",
            f"rank 0 of {facts['size']} on GPU {facts['gpu']}, unique id broadcast over MPI, in {dt:.1f} s", True)
    ok = smoke["same_tokens"] and smoke["logits_rel_err"] <= 1e-5
    rep.add("mpi", "greedy tokens vs single-process cupy",
            f"{len(smoke['tokens'])} tokens {'same' if smoke['same_tokens'] else 'DIFFERENT'}, logits max rel err "
            f"{smoke['logits_rel_err']:.1e}; decode graph: {', '.join(facts['graph_modes'])}", ok)
    coll = facts.get("collective", {})
    bad = [k for k, v in coll.items() if not v]
    rep.add("mpi", "collective step (f32/bf16 wire, eager/graph, inactive rank)",
            f"{len(coll) - len(bad)}/{len(coll)} ok" + (f"; failing: {', '.join(bad)}" if bad else ""),
            bool(coll) and not bad)


# ============================================================== main
def write_outputs(rep: Report, out: Path | None) -> None:
    env = ", ".join(f"{k}={v}" for k, v in rep.env.items())
    text = [f"metatp gpu_check — {time.strftime('%Y-%m-%d %H:%M:%S')}", "", f"Environment: {env}", "",
            rep.markdown(), ""]
    print("\n" + "\n".join(text), flush=True)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(text)
    if rep.kernel_table:
        body += "\n## Kernel checks\n\n" + rep.kernel_table + "\n"
    if rep.details:
        body += "\n## Failures\n\n" + "\n\n".join(rep.details) + "\n"
    out.write_text(body, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"env": rep.env, "rows": rep.rows}, indent=1, default=str),
                                        encoding="utf-8")
    print(f"wrote {out} and {out.with_suffix('.json')}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--pytest"]:          # the GPU tests, importable from a source tree
        import pytest

        return int(pytest.main(argv[1:]))
    if argv[:1] == ["--mpi-rank"]:        # one rank of section 6 (started by section_mpi)
        from metatp.testing import mpi_rank

        return mpi_rank.main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="markdown file for the results (a .json copy too)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds the whole run may take (about 7 minutes)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the synthetic model (30 = SmolLM2-135M)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: kernels,model,speed,nccl,mpi")
    ap.add_argument("--workdir", type=Path, default=None, help="where the synthetic GGUF goes (default: a temp dir)")
    ap.add_argument("--emulate", action="store_true",
                    help="dry run without a GPU: the CPU kernel emulator and a tiny model")
    args = ap.parse_args(argv)
    global CFG
    if args.emulate:
        CFG = Config(emulate=True, n_layer=min(args.layers, 2), kv_lengths=(16, 64), decode_steps=4,
                     prompt_len=12, greedy_steps=3, prefill_len=24)
    else:
        CFG = Config(n_layer=args.layers)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    skip = set(filter(None, args.skip.split(",")))
    rep = Report()
    budget = Budget(args.budget)
    try:
        ready = preflight(rep)
    except Exception as e:  # noqa: BLE001
        rep.fail("preflight", "preflight", e)
        ready = False
    have_gpu = False
    if not ready:
        rep.add("preflight", "verdict", "a requirement is missing (lines above): stopping here", False)
    else:
        try:
            have_gpu = section_env(rep)
        except Exception as e:  # noqa: BLE001
            rep.fail("env", "environment", e)
    if have_gpu and "kernels" not in skip:
        try:
            section_kernels(rep, budget)
        except Exception as e:  # noqa: BLE001
            rep.fail("kernels", "kernel checks", e)
    model = None
    if have_gpu and ({"model", "speed"} - skip):
        try:
            folder = args.workdir or Path(tempfile.mkdtemp(prefix="metatp-gpu-check-"))
            model = write_model(rep, folder, CFG.n_layer)
        except Exception as e:  # noqa: BLE001
            rep.fail("model", "synthetic GGUF", e)
    if model is not None and "model" not in skip:
        try:
            section_model(rep, model, budget)
        except Exception as e:  # noqa: BLE001
            rep.fail("model", "model checks", e)
    if model is not None and "speed" not in skip:
        try:
            section_speed(rep, model, budget)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", "speed checks", e)
    if have_gpu and "nccl" not in skip and not CFG.emulate:
        try:
            section_nccl(rep)
        except Exception as e:  # noqa: BLE001
            rep.fail("nccl", "NCCL checks", e)
    if have_gpu and "mpi" not in skip:
        try:
            section_mpi(rep, budget, args.workdir)
        except Exception as e:  # noqa: BLE001
            rep.fail("mpi", "MPI+NCCL smoke", e)
    rep.add("total", "wall time", f"{time.perf_counter() - rep.t0:.0f} s", None)
    write_outputs(rep, args.out)
    return 0 if (rep.passed and have_gpu) else 1


if __name__ == "__main__":
    sys.exit(main())
