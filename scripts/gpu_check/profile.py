"""Step 4b: where a decode step's time goes, kernel by kernel (N=1, the speed section's engine).

The first GPU run timed whole steps only (792 tokens/s with the CUDA graph, 5.2 us a launch
on average), which cannot say which kernels hold the step. Here each launch of the decode
step is captured alone into two CUDA graphs of `few` and `many` copies of it back to back
(`Config.profile_copies`), and each graph is replayed and synchronized: (t_many - t_few) /
(many - few) is the launch's time inside a graph, the graph launch and the synchronization
cancelling out. The launches run on
the step's own buffers after a real decode step, so the shapes and data are the real ones
(in-place kernels repeat on their own output: the timing, not the values, is what is kept;
the engine is thrown away afterwards). The sum over the step's launches against the step's
own replay says whether the kernels or the gaps between them hold the step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from scripts.gpu_check.config import Budget, Config, cupy_engine
from scripts.gpu_check.report import Report
from scripts.gpu_check.speed import time_decode

TOP = 12                # kernels listed as rows (all of them go to the written table)


@dataclass
class LaunchTime:
    """One launch of the step: its kernel, geometry and time inside a graph."""

    name: str
    grid: tuple
    block: tuple
    seconds: float


def step_name(step) -> str:
    return getattr(step, "name", None) or type(step).__name__


def _graph_of(rt, dev, step, copies: int):
    with dev.ctx:
        rt.synchronize(dev.stream)
        rt.begin_capture(dev.stream)
        try:
            for _ in range(copies):
                step()
        finally:
            graph = rt.end_capture(dev.stream)
    return graph


def _replay_seconds(rt, dev, graph, tries: int = 3) -> float:
    """The fastest of `tries` replays of `graph`, each synchronized."""
    best = float("inf")
    with dev.ctx:
        rt.launch_graph(graph, dev.stream)                 # warm: the graph's first upload
        rt.synchronize(dev.stream)
        for _ in range(tries):
            t0 = time.perf_counter()
            rt.launch_graph(graph, dev.stream)
            rt.synchronize(dev.stream)
            best = min(best, time.perf_counter() - t0)
    return best


def launch_times(ex, budget: Budget, few: int, many: int) -> list[LaunchTime]:
    """The launches of a one-device executable, each timed alone inside a graph (see the module),
    in step order; it stops early, with the launches timed so far, when the run's budget runs low."""
    rt, dev = ex.rt, ex.devs[ex.devices[0]]
    out = []
    for per_dev in ex.steps:
        for step in per_dev[ex.devices[0]]:
            if budget.left() < 20:
                return out
            t_few = _replay_seconds(rt, dev, _graph_of(rt, dev, step, few))
            t_many = _replay_seconds(rt, dev, _graph_of(rt, dev, step, many))
            out.append(LaunchTime(step_name(step), tuple(getattr(step, "grid", ())), tuple(getattr(step, "block", ())),
                                  max(t_many - t_few, 0.0) / (many - few)))
    return out


def by_kernel(times: list[LaunchTime]) -> list[tuple[str, int, float, LaunchTime]]:
    """(kernel, launches, total seconds, its slowest launch), the largest total first."""
    groups: dict[str, list[LaunchTime]] = defaultdict(list)
    for t in times:
        groups[t.name].append(t)
    rows = [(name, len(ts), sum(t.seconds for t in ts), max(ts, key=lambda t: t.seconds)) for name, ts in groups.items()]
    return sorted(rows, key=lambda r: -r[2])


def table(times: list[LaunchTime]) -> str:
    """Markdown: every kernel with its launches, total, and its slowest launch's geometry."""
    total = sum(t.seconds for t in times) or 1.0
    lines = ["| kernel | launches | µs a step | share | slowest launch µs | its grid | its block |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, n, s, worst in by_kernel(times):
        lines.append(f"| {name} | {n} | {s * 1e6:.1f} | {100 * s / total:.1f}% | {worst.seconds * 1e6:.2f} | "
                     f"{worst.grid} | {worst.block} |")
    return "\n".join(lines)


def section_profile(rep: Report, cfg: Config, model, budget: Budget) -> None:
    """Rows: per KV length, the sum of the step's launches against the step's replay, then the
    kernels taking most of it; the full table goes to the written report."""
    for kv_len in cfg.kv_lengths:
        label = f"decode step kernels, KV {kv_len}"
        if budget.left() < 60:
            rep.add("profile", label, "skipped (time budget)", None)
            continue
        try:
            eng = cupy_engine(cfg, model, 4096, cuda_graphs=True)
            step = time_decode(cfg, eng, kv_len, max(4, cfg.decode_steps // 4))
            ex = step["executable"]
            times = launch_times(ex, budget, *cfg.profile_copies)
            total = sum(t.seconds for t in times)
            n_all = sum(len(per_dev[ex.devices[0]]) for per_dev in ex.steps)
            part = "" if len(times) == n_all else f" (time budget: the first {len(times)} of {n_all} launches)"
            rep.add("profile", label, f"{len(times)} launches sum to {total * 1e6:.0f} µs alone in graphs; the "
                    f"step's replay {step['us']:.0f} µs ({step['graph']}){part}", None)
            for name, n, s, worst in by_kernel(times)[:TOP]:
                rep.add("profile", f"KV {kv_len}: {name}", f"{n} launches, {s * 1e6:.1f} µs ({100 * s / max(total, 1e-12):.0f}%), "
                        f"slowest {worst.seconds * 1e6:.2f} µs at grid {worst.grid} block {worst.block}", None)
            rep.extra.append(f"### Decode step at KV {kv_len}: kernels one by one\n\n{table(times)}\n")
            del eng, ex
        except Exception as e:  # noqa: BLE001
            rep.fail("profile", label, e)


__all__ = ["LaunchTime", "launch_times", "by_kernel", "table", "section_profile"]
