"""`run_bench`: every test on every setup, repetitions (interleaved or not), and the rows with
their ratios to the -sm none row and to llama.cpp's."""

from __future__ import annotations

import itertools
import statistics

import numpy as np

from metatp.tools.bench.config import BenchConfig, bench_layouts
from metatp.tools.bench.setups import COMPARE
from metatp.tools.bench.slots import check_world, compare_slot, make_slot, mpi_fields, run_slot, shared_vocab
from metatp.tools.bench.timing import peak_rss

__all__ = ["run_bench", "make_row", "add_ratios"]


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
    layouts = [(*lay, num, ctk, ctv) for lay in bench_layouts(cfg) for num in cfg.numerics for ctk, ctv in kv_types]
    tests = [(p, 0, d) for p in cfg.n_prompt if p > 0 for d in cfg.n_depth] + \
            [(0, g, d) for g in cfg.n_gen if g > 0 for d in cfg.n_depth]
    groups = [layouts] if cfg.interleave else [[lay] for lay in layouts]
    rows: list[dict] = []
    for gi, group in enumerate(groups):
        slots = [make_slot(cfg, lay, world) for lay in group]
        vocab = shared_vocab(slots, world)
        if cfg.compare:
            model_path = next((s.base["model_filename"] for s in slots if s.base is not None), None)
            slots.append(compare_slot(cfg, model_path, world))
        for test in tests:
            depth_ids = [int(x) for x in rng.integers(0, vocab, test[2])]
            samples: list[list[float]] = [[] for _ in slots]
            for rep in range(cfg.repetitions + 1):          # the first run warms up (plans, weights)
                for i, slot in enumerate(slots):
                    ts = run_slot(slot, test, depth_ids, rng, vocab, world)
                    if rep and ts is not None:
                        samples[i].append(ts)
                    if rep == 0 and slot.timer is not None:
                        slot.timer.reset()
            for slot, got in zip(slots, samples):
                if not is_root or slot.base is None:
                    continue
                row = dict(make_row(slot.base, test, got), group=gi, **mpi_fields(slot, test, cfg.repetitions))
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
        return (order[(r["n_devices"], r["split_mode"], ts_key(r["tensor_split"]), r["numerics"], r["ctk"],
                       r["ctv"])], 0)
    rows.sort(key=order_key)
    add_ratios(rows)
    return rows


def ts_key(text: str):
    return tuple(float(x) for x in text.split("/")) if text else None


def make_row(base: dict, test: tuple[int, int, int], samples: list[float]) -> dict:
    n_prompt, n_gen, depth = test
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    if depth:
        name += f" @ d{depth}"
    return dict(base, test=name, n_prompt=n_prompt, n_gen=n_gen, n_depth=depth,
                avg_ts=statistics.fmean(samples), stddev_ts=statistics.pstdev(samples) if len(samples) > 1 else 0.0,
                samples_ts=samples, peak_memory_bytes=peak_rss())


def add_ratios(rows: list[dict]) -> None:
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
