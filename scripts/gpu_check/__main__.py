"""The gpu_check command line: the steps in order, each guarded, inside one time budget.

Run as a folder (`python3 scripts/gpu_check`) from a source tree, the tree's root goes on the
path and `import scripts` maps the metatp packages onto their folders (`scripts/_source_tree.py`);
`--pytest ARGS` runs pytest under that same mapping, `--mpi-rank ARGS` is one rank of step 6 and
`--serve [--emulate] ARGS` is `metatp serve ARGS` (the throughput section's server; on the kernel
emulator with --emulate).
"""

from __future__ import annotations

import sys

if not __package__:                   # run as a folder or file: no installed metatp needed
    from pathlib import Path

    _here = Path(__file__).resolve().parent
    # Python put this folder first on the path: its modules (profile.py) would shadow the standard
    # library's (pytest's cProfile imports `profile`); they are imported as scripts.gpu_check.*
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent.parent))
    import scripts  # noqa: F401,E402  (registers the source-tree mapping)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every check passed on a GPU (or on the emulator with --emulate)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--pytest"]:          # the GPU tests, importable from a source tree
        import pytest

        return int(pytest.main(argv[1:]))
    if argv[:1] == ["--mpi-rank"]:        # one rank of step 6 (started by the mpi step)
        from metatp.testing import mpi_rank

        return mpi_rank.main(argv[1:])
    if argv[:1] == ["--serve"]:           # `metatp serve` from this tree (the throughput section's server)
        from scripts.gpu_check.throughput import serve_main

        return serve_main(argv[1:])
    args = _parser().parse_args(argv)
    from scripts.gpu_check.config import Budget, Config

    skip = set(filter(None, args.skip.split(",")))
    if args.plan:                          # the real GPU's estimates, whatever --emulate says
        return print_plan(Config(n_layer=args.layers, big=args.big, variants=variant_names(args.variants),
                                 shapes=shape_names(args.shapes)), skip, args.budget, args.isolate is not False)
    cfg = Config.dry_run(args.layers) if args.emulate else Config(n_layer=args.layers)
    cfg.big = args.big
    cfg.variants = variant_names(args.variants)
    cfg.shapes = shape_names(args.shapes)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.part:
        return child_main(args, cfg, skip)
    isolate = (not args.emulate) if args.isolate is None else args.isolate
    return run(cfg, Budget(args.budget), skip, args.workdir, args.out, child_flags(args) if isolate else None)


def variant_names(text: str) -> tuple[str, ...]:
    """`--variants default,before`: the names, checked against variants.VARIANTS (a ConfigError names them)."""
    from scripts.gpu_check.variants import by_names

    return tuple(v.name for v in by_names([n for n in text.split(",") if n]))


def shape_names(text: str) -> tuple[str, ...]:
    """`--shapes 135M,1B`: the names, checked against shapes.SHAPES."""
    from metatp.ir.errors import ConfigError
    from scripts.gpu_check.shapes import SHAPES

    names = tuple(n for n in text.split(",") if n)
    known = [s.name for s in SHAPES]
    if unknown := [n for n in names if n not in known]:
        raise ConfigError(f"unknown shape {', '.join(unknown)}; gpu_check knows {', '.join(known)}")
    return names


def print_plan(cfg, skip: set[str], budget_s: float, isolate: bool = True) -> int:
    """`--plan`: the estimated seconds of each section on the GPU against the budget; 0 when it fits."""
    from scripts.gpu_check.plan import estimate, plan_text

    estimates = estimate(cfg, skip, part_names(cfg, skip, split_shapes=True) if isolate else None)
    print(plan_text(estimates, budget_s))
    return 0 if sum(e.seconds for e in estimates) <= budget_s else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="metatp's cupy backend checked end to end on a GPU")
    ap.add_argument("--out", type=Path, default=None, help="markdown file for the results (a .json copy too)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds the whole run may take (about 7 minutes)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the synthetic model (30 = SmolLM2-135M)")
    ap.add_argument("--skip", default="",
                    help="comma-separated sections to skip: kernels,model,speed,profile,shapes,llama-cpp,throughput,nccl,mpi")
    ap.add_argument("--big", action="store_true",
                    help="the shapes and throughput sections also run Llama-3-8B shapes in Q4_K (a 4.5 GB file, "
                         "~2.5 minutes each)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the synthetic GGUF goes (default: a temp dir)")
    ap.add_argument("--emulate", action="store_true",
                    help="dry run without a GPU: the CPU kernel emulator and a tiny model")
    ap.add_argument("--variants", default="default,before,q8,pdl",
                    help="the decode kernel variants the shapes and profile sections compare (variants.py); one "
                         "the tree's cupy backend does not take is skipped with a row saying so")
    ap.add_argument("--shapes", default="135M,1B,8B",
                    help="the model sizes the shapes and profile sections run (8B only with --big)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="run each part (kernels, model, each model size, llama-cpp, throughput, nccl, mpi) in a "
                         "process of its own, so a kernel fault that poisons the CUDA context costs one part "
                         "(default: on with a GPU, off with --emulate)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)       # a part's process (isolate.py)
    ap.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prior", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0-offset", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--plan", action="store_true",
                    help="print each section's estimated seconds on the H200 for these flags against --budget, "
                         "and stop (exit 1 when over)")
    return ap


#: the section a part's rows belong to (a part that dies is one FAIL row there)
PART_SECTIONS = {"kernels": "kernels", "model": "model", "shapes": "speed", "llama-cpp": "llama-cpp",
                 "throughput": "throughput", "nccl": "nccl", "mpi": "mpi"}


def part_names(cfg, skip: set[str], split_shapes: bool) -> list[str]:
    """The parts after the preflight and environment rows, in run order; with `split_shapes` one
    part a model size (`shapes:1B`), so that each runs in a process of its own."""
    from scripts.gpu_check.shapes import shapes_to_run

    out = [p for p in ("kernels",) if p not in skip]
    if {"model", "speed"} - skip:
        out.append("model")
    if {"shapes", "profile"} - skip:
        sizes = [s.name for s in shapes_to_run(cfg)] if split_shapes else []
        out += [f"shapes:{name}" for name in sizes] or ["shapes"]
    out += [p for p in ("llama-cpp", "throughput") if p not in skip]
    if "nccl" not in skip and not cfg.emulate:
        out.append("nccl")
    return out + [p for p in ("mpi",) if p not in skip]


def section_of(part: str) -> str:
    return PART_SECTIONS[part.partition(":")[0]]


def run_part(part: str, rep, cfg, budget, skip: set[str], workdir: Path | None) -> None:
    """One part's sections, each step in its own try/except (a failure is a row, the rest goes on)."""
    from scripts.gpu_check import allreduce, kernels, llama_cpp, model, ranks, shapes, speed, throughput
    from scripts.gpu_check.isolate import hand_on_if_lost

    step = rep.step

    def folder(prefix: str) -> Path:
        return workdir or Path(tempfile.mkdtemp(prefix=f"metatp-gpu-{prefix}-"))

    name, _, detail = part.partition(":")
    if name == "kernels":           # `kernels:g1,g2`: those groups (what a faulted process left)
        step("kernels", "kernel checks", kernels.section_kernels, rep, cfg, detail.split(",") if detail else None)
    elif name == "model":           # `model:layer,speed`: those sections (what a faulted process left)
        loaded = step("model", "synthetic GGUF", lambda: model.write_model(rep, cfg, folder("check")))
        sections = [("checks", "model", "model checks", model.section_model),
                    ("layer", "model", "-sm layer check", model.section_layer),
                    ("speed", "speed", "speed checks", speed.section_speed)]
        todo = [row for row in sections if row[1] not in skip and (not detail or row[0] in detail.split(","))]
        for i, (_, section, what, fn) in enumerate(todo if loaded is not None else ()):
            failures = rep.failures()
            step(section, what, fn, rep, cfg, loaded, budget)
            if hand_on_if_lost(rep, cfg, rep.failures() > failures, section, what, "model",
                               [key for key, *_ in todo[i + 1:]]):
                break
    elif name == "shapes":          # the model sizes' decode rows and kernel profiles; `shapes:1B[:q8,pdl]`
        size, _, left = detail.partition(":")      # one size [the variants a faulted process left of it]
        step("speed", "model sizes", lambda: shapes.section_shapes(
            rep, cfg, budget, folder("shapes"), decode="shapes" not in skip, profile="profile" not in skip,
            only=size or None, resume=tuple(left.split(",")) if left else None))
    elif name == "llama-cpp":       # after shapes: its rows hold metatp's numbers
        step("llama-cpp", "llama.cpp beside metatp", lambda: llama_cpp.section_llama_cpp(
            rep, cfg, budget, folder("llama-cpp")))
    elif name == "throughput":      # `throughput:prompts,serve,8B`: those parts (what a faulted process left)
        step("throughput", "throughput", lambda: throughput.section_throughput(
            rep, cfg, budget, folder("throughput"), tuple(detail.split(",")) if detail else None))
    elif name == "nccl":
        step("nccl", "NCCL checks", allreduce.section_nccl, rep)
    elif name == "mpi":
        step("mpi", "MPI+NCCL smoke", ranks.section_mpi, rep, cfg, budget, workdir)
    else:
        raise ValueError(f"unknown part {part!r}")


def run(cfg, budget, skip: set[str], workdir: Path | None, out: Path | None, child_args: list[str] | None = None) -> int:
    """The preflight and environment rows, then every part not in `skip`: in this process, or with
    `child_args` (the run's settings as flags) each part in a process of its own (`isolate.py`);
    the table written at the end."""
    from scripts.gpu_check import env, preflight
    from scripts.gpu_check.report import Report, write_outputs

    rep = Report()

    step = rep.step

    # `timeout` around the run sends SIGTERM: end as after the last part, so the report is still written
    previous = signal.signal(signal.SIGTERM, _terminated)
    have_gpu = False
    try:
        ready = step("preflight", "preflight", preflight.preflight, rep, cfg)
        if not ready:
            rep.add("preflight", "verdict", "a requirement is missing (lines above): stopping here", False)
        else:
            have_gpu = bool(step("env", "environment", env.section_env, rep, cfg))
        if have_gpu:
            if child_args is None:
                for part in part_names(cfg, skip, split_shapes=False):
                    run_part(part, rep, cfg, budget, skip, workdir)
            else:
                _run_isolated(rep, cfg, budget, skip, child_args)
    except SystemExit as e:
        rep.add("total", "stopped", f"by a signal (exit status {e.code}: `timeout`?); the rows so far are kept", False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rep.add("total", "wall time", f"{time.perf_counter() - rep.t0:.0f} s", None)
    write_outputs(rep, out)
    return 0 if (rep.passed and have_gpu) else 1


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _run_isolated(rep, cfg, budget, skip: set[str], child_args: list[str]) -> None:
    """Each part in a process of its own, with the time left (a part that dies: one FAIL row)."""
    from scripts.gpu_check.isolate import CHILD_START_S, run_child

    rows_dir = Path(tempfile.mkdtemp(prefix="metatp-gpu-parts-"))
    parts = collections.deque(part_names(cfg, skip, split_shapes=True))
    rep.add("env", "parts", f"each in a process of its own: {', '.join(parts)}", None)
    while parts:
        part = parts.popleft()
        left = budget.left()
        if left < CHILD_START_S:
            rep.add(section_of(part), part, f"skipped (time budget: {left:.0f} s left)", None)
            continue
        argv = [sys.executable, str(Path(__file__).resolve().parent), *child_args, "--part", part,
                "--budget", f"{left:.1f}"]
        _, resume = run_child(rep, part, section_of(part), argv, left, rows_dir)
        parts.extendleft(reversed(resume))      # what a faulted part left, next, in a fresh process


def child_main(args, cfg, skip: set[str]) -> int:
    """`--part NAME`: one part with `--budget` seconds, its rows streamed to `--rows` (the parent
    reads them back), after the rows so far from `--prior` (read by parts that compare with them)."""
    from scripts.gpu_check.config import Budget
    from scripts.gpu_check.isolate import RowSink
    from scripts.gpu_check.report import Report

    rep = Report(t0=time.perf_counter() - args.t0_offset)
    if args.prior is not None:
        rep.rows = json.loads(args.prior.read_text(encoding="utf-8"))
    rep.sink = RowSink(args.rows)
    try:
        run_part(args.part, rep, cfg, Budget(args.budget), skip, args.workdir)
    finally:
        rep.sink.finish(rep)
    return 0


def child_flags(args) -> list[str]:
    """The run's settings as flags for a part's process (what `Config` and the sections read)."""
    flags = ["--layers", str(args.layers), "--skip", args.skip, "--variants", args.variants, "--shapes", args.shapes]
    flags += ["--big"] * args.big + ["--emulate"] * args.emulate
    return flags + (["--workdir", str(args.workdir)] if args.workdir else [])


if __name__ == "__main__":
    sys.exit(main())
