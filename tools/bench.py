"""`metatp bench`: throughput in llama-bench's shape (pp512, tg128, tg128 @ d2048).

Every combination of the comma-separated options gets a row with tokens/s as mean ± std over
`-r` repetitions. Tensor-parallel rows also show their speed relative to the single-device row of
the same test measured in the same invocation, as llama.cpp's PR tables do. With
`--compare llama-cpp` (and llama-cpp-python importable) the same tests run through llama.cpp in
the same invocation, their repetitions interleaved with metatp's, and every row shows its ratio
to llama.cpp's row of the same test.

Every row also carries the communication its split implies, as `metatp dump` bills it, per
token and per 512-token prompt (`bench_comm`: tensor, the all-reduce bytes of the busiest rank;
layer, the hidden state's copies at the device boundaries), so the trade-off between the modes
is beside the measured speed.

Under `mpiexec -n N metatp bench ... -sm tensor` (or `-sm layer`; one process per device) the
world size is the device count (`--devices` may be left out or must equal it). The split rows
run on every rank in lock step; the single-device baseline (and `--compare llama-cpp`) run on
rank 0 alone while the other ranks sleep in a barrier, so the rows are the same as in one
process. Rank 0 prints the table once, with two more columns: the mean wall time this rank
spent inside `MPI_Allreduce` (tensor rows) or its MPI sends / receives of the hidden state
(layer rows) per call (us) and per token (ms) during the timed runs (it includes waiting for
the slower rank and the zero-fill / staging copy of the buffer; not the logits' Allgatherv or
broadcast, nor the token broadcast). t/s and peak memory are rank 0's.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from metatp.tools import llamacpp
from metatp.tools.bench_comm import add_stage_args, format_bytes, modelled_communication, parse_modes, stage_layouts

__all__ = ["BenchConfig", "run_bench", "check_world", "add_parser", "format_rows", "MPI_COLUMNS", "COPY_COLUMNS",
           "COMM_COLUMNS"]


@dataclass
class BenchConfig:
    model: str | None = None
    n_prompt: list[int] = field(default_factory=lambda: [512])
    n_gen: list[int] = field(default_factory=lambda: [128])
    n_depth: list[int] = field(default_factory=lambda: [0])
    repetitions: int = 5
    backend: str = "auto"
    n_devices: list[int] = field(default_factory=lambda: [1])
    split_mode: list[str] = field(default_factory=lambda: ["none"])
    tensor_split: list[tuple[float, ...] | None] = field(default_factory=lambda: [None])
    pp: int | None = None         # -sm layer,tensor rows: stages x devices per stage (bench_comm)
    tp: int | None = None
    seed: int = 0
    interleave: bool = False      # build every layout first, alternate repetitions between them
    numerics: list[str] = field(default_factory=lambda: ["exact"])
    compare: str | None = None    # "llama-cpp": the same tests through llama-cpp-python, interleaved
    # KV cache types (llama-bench's -ctk / -ctv); None: the backend's default (numpy f32, CuPy f16);
    # a -ctv of None follows -ctk
    cache_type_k: list[str | None] = field(default_factory=lambda: [None])
    cache_type_v: list[str | None] = field(default_factory=lambda: [None])


def _int_list(text: str) -> list[int]:
    from metatp.ir.errors import ConfigError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in vals):
        raise ConfigError(f"values must be >= 0, got {text!r}")
    return vals


def _layouts(cfg: BenchConfig) -> list[tuple[int, str, tuple[float, ...] | None]]:
    """Distinct (n_devices, split_mode, tensor_split); a single-device baseline joins any tensor run."""
    out = []
    for n, sm, ts in itertools.product(cfg.n_devices, cfg.split_mode, cfg.tensor_split):
        if ts is not None:
            n = len(ts)
        if sm == "none":
            n, ts = 1, None
        key = (n, sm, ts)
        if key not in out:
            out.append(key)
    if any(sm != "none" for _, sm, _ in out) and (1, "none", None) not in out:
        out.insert(0, (1, "none", None))
    return stage_layouts(out, cfg.pp, cfg.tp)


class _AllreduceTimer:
    """The MPI collective's call count and seconds summed over the timed regions only (not the
    warm-up, the reset or the depth prefill), from `MpiCollective.calls` / `.seconds`."""

    def __init__(self, collective) -> None:
        self.collective = collective
        self.calls = 0
        self.seconds = 0.0
        self._mark = (0, 0.0)

    def begin(self) -> None:
        self._mark = (self.collective.calls, self.collective.seconds)

    def end(self) -> None:
        self.calls += self.collective.calls - self._mark[0]
        self.seconds += self.collective.seconds - self._mark[1]

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def _time_prompt(eng, tokens: list[int], depth: list[int], timer: _AllreduceTimer | None = None) -> float:
    eng.reset()
    if depth:
        eng.forward(depth)
    if timer:
        timer.begin()
    t0 = time.perf_counter()
    eng.forward(tokens)
    dt = time.perf_counter() - t0
    if timer:
        timer.end()
    return dt


def _time_gen(eng, n_gen: int, depth: list[int], first: int, timer: _AllreduceTimer | None = None) -> float:
    eng.reset()
    eng.forward(depth or [first])
    tok = first
    if timer:
        timer.begin()
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(eng.forward([tok])))
    dt = time.perf_counter() - t0
    if timer:
        timer.end()
    return dt


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _decode_allreduces(eng, backend) -> dict:
    """Row fields for one decode step's all-reduces: how many, the algorithm the backend runs and
    the bytes its schedule moves on the busiest rank (collectives.allreduce_bytes)."""
    from metatp.backends.collectives import allreduce_bytes
    from metatp.ir.models import BatchSpec

    plan, _ = eng.plan_for(BatchSpec(1, eng.kv_span(1, 1), 1))     # the plan decode runs
    info = backend.describe()
    strategy, wire, thresholds = info.allreduce, info.wire, info.wire_thresholds
    # MPI ranks: MPICH / Open MPI run recursive doubling for short vectors, billed as the butterfly
    billed = "butterfly" if strategy == "mpi" else strategy
    per_rank = 0
    if strategy != "none":
        per_rank = sum(allreduce_bytes(billed, len(r.devices or range(plan.n_devices)), r.nbytes // 4, wire, thresholds)[0]
                       for r in plan.reductions)
    return {"reductions_per_token": int(plan.stats.get("reductions_per_step", 0)),
            "allreduce": strategy, "allreduce_bytes_per_token": per_rank}


def _n_ctx(cfg: BenchConfig) -> int:
    return max([p + d for p in cfg.n_prompt for d in cfg.n_depth] + [g + d + 1 for g in cfg.n_gen for d in cfg.n_depth]
               + [16])


def _setup(cfg: BenchConfig, n_dev: int, sm: str, ts, numerics: str = "exact", ctk: str | None = None,
           ctv: str | None = None, distributed: str = "none") -> tuple:
    """(engine, the row fields that describe the setup) for one layout; distributed="mpi": this
    rank's part of it (one device per rank)."""
    from metatp.api import LLM

    kv = {k: v for k, v in (("cache_type_k", ctk), ("cache_type_v", ctv)) if v is not None}
    llm = LLM(cfg.model, n_ctx=_n_ctx(cfg), backend=cfg.backend, n_devices=n_dev, split_mode=sm,
              tensor_split=list(ts) if ts else None, seed=cfg.seed, numerics=numerics, distributed=distributed, **kv)
    tensors = llm.engine.tensors
    info = llm.backend.describe()
    kernels = info.kernels if info.kernel_threads is not None else ""     # the CPU kernels' build, or "off"
    base = {
        "model_filename": str(llm.model_path), "model_type": f"{llm.model.arch} {llm.model.name}",
        "backend": info.name, "n_devices": n_dev, "split_mode": sm,
        "tensor_split": "/".join(f"{x:g}" for x in ts) if ts else "",
        "n_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""), "cpu_kernels": kernels, "numerics": numerics,
        "type_k": tensors.kv_type.name.lower(), "type_v": tensors.kv_type_v.name.lower(),
        **_decode_allreduces(llm.engine, llm.backend),
        **modelled_communication(llm),
    }
    return llm.engine, base


COMPARE = ("llama-cpp",)


def _compare_setup(cfg: BenchConfig, model_path: str) -> tuple:
    """(llama.cpp engine, its row fields): default llama.cpp settings (f16 KV cache, no flash
    attention), the kernel thread count metatp uses."""
    from metatp.backends.numpy.native import default_threads
    from metatp.ir.errors import ConfigError

    try:
        kernels = llamacpp.version()
    except llamacpp.ComparisonFailed as e:
        raise ConfigError(str(e)) from None
    threads = default_threads()
    eng = llamacpp.LlamaCppEngine(model_path, _n_ctx(cfg), threads)
    base = {"model_filename": model_path, "model_type": "llama.cpp", "backend": "llama.cpp",
            "n_devices": 1, "split_mode": "none", "tensor_split": "", "n_threads": str(threads),
            "cpu_kernels": kernels, "numerics": "llama.cpp",
            "type_k": "f16", "type_v": "f16", "reductions_per_token": 0, "allreduce": "none", "allreduce_bytes_per_token": 0,
            "comm_bytes_per_token": 0, "comm_bytes_per_prompt": 0, "comm_prompt_tokens": 512}
    return eng, base


def _draw(test: tuple[int, int, int], rng, vocab: int) -> list[int]:
    """The random tokens one run of a test feeds (the prompt, or the first decode token)."""
    n_prompt = test[0]
    if n_prompt:
        return [int(x) for x in rng.integers(0, vocab, n_prompt)]
    return [int(rng.integers(0, vocab))]


def _measure(eng, test: tuple[int, int, int], depth_ids: list[int], rng, vocab: int,
             timer: _AllreduceTimer | None = None) -> float:
    """tokens/s of one run of a test."""
    n_prompt, n_gen, _ = test
    toks = _draw(test, rng, vocab)
    if n_prompt:
        return n_prompt / _time_prompt(eng, toks, depth_ids, timer)
    return n_gen / _time_gen(eng, n_gen, depth_ids, toks[0], timer)


# ---------------------------------------------------------------- one process per device (mpiexec)


@dataclass
class _Slot:
    """One setup of a group. Under MPI a tensor-parallel layout runs on every rank ("world"); the
    single-device baseline and llama.cpp run on rank 0 alone ("root"; engine None elsewhere)."""

    engine: object | None
    base: dict | None
    layout: tuple | None              # None: llama.cpp
    scope: str = "world"
    timer: _AllreduceTimer | None = None


def _wait(world) -> None:
    """A barrier that sleeps instead of spinning: the ranks idling while rank 0 runs alone leave
    it the CPU (MPICH's blocking calls busy-poll)."""
    if world is None:
        return
    req = world.comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _on_root(world, build):
    """build() on rank 0 alone (None on the other ranks, which wait asleep). A MetatpError it
    raises is raised on every rank, marked as every rank's, so rank 0 prints it once and no rank
    is left waiting for it."""
    from metatp.backends.distributed import every_rank
    from metatp.ir.errors import MetatpError

    if world is None:
        return build()
    result, err = None, None
    if world.is_root:
        try:
            result = build()
        except MetatpError as e:
            err = e
    _wait(world)
    if world.comm.bcast(err is not None, root=0):
        raise every_rank(err if err is not None else MetatpError("rank 0 failed"))
    return result


def check_world(cfg: BenchConfig, world) -> None:
    """Under mpiexec the world size is the device count: every --devices and -ts must say so, and
    -sm must include tensor or layer (the -sm none baseline joins on rank 0). Errors every rank raises."""
    from metatp.backends.distributed import every_rank
    from metatp.ir.errors import ConfigError

    for n in cfg.n_devices:
        world.layout_for(n, "tensor", None)
    for ts in cfg.tensor_split:
        if ts is not None:
            world.layout_for(None, "tensor", ts)
    if not {"tensor", "layer", "layer,tensor"} & set(cfg.split_mode):
        raise every_rank(ConfigError(
            f"mpiexec started {world.size} processes but -sm is {','.join(cfg.split_mode)}: under mpiexec "
            "bench measures -sm tensor or -sm layer across the processes (the -sm none baseline runs on "
            "rank 0); add -sm tensor or -sm layer, or run -sm none without mpiexec"))


def _slot(cfg: BenchConfig, lay: tuple, world) -> _Slot:
    if world is None:
        return _Slot(*_setup(cfg, *lay), lay)
    if lay[1] == "none":
        built = _on_root(world, lambda: _setup(cfg, *lay))
        return _Slot(*(built or (None, None)), lay, scope="root")
    eng, base = _setup(cfg, *lay, distributed="mpi")
    coll = eng.backend.collective if hasattr(eng, "backend") else None
    if lay[1] == "layer":           # no all-reduce: time the sends / receives of the hidden state
        coll = getattr(coll, "send_recv", None)
    timer = _AllreduceTimer(coll) if hasattr(coll, "seconds") else None
    return _Slot(eng, base, lay, timer=timer)


def _compare_slot(cfg: BenchConfig, model_path: str | None, world) -> _Slot:
    built = _on_root(world, lambda: _compare_setup(cfg, model_path))
    return _Slot(*(built or (None, None)), None, scope="world" if world is None else "root")


def _vocab(slots: list[_Slot], world) -> int:
    """The vocabulary size, rank 0's (the others may hold no engine in this group)."""
    vocab = next((s.engine.model.hparams.n_vocab for s in slots if s.layout is not None and s.engine is not None),
                 None)
    return vocab if world is None else world.comm.bcast(vocab, root=0)


def _run_slot(slot: _Slot, test, depth_ids, rng, vocab: int, world) -> float | None:
    """One run of a test on a slot, in lock step: every rank draws the same tokens; a root slot
    runs on rank 0 while the others wait (asleep) for it."""
    if slot.engine is None:
        _draw(test, rng, vocab)
        ts = None
    elif slot.timer is not None:
        ts = _measure(slot.engine, test, depth_ids, rng, vocab, slot.timer)
    else:
        ts = _measure(slot.engine, test, depth_ids, rng, vocab)
    if world is not None and slot.scope == "root":
        _wait(world)
    return ts


def _allreduce_fields(slot: _Slot, test: tuple[int, int, int], reps: int) -> dict:
    """Mean MPI_Allreduce wall time per call (us) and per token (ms) over the timed runs; for a
    -sm layer row the same of its sends / receives (copy_*)."""
    t = slot.timer
    out = {"allreduce_us_per_call": None, "allreduce_ms_per_token": None, "copy_us_per_call": None,
           "copy_ms_per_token": None}
    if t is None or t.calls == 0:
        return out
    kind = "copy" if slot.layout is not None and slot.layout[1] == "layer" else "allreduce"
    tokens = (test[0] or test[1]) * reps
    return dict(out, **{f"{kind}_us_per_call": t.seconds / t.calls * 1e6,
                        f"{kind}_ms_per_token": t.seconds / tokens * 1e3})


def run_bench(cfg: BenchConfig, progress=None, world=None) -> list[dict]:
    """Measure every combination; returns llama-bench-style rows (dicts).

    Layouts run one after another (each freed before the next), or with `cfg.interleave` all are
    built first and every repetition visits each in turn, so a machine whose speed drifts
    (a shared VM) moves all of them alike and the ratios between them stay meaningful. With
    `cfg.compare`, llama.cpp joins every group as one more setup (so its repetitions interleave
    with those of the rows it is compared with).

    `world` (a `backends.distributed.World`): this process is one rank of an mpiexec run; every
    rank must call this with the same config (rank 0's is used). The rows come back on rank 0
    (an empty list on the others); tensor-parallel rows carry allreduce_us_per_call /
    allreduce_ms_per_token, layer rows copy_us_per_call / copy_ms_per_token (None elsewhere)."""
    from metatp.ir.errors import ConfigError

    if world is not None:
        cfg = world.comm.bcast(cfg, root=0)
        check_world(cfg, world)
    if cfg.compare is not None and cfg.compare not in COMPARE:
        raise ConfigError(f"--compare: unknown program {cfg.compare!r} ({', '.join(COMPARE)})")
    is_root = world is None or world.is_root
    rng = np.random.default_rng(cfg.seed)
    kv_types = list(itertools.product(cfg.cache_type_k, cfg.cache_type_v))
    layouts = [(*lay, num, ctk, ctv) for lay in _layouts(cfg) for num in cfg.numerics for ctk, ctv in kv_types]
    tests = [(p, 0, d) for p in cfg.n_prompt if p > 0 for d in cfg.n_depth] + \
            [(0, g, d) for g in cfg.n_gen if g > 0 for d in cfg.n_depth]
    groups = [layouts] if cfg.interleave else [[lay] for lay in layouts]
    rows: list[dict] = []
    for gi, group in enumerate(groups):
        slots = [_slot(cfg, lay, world) for lay in group]
        vocab = _vocab(slots, world)
        if cfg.compare:
            model_path = next((s.base["model_filename"] for s in slots if s.base is not None), None)
            slots.append(_compare_slot(cfg, model_path, world))
        for test in tests:
            depth_ids = [int(x) for x in rng.integers(0, vocab, test[2])]
            samples: list[list[float]] = [[] for _ in slots]
            for rep in range(cfg.repetitions + 1):          # the first run warms up (plans, weights)
                for i, slot in enumerate(slots):
                    ts = _run_slot(slot, test, depth_ids, rng, vocab, world)
                    if rep and ts is not None:
                        samples[i].append(ts)
                    if rep == 0 and slot.timer is not None:
                        slot.timer.reset()
            for slot, got in zip(slots, samples):
                if not is_root or slot.base is None:
                    continue
                row = dict(_row(slot.base, test, got), group=gi, **_allreduce_fields(slot, test, cfg.repetitions))
                if slot.layout is not None:
                    row["ctk"], row["ctv"] = slot.layout[4], slot.layout[5]   # as asked (None: the default), for the order
                rows.append(row)
                if progress:
                    progress(row)
            for slot in slots:        # every rank: the timers start over for the next test
                if slot.timer is not None:
                    slot.timer.reset()
        del slots
    order = {lay: i for i, lay in enumerate(layouts)}

    def order_key(r: dict) -> tuple:
        if r["backend"] == "llama.cpp":
            return (len(order), r["group"])
        return (order[(r["n_devices"], r["split_mode"], _ts_key(r["tensor_split"]), r["numerics"], r["ctk"],
                       r["ctv"])], 0)
    rows.sort(key=order_key)
    _add_ratios(rows)
    return rows


def _ts_key(text: str):
    return tuple(float(x) for x in text.split("/")) if text else None


def _row(base: dict, test: tuple[int, int, int], samples: list[float]) -> dict:
    n_prompt, n_gen, depth = test
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    if depth:
        name += f" @ d{depth}"
    return dict(base, test=name, n_prompt=n_prompt, n_gen=n_gen, n_depth=depth,
                avg_ts=statistics.fmean(samples), stddev_ts=statistics.pstdev(samples) if len(samples) > 1 else 0.0,
                samples_ts=samples, peak_memory_bytes=_peak_rss())


def _add_ratios(rows: list[dict]) -> None:
    """vs_none: tokens/s of a row divided by the single-device row of the same test, numerics and
    KV cache types; vs_llama_cpp (with --compare): divided by llama.cpp's row of the same test
    measured in the same group (interleaved with it)."""
    def key(r: dict) -> tuple:
        return (r["test"], r["numerics"], r.get("type_k"), r.get("type_v"))
    base = {key(r): r["avg_ts"] for r in rows if r["split_mode"] == "none" and r["backend"] != "llama.cpp"}
    ref = {(r["test"], r["group"]): r["avg_ts"] for r in rows if r["backend"] == "llama.cpp"}
    for r in rows:
        b = base.get(key(r))
        r["vs_none"] = r["avg_ts"] / b if b and r["backend"] != "llama.cpp" else None
        if ref:
            c = ref.get((r["test"], r["group"]))
            r["vs_llama_cpp"] = r["avg_ts"] / c if c else None


# Under mpiexec: rank 0's wall time inside MPI_Allreduce (-sm tensor rows) or inside its sends /
# receives of the hidden state (-sm layer rows) during the timed runs, per call and per token
MPI_COLUMNS = ("MPI_Allreduce µs/call", "MPI_Allreduce ms/tok")
COPY_COLUMNS = ("MPI Send/Recv µs/call", "MPI Send/Recv ms/tok")
# The communication the dump bills for the row's split (tools/bench_comm.py)
COMM_COLUMNS = ("comm/tok", "comm/pp512")


def format_rows(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        keys = [k for k in rows[0] if k != "samples_ts"] if rows else []
        w = csv.DictWriter(buf, fieldnames=keys + ["samples_ts"])
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r[k] for k in keys}, "samples_ts": ";".join(f"{x:.3f}" for x in r["samples_ts"])})
        return buf.getvalue()
    compare = any("vs_llama_cpp" in r for r in rows)
    # llama-bench shows type_k / type_v when they are not the default: here when any metatp row
    # has a cache other than f32
    kv_cols = any((r.get("type_k"), r.get("type_v")) != ("f32", "f32") for r in rows if r["backend"] != "llama.cpp")
    mpi_cols = any(r.get("allreduce_us_per_call") is not None for r in rows)
    copy_cols = any(r.get("copy_us_per_call") is not None for r in rows)
    head = ["model", "size", "backend", "numerics", "devices", "sm", "ts"] + (["type_k", "type_v"] if kv_cols else []) \
        + ["test", "t/s", "vs -sm none", "reductions/tok"] + list(COMM_COLUMNS) \
        + (["vs llama.cpp"] if compare else []) + (list(MPI_COLUMNS) if mpi_cols else []) \
        + (list(COPY_COLUMNS) if copy_cols else [])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for r in rows:
        size = Path(r["model_filename"]).stat().st_size / 2**20 if Path(r["model_filename"]).exists() else 0
        ratio = f"{r['vs_none']:.2f}x" if r["vs_none"] is not None else ""
        cells = [r["model_type"], f"{size:.1f} MiB", r["backend"], r["numerics"], str(r["n_devices"]), r["split_mode"],
                 r["tensor_split"]] + ([r.get("type_k", ""), r.get("type_v", "")] if kv_cols else []) \
            + [r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", ratio, str(r["reductions_per_token"]),
               format_bytes(r.get("comm_bytes_per_token")), format_bytes(r.get("comm_bytes_per_prompt"))]
        if compare:
            c = r.get("vs_llama_cpp")
            cells.append(f"{c:.2f}x" if c is not None else "")
        for shown, kind in ((mpi_cols, "allreduce"), (copy_cols, "copy")):
            if shown:
                us, ms = r.get(f"{kind}_us_per_call"), r.get(f"{kind}_ms_per_token")
                cells += [f"{us:.1f}" if us is not None else "", f"{ms:.3f}" if ms is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="llama-bench style throughput benchmark")
    b.add_argument("-m", "--model", default=None)
    b.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, comma-separated (default 512)")
    b.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma-separated (default 128)")
    b.add_argument("-d", "--n-depth", default="0", help="KV depth before each test, comma-separated")
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--backend", default="auto")
    b.add_argument("--devices", default=None,
                   help="device counts, comma-separated (default 1; under mpiexec -n N: N, the only count allowed)")
    b.add_argument("-sm", "--split-mode", default=None,
                   help="none,tensor,layer,layer+tensor (default none; under mpiexec: tensor, with the -sm none baseline on "
                        "rank 0)")
    b.add_argument("-ts", "--tensor-split", default=None, help="e.g. 3/1 or 3/1,1/1 (lists separated by commas)")
    add_stage_args(b)
    b.add_argument("-o", "--output", default="md", choices=["md", "json", "csv"])
    b.add_argument("--numerics", default="exact", help="exact,llamacpp (q8: the same as llamacpp), comma-separated")
    b.add_argument("-ctk", "--cache-type-k", default=None,
                   help="KV cache K types, comma-separated (f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1; default: the "
                        "backend's, numpy f32)")
    b.add_argument("-ctv", "--cache-type-v", default=None, help="KV cache V types, comma-separated (default: as -ctk)")
    b.add_argument("--compare", default=None, choices=list(COMPARE),
                   help="also run the tests through llama-cpp-python (if installed), interleaved, with ratios "
                        "(under mpiexec: on rank 0, while the other ranks wait)")
    b.add_argument("--interleave", action="store_true",
                   help="load every layout first and alternate repetitions between them (steadier ratios "
                        "on a machine whose speed drifts; peak memory is then the whole run's)")
    b.set_defaults(func=_cmd_bench)


def _names(text: str | None) -> list[str | None]:
    """-ctk / -ctv values: comma-separated KV cache type names, checked; [None] when not given."""
    if text is None:
        return [None]
    from metatp.ir.models.common import cache_type

    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    for n in names:
        cache_type(n)                       # a ConfigError naming the choices
    return names or [None]


def _config(args: argparse.Namespace, world) -> BenchConfig:
    """The BenchConfig the flags ask for; under mpiexec --devices defaults to the world size."""
    from metatp.ir.errors import ConfigError
    from metatp.passes.plan import DeviceLayout

    if args.repetitions < 1:
        raise ConfigError("-r must be >= 1")
    split_mode = args.split_mode or ("tensor" if world is not None else "none")
    modes = parse_modes(split_mode, args.pp, args.tp)
    ts = [DeviceLayout.parse_split(t) for t in args.tensor_split.split(",")] if args.tensor_split else [None]
    default_devices = [world.size] if world is not None else [1]
    return BenchConfig(model=args.model, n_prompt=_int_list(args.n_prompt), n_gen=_int_list(args.n_gen),
                       n_depth=_int_list(args.n_depth), repetitions=args.repetitions, backend=args.backend,
                       n_devices=_int_list(args.devices) if args.devices is not None else default_devices,
                       split_mode=modes, tensor_split=ts, pp=args.pp, tp=args.tp,
                       interleave=args.interleave, compare=args.compare,
                       numerics=[m.strip() for m in args.numerics.split(",") if m.strip()] or ["exact"],
                       cache_type_k=_names(args.cache_type_k), cache_type_v=_names(args.cache_type_v))


def _cmd_bench(args: argparse.Namespace) -> int:
    from metatp.backends.distributed import every_rank, init_world
    from metatp.ir.errors import MetatpError

    world = init_world("auto")          # None in one process; under mpiexec -n N (N > 1), this rank
    try:
        cfg = _config(args, world)
        if world is not None:
            check_world(cfg, world)     # before any model is read
    except MetatpError as e:
        if world is None:
            raise
        raise every_rank(e) from None   # same flags on every rank: rank 0 says it once
    if world is not None:
        world.quiet()
    rows = run_bench(cfg, progress=lambda r: print(f"  {r['split_mode']} x{r['n_devices']} {r['test']}: "
                                                   f"{r['avg_ts']:.2f} t/s", file=sys.stderr), world=world)
    if world is None or world.is_root:
        print(format_rows(rows, args.output))
        if args.output == "md":             # tg at depth minus tg at depth 0, when both were run
            from metatp.tools.attn_depth import attention_table
            print(attention_table(rows))
    return 0
