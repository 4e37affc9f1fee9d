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

Repeated back to back, a launch finds its weights in the L2 cache (50 MB on an H100, 60 MB read on
an H200: every matrix of the 1B shapes but the output head fits), which the real step, streaming
the whole model once a token, never does: timed that way alone, the matvecs look up to 2-3x faster
than they are in the step, and the step's time would wrongly be put on the gaps between kernels.
So each launch is also timed "L2 cold", as Nsight Compute does by default: in graphs where every
copy follows a flush (a matvec reading a buffer of twice the L2, leaving it holding clean lines of
its own), less the same graphs of flushes alone. The cold time is the one the table sorts by; with
the bytes of weights each launch reads it gives each kernel's weight bandwidth, against the run's
copy bandwidth where the shapes section measured it. """

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from scripts.gpu_check.config import Budget, Config
from scripts.gpu_check.report import Report
from scripts.gpu_check.speed import time_decode



@dataclass
class LaunchTime:
    """One launch of the step: its kernel, geometry, time inside a graph with the L2 flushed before
    it (`seconds`) and with it warm from the copy before (`warm`), and the weight bytes it reads."""

    name: str
    grid: tuple
    block: tuple
    seconds: float
    warm: float | None = None
    weight_bytes: int = 0


def step_name(step) -> str:
    return getattr(step, "name", None) or type(step).__name__


def _graph_of(rt, dev, steps, copies: int):
    """A graph of `copies` times `steps` (callables launching on the device's stream), in order."""
    with dev.ctx:
        rt.synchronize(dev.stream)
        rt.begin_capture(dev.stream)
        try:
            for _ in range(copies):
                for step in steps:
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


def _per_copy(rt, dev, steps, few: int, many: int, tries: int = 3) -> float:
    """Seconds one copy of `steps` adds inside a graph: (t_many - t_few) / (many - few)."""
    t_few = _replay_seconds(rt, dev, _graph_of(rt, dev, steps, few), tries)
    t_many = _replay_seconds(rt, dev, _graph_of(rt, dev, steps, many), tries)
    return (t_many - t_few) / (many - few)


def l2_bytes(rt, gpu: int) -> int | None:
    """The GPU's L2 cache in bytes (CuPy's device attributes), None where the runtime cannot say."""
    try:
        return int(rt.cp.cuda.Device(gpu).attributes["L2CacheSize"])
    except Exception:  # noqa: BLE001 (the emulator has no `cp`)
        return None


#: a flush's matvec: Q8_0 rows of this many elements (4,352 bytes a row)
_FLUSH_NE0 = 4096


def flush_launch(rt, dev, nbytes: int):
    """A launch that reads `nbytes` (rounded to whole rows) from a buffer of its own and writes a
    few KB: a Q8_0 matvec over garbage bytes, whose result nobody reads. Read, not written, so the
    L2 it leaves behind holds clean lines, and the next launch's own traffic is all it pays for."""
    from metatp.backends.cuda.kernels.matvec import matvec
    from metatp.backends.cuda.launch import WEIGHT_TYPES, recording

    qk, block_bytes = WEIGHT_TYPES["q8_0"]
    row_bytes = _FLUSH_NE0 // qk * block_bytes
    rows = max(1, nbytes // row_bytes)
    with rt.device(dev.gpu):
        w = rt.empty((rows, row_bytes), np.uint8)
        x = rt.empty((_FLUSH_NE0,), np.float32)
        y = rt.empty((rows,), np.float32)
    with rt.kernels(), rt.device(dev.gpu), recording() as launches:
        matvec(w, "q8_0", x, y, ne0=_FLUSH_NE0, n_rows=rows)
    return launches[0]


def weight_bytes_of(ex, d: int):
    """`f(step)`: the bytes of model weights `step`'s arguments point into on device `d` (each
    array argument inside a weight counted with its own size, at most to the weight's end): what
    a product reads. A row gather (`get_rows_*`: the token embedding) reads one row of the matrix
    it is handed, so it counts nothing."""
    from metatp.backends.cuda.launch import device_ptr, is_array
    from metatp.backends.cuda.storage import RawWeight
    from metatp.ir.tensor import Flag

    spans = []
    for t, a in ex.arrays[d].items():
        if t.flags & Flag.WEIGHT:
            data = a.data if isinstance(a, RawWeight) else a
            spans.append((device_ptr(data), int(data.nbytes)))

    def bytes_of(step) -> int:
        if step_name(step).startswith("get_rows"):
            return 0
        seen, total = set(), 0
        for a in (*getattr(step, "args", ()), *getattr(step, "keep", ())):
            if not is_array(a):
                continue
            p = device_ptr(a)
            if p in seen:
                continue
            seen.add(p)
            for base, n in spans:
                if base <= p < base + n:
                    total += min(int(a.nbytes), base + n - p)
                    break
        return total
    return bytes_of


def launch_times(ex, budget: Budget, few: int, many: int, flush_bytes: int) -> list[LaunchTime]:
    """The launches of a one-device executable, each timed alone inside graphs, L2 cold and warm
    (see the module), in step order; it stops early, with the launches timed so far, when the
    run's budget runs low."""
    rt, d = ex.rt, ex.devices[0]
    dev = ex.devs[d]
    flush = flush_launch(rt, dev, flush_bytes)
    flush_s = _per_copy(rt, dev, [flush], few, many, tries=5)
    weights = weight_bytes_of(ex, d)
    out = []
    for per_dev in ex.steps:
        for step in per_dev[d]:
            if budget.left() < 20:
                return out
            warm = _per_copy(rt, dev, [step], few, many)
            cold = _per_copy(rt, dev, [flush, step], few, many) - flush_s
            out.append(LaunchTime(step_name(step), tuple(getattr(step, "grid", ())), tuple(getattr(step, "block", ())),
                                  max(cold, 0.0), max(warm, 0.0), weights(step)))
    return out


def _groups(times: list[LaunchTime]) -> dict[str, list[LaunchTime]]:
    groups: dict[str, list[LaunchTime]] = defaultdict(list)
    for t in times:
        groups[t.name].append(t)
    return groups


def by_kernel(times: list[LaunchTime]) -> list[tuple[str, int, float, LaunchTime]]:
    """(kernel, launches, total seconds L2 cold, its slowest launch), the largest total first."""
    rows = [(name, len(ts), sum(t.seconds for t in ts), max(ts, key=lambda t: t.seconds))
            for name, ts in _groups(times).items()]
    return sorted(rows, key=lambda r: -r[2])


def _bandwidth(nbytes: int, seconds: float, copy_bps: float | None) -> str:
    """`2,900 GB/s (0.68 of the copy)`; `-` where nothing (or no time) was read."""
    if not nbytes or seconds <= 0:
        return "-"
    bps = nbytes / seconds
    of_copy = f" ({bps / copy_bps:.2f} of the copy)" if copy_bps and copy_bps == copy_bps else ""
    return f"{bps / 1e9:,.0f} GB/s{of_copy}"


def table(times: list[LaunchTime], step_seconds: float | None = None, copy_bps: float | None = None) -> str:
    """Markdown: every kernel with its launches, total L2 cold, share of the kernels' sum (and, given
    the step's replay time, of the step), total L2 warm, the weights it reads and at what bandwidth
    (against the copy's, given it), and its slowest launch's geometry."""
    total = sum(t.seconds for t in times) or 1.0
    step_col = step_seconds is not None and step_seconds > 0
    groups = _groups(times)
    lines = ["| kernel | launches | µs a step | share |" + (" of the step |" if step_col else "") +
             " µs L2 warm | weights MB | weights read at | slowest launch µs | its grid | its block |",
             "| --- | ---: | ---: | ---: |" + (" ---: |" if step_col else "") +
             " ---: | ---: | ---: | ---: | --- | --- |"]
    for name, n, s, worst in by_kernel(times):
        of_step = f" {100 * s / step_seconds:.1f}% |" if step_col else ""
        warm = sum(t.warm or 0.0 for t in groups[name])
        nbytes = sum(t.weight_bytes for t in groups[name])
        lines.append(f"| {name} | {n} | {s * 1e6:.1f} | {100 * s / total:.1f}% |{of_step} {warm * 1e6:.1f} | "
                     f"{nbytes / 1e6:,.2f} | {_bandwidth(nbytes, s, copy_bps)} | {worst.seconds * 1e6:.2f} | "
                     f"{worst.grid} | {worst.block} |")
    return "\n".join(lines)


def summary(times: list[LaunchTime], step_us: float, graph: str, n_all: int, n_layer: int, top: int = 3,
            copy_bps: float | None = None) -> str:
    """`kernels sum 410 µs of a 620 µs step (whole), 250 µs with the L2 warm; top 3: matvec_q4_1 55%,
    attn_decode_f16_g3 12%, ...; weights 1,300 MB read at 2,900 GB/s (0.68 of the copy); 243
    launches/token, 8.1/layer` (with a note when the budget cut the timing short)."""
    total = sum(t.seconds for t in times)
    warm = sum(t.warm or 0.0 for t in times)
    tops = ", ".join(f"{name} {100 * s / max(total, 1e-12):.0f}%" for name, _, s, _ in by_kernel(times)[:top])
    reading = [t for t in times if t.weight_bytes]
    nbytes = sum(t.weight_bytes for t in reading)
    read_at = _bandwidth(nbytes, sum(t.seconds for t in reading), copy_bps)
    weights = f"weights {nbytes / 1e6:,.1f} MB read at {read_at}; " if nbytes else ""
    part = "" if len(times) == n_all else f" (time budget: the first {len(times)} of {n_all} launches)"
    return (f"kernels sum {total * 1e6:,.0f} µs of a {step_us:,.0f} µs step ({graph}), {warm * 1e6:,.0f} µs with "
            f"the L2 warm; top {top}: {tops}; {weights}{n_all} launches/token, "
            f"{n_all / max(n_layer, 1):.1f}/layer{part}")


def flush_size(cfg: Config, rt, gpu: int) -> int:
    """Bytes a flush reads: twice the GPU's L2 (at least 64 MiB; 128 MiB where the runtime cannot
    say), or `cfg.profile_flush_bytes` (the emulator's small stand-in)."""
    if cfg.profile_flush_bytes:
        return cfg.profile_flush_bytes
    l2 = l2_bytes(rt, gpu)
    return max(2 * l2, 64 * 2**20) if l2 else 128 * 2**20


def profile_engine(rep: Report, cfg: Config, budget: Budget, eng, label: str, kv_len: int, n_layer: int,
                   vocab: int, copy_bps: float | None = None) -> None:
    """One summary row for `eng`'s decode step at `kv_len` (section "profile", check `label`) and its
    whole kernel table in the written report. The engine's buffers are overwritten by the repeated
    launches: throw it away afterwards."""
    step = time_decode(cfg, eng, kv_len, max(2, cfg.shape_decode_steps // 4), vocab=vocab)
    ex = step["executable"]
    flush_bytes = flush_size(cfg, ex.rt, ex.devs[ex.devices[0]].gpu)
    times = launch_times(ex, budget, *cfg.profile_copies, flush_bytes=flush_bytes)
    n_all = sum(len(per_dev[ex.devices[0]]) for per_dev in ex.steps)
    rep.add("profile", label, summary(times, step["us"], step["graph"], n_all, n_layer, copy_bps=copy_bps), None)
    rep.extra.append(f"### {label}: kernels one by one\n\n{n_all} launches a token, "
                     f"{n_all / max(n_layer, 1):.1f} a layer ({n_layer} layers); the step's replay "
                     f"{step['us']:,.0f} µs ({step['graph']}), its launches alone in graphs "
                     f"{sum(t.seconds for t in times) * 1e6:,.0f} µs with the L2 flushed "
                     f"({flush_bytes / 2**20:,.0f} MiB read) before each, "
                     f"{sum(t.warm or 0.0 for t in times) * 1e6:,.0f} µs with it warm.\n\n"
                     f"{table(times, step['us'] / 1e6, copy_bps)}\n")


__all__ = ["LaunchTime", "launch_times", "by_kernel", "table", "summary", "flush_launch", "flush_size",
           "weight_bytes_of", "l2_bytes", "profile_engine"]
