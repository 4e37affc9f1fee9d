"""`--plan`: the seconds each section of a gpu_check call should take on the H200, added up against
`--budget`, so a GPU session's one call can be sized before it spends device time.

The numbers are the sections' own estimates (the constants their budget guards use: `Shape`,
`speed.N1_ROWS_S`, `throughput.NEED_S`, `llama_cpp.NEED_S`) plus the measured or guessed cost of the
sections that have none (`FIXED_S`). They are upper-side guesses anchored on the 2026-12-04 run
(64 s for preflight, env, kernels, model, speed, nccl and mpi; the kernels 23.7 s of it): a section that
takes longer is cut by its guard, not by `timeout`. The device time of a call also counts the
machine's start (`START_S`) and the pip install of the carried wheels (`INSTALL_S`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scripts.gpu_check.config import Config

# seconds on an H200 of the sections without estimates of their own
FIXED_S = {"preflight": 10.0, "env": 2.0, "kernels": 40.0, "model": 30.0, "nccl": 5.0, "mpi": 25.0}
MODEL_VARIANT_S = 6.0     # the model section's logits check of one non-default kernel variant
START_S = 120.0           # the machine's start, counted in the session's device time (1-2 minutes)
INSTALL_S = 15.0          # pip install of .whl/ into /tmp/site
DEVICE_S = 900.0          # a session's device time, all calls together


@dataclass(frozen=True)
class Estimate:
    """One section's seconds on the GPU, and what they are made of."""

    section: str
    seconds: float
    what: str


def estimate(cfg: Config, skip: set[str], processes: list[str] | None = None) -> list[Estimate]:
    """The sections a call with `cfg` and `skip` runs, in run order, each with its seconds; with
    `processes` (the parts of a run that isolates them, the default on a GPU) a last line for the
    time their processes take to start."""
    from scripts.gpu_check import llama_cpp, shapes, speed, throughput
    from scripts.gpu_check.variants import by_names, runnable

    out = [Estimate(s, FIXED_S[s], "") for s in ("preflight", "env") if s not in skip]
    if "kernels" not in skip:
        out.append(Estimate("kernels", FIXED_S["kernels"], "NVRTC compile (~24 s on 2026-12-04) and every check"))
    variants, refused = runnable(by_names(cfg.variants))
    if "model" not in skip:
        others = [v.name for v in variants if v.name != "default"]
        out.append(Estimate("model", FIXED_S["model"] + MODEL_VARIANT_S * len(others),
                            f"135M file, logits vs numpy (5 cases, then N=1 for {', '.join(others) or 'no variant'}), "
                            "-sm layer check"))
    if "speed" not in skip:
        n = len(cfg.virtual_cases)
        out.append(Estimate("speed", speed.N1_ROWS_S + n * speed.VIRTUAL_ROW_S,
                            f"N=1 eager + graph rows, replay, prefill; {n} virtual-device rows"))
    decode, profile = "shapes" not in skip, "profile" not in skip
    if decode or profile:
        names = ", ".join(v.name for v in variants) + (f" (not run: {', '.join(refused)})" if refused else "")
        for shape in shapes.shapes_to_run(cfg):
            need = shapes.shape_need(shape, cfg, variants, decode, profile)
            if need:
                parts = "decode rows" * decode + " and " * (decode and profile) + "kernel profiles" * profile
                out.append(Estimate(f"shapes {shape.name}", need, f"{parts}; variants {names}"))
    if "llama-cpp" not in skip:
        if llama_cpp_carried():
            out.append(Estimate("llama-cpp", sum(llama_cpp.NEED_S.values()),
                                "llama_cpp_python is in .whl/ (its wheel, or its source built in the call)"))
        else:
            out.append(Estimate("llama-cpp", 0.0, "skips itself: no llama_cpp_python in .whl/"))
    if "throughput" not in skip:
        parts = throughput.PARTS_1B + (("prompts 8B",) if cfg.big else ())
        out.append(Estimate("throughput", sum(throughput.NEED_S[p] for p in parts), ", ".join(parts)))
    out += [Estimate(s, FIXED_S[s], "") for s in ("nccl", "mpi") if s not in skip]
    if processes:
        from scripts.gpu_check.isolate import CHILD_START_S

        out.append(Estimate("part processes", CHILD_START_S * len(processes),
                            f"{len(processes)} x ~{CHILD_START_S:.0f} s to start: {', '.join(processes)}"))
    return out


def llama_cpp_carried(root: Path | None = None) -> bool:
    """Does the checkout's `.whl/` hold llama-cpp-python (a wheel, or the source archive built in the call)?"""
    from scripts.gpu_check.carry import ROOT, WHEEL_DIR

    return any(((root or ROOT) / WHEEL_DIR).glob("llama_cpp_python-*"))


def plan_text(estimates: list[Estimate], budget_s: float) -> str:
    """The table, the total against the budget, and the call's device time (start and install included)."""
    total = sum(e.seconds for e in estimates)
    lines = ["| section | seconds on the H200 | what |", "| --- | ---: | --- |"]
    lines += [f"| {e.section} | {e.seconds:.0f} | {e.what} |" for e in estimates]
    lines.append(f"| **total** | **{total:.0f}** | against --budget {budget_s:.0f}: "
                 f"{'fits' if total <= budget_s else f'OVER by {total - budget_s:.0f} s (the guards skip the rest)'} |")
    timeout = budget_s + 30
    device = START_S + INSTALL_S + timeout
    lines += ["", f"A call with --budget {budget_s:.0f}: `timeout {timeout:.0f}` around gpu_check, timeout_s "
              f"{timeout + INSTALL_S + 15:.0f}; device time at most ~{device:.0f} s with the machine's start "
              f"(~{START_S:.0f} s), {DEVICE_S - device:.0f} s of the session's {DEVICE_S:.0f} left for a rerun."]
    return "\n".join(lines)


__all__ = ["Estimate", "FIXED_S", "estimate", "plan_text"]
