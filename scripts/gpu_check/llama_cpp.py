"""The `llama-cpp` section (issue 44 item 5): llama.cpp on the same GPU and the same synthetic GGUF
files as the shapes section (135M Q4_1, 1B Q8_0), a row per test beside metatp's with the ratio:

    decode 1B Q8_0 KV 128: metatp 2,345 tok/s vs llama.cpp 3,000 tok/s = 0.78x

llama.cpp is llama-cpp-python 0.3.36 built for sm_90 by scripts/gpu_check/build_llama_cpp.sh and
carried as a wheel in .whl/ (docs/gpu-results.md, "llama.cpp on the GPU"). It runs in a child
process (`llama_cpp_child`) with every layer offloaded and flash attention `auto` (llama-bench's
defaults), the image's libcublas/libcudart put on its LD_LIBRARY_PATH. metatp's numbers are the
shapes section's rows of the same run (and the speed section's prefill), so nothing is timed twice.

Skipped with a row saying why when llama_cpp is not importable or the time left is too short.
With --emulate it runs llama.cpp's CPU build (n_gpu_layers 0) on the shapes' small stand-ins if
one is installed: that exercises the files, the child and the rows, not the speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu_check.config import Budget, Config
from scripts.gpu_check.report import Report

SECTION = "llama-cpp"
CHILD = Path(__file__).with_name("llama_cpp_child.py")
BUILD_HINT = ("scripts/gpu_check/build_llama_cpp.sh: `wheel` here, or `pack` here and `device` there; "
              "docs/gpu-results.md")
SHAPE_NAMES = ("135M", "1B")          # the shapes section's sizes llama.cpp runs too (8B needs --big there)
NEED_S = {"135M": 60.0, "1B": 100.0}  # write, load, two KV depths and pp512 on an H200, with margin
_RATE = re.compile(r"^([\d,]+(?:\.\d+)?) tok/s")


@dataclass(frozen=True)
class Comparison:
    """One test measured by both: metatp's tokens/s (None: gpu_check did not measure it) and llama.cpp's."""

    check: str
    metatp: float | None
    llama_cpp: float

    def text(self) -> str:
        """`metatp 2,345 tok/s vs llama.cpp 3,000 tok/s = 0.78x`."""
        if self.metatp is None:
            return f"metatp not measured vs llama.cpp {self.llama_cpp:,.0f} tok/s"
        return (f"metatp {self.metatp:,.0f} tok/s vs llama.cpp {self.llama_cpp:,.0f} tok/s = "
                f"{self.metatp / self.llama_cpp:.2f}x")


def skip_reason(cfg: Config, budget: Budget, importable: bool) -> str | None:
    """Why the section cannot run (None: it can): no llama_cpp, or not enough time left."""
    if not importable:
        where = "its CPU build is not installed here" if cfg.emulate else "not carried in .whl/ nor built there"
        return f"skipped: llama-cpp-python is not importable ({where}; {BUILD_HINT})"
    need = 10.0 if cfg.emulate else min(NEED_S.values()) + 20
    if budget.left() < need:
        return f"skipped (time budget: {budget.left():.0f} s left, needs ~{need:.0f})"
    return None


def llama_cpp_importable() -> bool:
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def metatp_rate(rep: Report, check: str) -> float | None:
    """Tokens/s of metatp's row `check` in this run (its result starts '2,345 tok/s'), or None."""
    for r in rep.rows:
        if r["check"] == check and (m := _RATE.match(r["result"])):
            return float(m.group(1).replace(",", ""))
    return None


def cuda_library_dirs(search: list[str] | None = None) -> list[str]:
    """Folders holding libcublas.so.13 / libcudart.so.13 on this machine: the nvidia-* packages'
    (`nvidia/cu13/lib`, `nvidia/*/lib`) on the python path, then CUDA_HOME's or /usr/local/cuda's lib64."""
    roots = [Path(p) / "nvidia" for p in (sys.path if search is None else search) if p]
    candidates = []
    for root in roots:
        if root.is_dir():
            candidates += [root / "cu13" / "lib"] + sorted(root.glob("*/lib"))
    candidates.append(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64")
    found: list[str] = []
    for d in candidates:
        if any(d.glob("libcublas.so.*")) or any(d.glob("libcudart.so.*")):
            if str(d) not in found:
                found.append(str(d))
    return found


def child_env(extra_dirs: list[str]) -> dict[str, str]:
    """The child's environment: LD_LIBRARY_PATH led by `extra_dirs`; ggml's assert prints, no backtrace."""
    env = dict(os.environ)
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(extra_dirs + ([old] if old else []))
    env["GGML_NO_BACKTRACE"] = "1"
    return env


def run_child(args: dict, log: Path, timeout_s: float) -> dict:
    """Run llama_cpp_child on `args`; its stderr (llama.cpp's log) goes to `log`. The parsed result,
    with `offloaded` (layers on the GPU, in all) read from the log; a RuntimeError naming the last
    log lines when it fails."""
    from scripts.gpu_check.llama_cpp_child import offloaded_layers

    cmd = [sys.executable, str(CHILD), json.dumps(args)]
    with log.open("w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout_s,
                                  env=child_env(cuda_library_dirs()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"llama.cpp did not finish in {timeout_s:.0f} s (log: {log})") from None
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = " / ".join(line.strip() for line in text.strip().splitlines()[-4:])
        raise RuntimeError(f"llama.cpp exited with {proc.returncode}: {tail[:400]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["offloaded"] = offloaded_layers(text)
    return result


def comparisons(rep: Report, shape, qtype: str, result: dict, prefill_len: int) -> list[Comparison]:
    """llama.cpp's numbers of one shape beside metatp's rows of the same run: decode at each KV
    depth (the shapes section's `decode <name> <type> KV <n> CUDA graph`) and the prompt (the speed
    section's `prefill <n> tokens N=1`, which uses the 135M shapes)."""
    out = [Comparison(f"decode {shape} {qtype} KV {kv}", metatp_rate(rep, f"decode {shape} {qtype} KV {kv} CUDA graph"),
                      rate) for kv, rate in result["decode"].items()]
    if result.get("prefill"):
        metatp = metatp_rate(rep, f"prefill {prefill_len} tokens N=1") if shape == "135M" else None
        out.append(Comparison(f"prefill {shape} {qtype} pp{prefill_len}", metatp, result["prefill"]))
    return out


def section_llama_cpp(rep: Report, cfg: Config, budget: Budget, folder: Path) -> None:
    """Each of the 135M and 1B shapes: write its synthetic GGUF (the shapes section's, same seed),
    run llama.cpp on it in a child, and add a row per test with metatp's number and the ratio."""
    from scripts.gpu_check.fast_gguf import write_fast_gguf
    from scripts.gpu_check.shapes import SHAPES

    reason = skip_reason(cfg, budget, llama_cpp_importable())
    if reason:
        rep.add(SECTION, "llama.cpp beside metatp", reason, None)
        return
    folder.mkdir(parents=True, exist_ok=True)
    steps = cfg.shape_decode_steps
    for shape in (s for s in SHAPES if s.name in SHAPE_NAMES):
        label = f"llama.cpp {shape.name} {shape.qtype}"
        need = 10.0 if cfg.emulate else NEED_S[shape.name]
        if budget.left() < need + 20:
            rep.add(SECTION, label, f"skipped (time budget: {budget.left():.0f} s left, needs ~{need:.0f})", None)
            continue
        spec = shape.small if cfg.emulate else shape.spec
        path = folder / f"llama-cpp-{shape.name}-{shape.qtype}{'-emu' if cfg.emulate else ''}.gguf"
        try:
            write_fast_gguf(path, spec)
            args = {"model": str(path), "n_gpu_layers": 0 if cfg.emulate else -1,
                    "kv_lengths": list(cfg.shape_kv_lengths), "steps": steps, "prefill": cfg.prefill_len}
            t0 = time.perf_counter()
            result = run_child(args, path.with_suffix(".log"), max(10.0, budget.left() - 15))
            rep.add(SECTION, f"{label} load", _load_text(result, time.perf_counter() - t0),
                    _offload_ok(cfg, result))
            for c in comparisons(rep, shape.name, shape.qtype, result, cfg.prefill_len):
                rep.add(SECTION, c.check, c.text(), None)
        except Exception as e:  # noqa: BLE001 - the next shape still runs
            rep.fail(SECTION, label, e)
        finally:
            path.unlink(missing_ok=True)


def _load_text(result: dict, wall_s: float) -> str:
    off = result.get("offloaded")
    layers = f"{off[0]}/{off[1]} layers on the GPU" if off else "no offload line in its log"
    return (f"llama-cpp-python {result['version']} (GPU offload {'yes' if result['gpu_offload'] else 'no'}), "
            f"{layers}, loaded in {result['load_s']:.1f} s, n_ctx {result['n_ctx']}; {wall_s:.0f} s in all")


def _offload_ok(cfg: Config, result: dict) -> bool | None:
    """On a GPU the load passes only when llama.cpp put every layer there (else its numbers are a
    CPU's); with --emulate there is nothing to check."""
    if cfg.emulate:
        return None
    off = result.get("offloaded")
    return bool(result["gpu_offload"] and off and off[0] == off[1])
