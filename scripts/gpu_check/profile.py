"""Where a decode step's time goes, kernel by kernel (N=1; driven by the shapes section, per model
shape and kernel variant: `shapes.py`).

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

from scripts.gpu_check.config import Budget, Config
from scripts.gpu_check.report import Report
from scripts.gpu_check.speed import time_decode



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


def table(times: list[LaunchTime], step_seconds: float | None = None) -> str:
    """Markdown: every kernel with its launches, total, share of the kernels' sum (and, given the
    step's replay time, of the step), and its slowest launch's geometry."""
    total = sum(t.seconds for t in times) or 1.0
    step_col = step_seconds is not None and step_seconds > 0
    lines = ["| kernel | launches | µs a step | share |" + (" of the step |" if step_col else "") +
             " slowest launch µs | its grid | its block |",
             "| --- | ---: | ---: | ---: |" + (" ---: |" if step_col else "") + " ---: | --- | --- |"]
    for name, n, s, worst in by_kernel(times):
        of_step = f" {100 * s / step_seconds:.1f}% |" if step_col else ""
        lines.append(f"| {name} | {n} | {s * 1e6:.1f} | {100 * s / total:.1f}% |{of_step} {worst.seconds * 1e6:.2f} | "
                     f"{worst.grid} | {worst.block} |")
    return "\n".join(lines)


def summary(times: list[LaunchTime], step_us: float, graph: str, n_all: int, n_layer: int, top: int = 3) -> str:
    """`kernels sum 410 µs of a 620 µs step (whole); top 3: matvec_q4_1 55%, attn_decode_f16_g3 12%, ...;
    243 launches/token, 8.1/layer` (with a note when the budget cut the timing short)."""
    total = sum(t.seconds for t in times)
    tops = ", ".join(f"{name} {100 * s / max(total, 1e-12):.0f}%" for name, _, s, _ in by_kernel(times)[:top])
    part = "" if len(times) == n_all else f" (time budget: the first {len(times)} of {n_all} launches)"
    return (f"kernels sum {total * 1e6:,.0f} µs of a {step_us:,.0f} µs step ({graph}); top {top}: {tops}; "
            f"{n_all} launches/token, {n_all / max(n_layer, 1):.1f}/layer{part}")


def profile_engine(rep: Report, cfg: Config, budget: Budget, eng, label: str, kv_len: int, n_layer: int,
                   vocab: int) -> None:
    """One summary row for `eng`'s decode step at `kv_len` (section "profile", check `label`) and its
    whole kernel table in the written report. The engine's buffers are overwritten by the repeated
    launches: throw it away afterwards."""
    step = time_decode(cfg, eng, kv_len, max(2, cfg.shape_decode_steps // 4), vocab=vocab)
    ex = step["executable"]
    times = launch_times(ex, budget, *cfg.profile_copies)
    n_all = sum(len(per_dev[ex.devices[0]]) for per_dev in ex.steps)
    rep.add("profile", label, summary(times, step["us"], step["graph"], n_all, n_layer), None)
    rep.extra.append(f"### {label}: kernels one by one\n\n{n_all} launches a token, {n_all / max(n_layer, 1):.1f} a "
                     f"layer ({n_layer} layers); the step's replay {step['us']:,.0f} µs ({step['graph']}), its "
                     f"launches alone in graphs {sum(t.seconds for t in times) * 1e6:,.0f} µs.\n\n"
                     f"{table(times, step['us'] / 1e6)}\n")


__all__ = ["LaunchTime", "launch_times", "by_kernel", "table", "summary", "profile_engine"]
