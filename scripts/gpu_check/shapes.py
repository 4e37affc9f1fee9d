"""Speed at three model sizes (issue 44 item 4): SmolLM2-135M shapes in Q4_1 (launch-bound),
Llama-3.2-1B shapes in Q8_0 and Llama-3-8B shapes in Q4_K (bandwidth-bound), each a synthetic
GGUF written on the GPU machine (`fast_gguf`). A row per shape and KV length: decode tokens/s
with the CUDA graph, µs and launches a token, the bytes of weights and KV read a token, and
that traffic as a fraction of a device-to-device copy's bandwidth measured in the same run.

Each shape is measured under every kernel variant (`variants.py`: the backend's defaults, this
round's old kernels, int8 products, PDL) on the same loaded file, the default's rows first and
under the names docs/gpu-results.md and issue 44 use, the others suffixed `[name]`; the profile
section's kernel tables (`profile.py`) are taken on the same engines. Every engine and row is
guarded by its estimated seconds on an H200 (`Shape`; `plan.py` adds them up for a whole call):
a variant runs only when the time left also covers the default rows of the shapes still to come
(the first of `--variants` counts as the default there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metatp.testing.synth import SynthSpec
from scripts.gpu_check.config import Budget, Config, cupy_engine
from scripts.gpu_check.fast_gguf import tensor_plan, write_fast_gguf
from scripts.gpu_check.isolate import hand_on_if_lost
from scripts.gpu_check.profile import profile_engine
from scripts.gpu_check.report import Report
from scripts.gpu_check.speed import time_decode
from scripts.gpu_check.variants import DEFAULT, Variant, by_names, runnable

KV_BYTES = 2            # the cupy backend's default KV storage (f16)


@dataclass(frozen=True)
class Shape:
    """One model size: its name in the rows, its weights' type, the real shapes, a small stand-in
    (same head geometry ratios, widths the type's blocks divide) for the emulator, and the
    seconds its parts need on an H200 (estimates: write + load the file, build an engine with its
    upload, one decode row with its KV fill, one kernel profile) so the budget guard can skip them."""

    name: str
    qtype: str
    spec: SynthSpec
    small: SynthSpec
    write_s: float
    engine_s: float
    row_s: float
    profile_s: float
    big: bool = False        # only with --big

    @property
    def label(self) -> str:
        return f"decode {self.name} {self.qtype}"


def _llama(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, qtype, tied, embd_type=None) -> SynthSpec:
    roles = ("q", "k", "v", "o", "gate", "up", "down", "output")
    types = {r: qtype for r in roles} | {"embd": embd_type or qtype}
    return SynthSpec(arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                     n_vocab=n_vocab, n_ctx_train=8192, rope_base=500000.0, norm_eps=1e-5, tied=tied, types=types,
                     seed=0)


SHAPES = (
    Shape("135M", "Q4_1", _llama(30, 576, 9, 3, 1536, 49152, "Q4_1", True, "Q8_0"),
          _llama(2, 192, 3, 1, 128, 384, "Q4_1", True, "Q8_0"), write_s=8, engine_s=6, row_s=6, profile_s=13),
    Shape("1B", "Q8_0", _llama(16, 2048, 32, 8, 8192, 128256, "Q8_0", True),
          _llama(2, 256, 4, 1, 256, 384, "Q8_0", True), write_s=15, engine_s=8, row_s=8, profile_s=11),
    Shape("8B", "Q4_K", _llama(32, 4096, 32, 8, 14336, 128256, "Q4_K", False),
          _llama(2, 256, 4, 1, 256, 384, "Q4_K", False), write_s=50, engine_s=25, row_s=20, profile_s=20, big=True),
)
# How these were guessed: the 2026-12-04 run's speed section (30 layers, 135M shapes) did four decode
# rows, a replay check, a 512-token prefill and an N=3 engine in ~15 s; the 1B file writes in ~5 s on the
# 2-core CPU machine (8B ~20 s, 4.5 GB) and uploads at several GB/s; a KV 4096 fill is one 4096-token
# prefill (~0.1-1 s); the profile captures each launch into two graphs (~3 ms a launch, 130-250 launches)
# after a short decode run; since 2026-12-05 also into two graphs with an L2 flush before each copy, ~8 ms
# more a launch, +1 s a profile. Margins are generous: a skipped row costs less than a run cut by `timeout`.


def bytes_read_per_token(spec: SynthSpec, kv_len: int, kv_bytes: int = KV_BYTES) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode token reads: every layer weight and the output matrix
    (the embedding when tied) whole, one embedding row, and K and V of `kv_len` cells a layer."""
    weights = 0
    for t in tensor_plan(spec):
        if t.name == "token_embd.weight":
            weights += t.nbytes // spec.n_vocab * (spec.n_vocab if spec.tied else 1)
        else:
            weights += t.nbytes
    kv = 2 * spec.n_layer * kv_len * spec.n_head_kv * spec.hd * kv_bytes
    return weights, kv


def copy_bandwidth(cfg: Config, nbytes: int = 2**30) -> float:
    """Bytes a second a device-to-device copy moves (read + written), timed with events over
    5 copies after a warm-up; on the emulator a host copy of 64 MiB stands in."""
    if cfg.emulate:
        a = np.ones(64 * 2**20, np.uint8)
        b = np.empty_like(a)
        np.copyto(b, a)
        t0 = time.perf_counter()
        for _ in range(5):
            np.copyto(b, a)
        return 2 * a.nbytes * 5 / (time.perf_counter() - t0)
    import cupy as cp

    a = cp.ones(nbytes, cp.uint8)
    b = cp.empty_like(a)
    b[...] = a
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(5):
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
    stop.record()
    stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3
    del a, b
    return 2 * nbytes * 5 / seconds


def row_text(r: dict, weights: int, kv: int, copy_bps: float) -> str:
    """`2,345 tok/s (426 µs/token, 301 launches/token, 1,300 MB weights + 8 MB KV read/token =
    3,070 GB/s, 0.72 of the copy's 4,250 GB/s)`."""
    traffic = (weights + kv) * r["tok_s"]
    return (f"{r['tok_s']:,.0f} tok/s ({r['us']:,.0f} µs/token, {r['launches']} launches/token, "
            f"{weights / 1e6:,.1f} MB weights + {kv / 1e6:,.1f} MB KV read/token = {traffic / 1e9:,.1f} GB/s, "
            f"{traffic / copy_bps:.2f} of the copy's {copy_bps / 1e9:,.0f} GB/s; {r['graph']})")


def variant_need(shape: Shape, cfg: Config, variant: Variant, decode: bool, profile: bool) -> float:
    """Seconds `variant` needs on `shape`: its engine, its decode rows, its kernel profiles."""
    rows = len(cfg.shape_kv_lengths) if decode else 0
    profiles = len(cfg.profile_kv_lengths) if profile and variant.profiled and shape.name in cfg.profile_shapes else 0
    if not rows and not profiles:
        return 0.0
    return shape.engine_s + rows * shape.row_s + profiles * shape.profile_s


def shapes_to_run(cfg: Config) -> tuple[Shape, ...]:
    """The shapes `cfg` names, the --big ones only with `cfg.big`."""
    return tuple(s for s in SHAPES if s.name in cfg.shapes and (cfg.big or not s.big))


def variant_row_text(r: dict, n_layer: int, weights: int, kv: int, copy_bps: float, default_tok_s: float | None) -> str:
    """`2,345 tok/s (426 µs/token, 82 launches, 5.1 launches/layer, 61% of copy bandwidth; whole); 1.31x
    [default]` (the last part: this rate over the default variant's at the same KV length)."""
    traffic = (weights + kv) * r["tok_s"]
    ratio = f"; {r['tok_s'] / default_tok_s:.2f}x [default]" if default_tok_s else ""
    return (f"{r['tok_s']:,.0f} tok/s ({r['us']:,.0f} µs/token, {r['launches']} launches, "
            f"{r['launches'] / max(n_layer, 1):.1f} launches/layer, {100 * traffic / copy_bps:.0f}% of copy bandwidth; "
            f"{r['graph']}){ratio}")


def section_shapes(rep: Report, cfg: Config, budget: Budget, folder: Path, decode: bool = True,
                   profile: bool = True, only: str | None = None, resume: tuple[str, ...] | None = None) -> None:
    """The copy bandwidth, then each shape in turn: write, load, and per kernel variant an engine,
    its decode rows at each KV length (`decode`) and its kernel profiles (`profile`, section
    "profile"). A variant the tree's backend refuses is one info row; a shape, variant or row that no
    longer fits the time left is skipped with a row saying so; the 8B shape only with `cfg.big`.
    `only`: that shape alone (a part's process, `isolate.py`), still reserving the time of the
    shapes after it; the rows said once a run come with the first shape. `resume`: the variants a
    process that lost its GPU context left of `only` (the others' rows are in already)."""
    chosen, refused = runnable(by_names(cfg.variants))
    shapes = shapes_to_run(cfg)
    first = resume is None and (only is None or (bool(shapes) and only == shapes[0].name))
    if first:
        for name, why in refused.items():
            rep.add("speed", f"decode variant [{name}]", f"skipped: {why}", None)
        for shape in SHAPES:
            if shape.big and not cfg.big and shape.name in cfg.shapes:
                rep.add("speed", shape.label, "not run (needs --big)", None)
    if only is not None and only not in [s.name for s in shapes]:
        raise ValueError(f"shape {only!r} is not one this run measures ({', '.join(s.name for s in shapes)})")
    copy_bps = float("nan")
    if decode:
        label = "device-to-device copy bandwidth (read + written)" + (f", for the {only} rows" if only else "")
        try:
            copy_bps = copy_bandwidth(cfg)
            rep.add("speed", label, f"{copy_bps / 1e9:,.0f} GB/s", None)
        except Exception as e:  # noqa: BLE001 - the decode rows still come, their fraction 'nan'
            rep.fail("speed", label, e)
    for i, shape in enumerate(shapes):
        if only is not None and shape.name != only:
            continue
        later = sum(shape_need(s, cfg, chosen[:1], decode, profile) for s in shapes[i + 1:])
        todo = chosen if resume is None else tuple(v for v in chosen if v.name in resume)
        _one_shape(rep, cfg, budget, folder, shape, todo, decode, profile, copy_bps, later, resume is None)


def shape_need(shape: Shape, cfg: Config, variants: tuple[Variant, ...], decode: bool, profile: bool) -> float:
    """Seconds `shape` needs on an H200 with `variants`: the file, then each variant's part."""
    parts = [variant_need(shape, cfg, v, decode, profile) for v in variants]
    return shape.write_s + sum(parts) if any(parts) else 0.0


def _skip_text(budget: Budget, need: float) -> str:
    return f"skipped (time budget: {budget.left():.0f} s left, needs ~{need:.0f})"


def _one_shape(rep: Report, cfg: Config, budget: Budget, folder: Path, shape: Shape, variants: tuple[Variant, ...],
               decode: bool, profile: bool, copy_bps: float, later: float, from_first: bool = True) -> None:
    """One shape's file, then its variants in order; after the first (the default, unless --variants
    says otherwise; every one when not `from_first`, a resumed part) a variant runs only when the time
    left also covers `later`, the first variant's part of the shapes still to come. A variant that
    failed and left the GPU unusable ends this process's part: the variants left are handed on."""
    from metatp.ir.loader import load_model

    spec = shape.small if cfg.emulate else shape.spec
    need = shape_need(shape, cfg, variants[:1], decode, profile)
    if budget.left() < need:
        rep.add("speed", shape.label, _skip_text(budget, need), None)
        return
    path = folder / f"shape-{shape.name}-{shape.qtype}{'-emu' if cfg.emulate else ''}.gguf"
    try:
        t0 = time.perf_counter()
        size = write_fast_gguf(path, spec)
        t1 = time.perf_counter()
        model = load_model(path)
        rep.add("speed", f"{shape.label} model", f"{spec.n_layer} layers, {size / 2**20:,.0f} MiB written in "
                f"{t1 - t0:.1f} s, loaded in {time.perf_counter() - t1:.1f} s", None)
    except Exception as e:  # noqa: BLE001
        rep.fail("speed", f"{shape.label} model", e)
        path.unlink(missing_ok=True)
        return
    default_rates: dict[int, float] = {}
    try:
        for variant in variants:
            need = variant_need(shape, cfg, variant, decode, profile)
            if not need:
                continue
            reserve = 0.0 if from_first and variant is variants[0] else later
            if budget.left() < need + reserve:
                rep.add("speed", f"{shape.label}{variant.suffix()}", _skip_text(budget, need + reserve), None)
                continue
            failures = rep.failures()
            _one_variant(rep, cfg, budget, shape, spec, model, variant, decode, profile, copy_bps, default_rates)
            left = [v.name for v in variants[variants.index(variant) + 1:]]
            if hand_on_if_lost(rep, cfg, rep.failures() > failures, "speed", f"{shape.label}{variant.suffix()}",
                               f"shapes:{shape.name}", left):
                break
    finally:
        del model
        path.unlink(missing_ok=True)           # the next shape's file needs the disk


def _one_variant(rep: Report, cfg: Config, budget: Budget, shape: Shape, spec: SynthSpec, model, variant: Variant,
                 decode: bool, profile: bool, copy_bps: float, default_rates: dict[int, float]) -> None:
    """One engine with the variant's options: its decode rows, then its kernel profiles (which
    overwrite its buffers: the engine is dropped after them)."""
    try:
        eng = cupy_engine(cfg, model, max(cfg.shape_kv_lengths) + 256, cuda_graphs=True, **variant.options)
    except Exception as e:  # noqa: BLE001
        rep.fail("speed", f"{shape.label} engine{variant.suffix()}", e)
        return
    for kv_len in cfg.shape_kv_lengths if decode else ():
        row = f"{shape.label} KV {kv_len} CUDA graph{variant.suffix()}"
        if budget.left() < 20:
            rep.add("speed", row, "skipped (time budget)", None)
            continue
        try:
            r = time_decode(cfg, eng, kv_len, cfg.shape_decode_steps, vocab=spec.n_vocab)
            weights, kv = bytes_read_per_token(spec, kv_len)
            if variant.name == DEFAULT:
                default_rates[kv_len] = r["tok_s"]
                text = row_text(r, weights, kv, copy_bps)
            else:
                text = variant_row_text(r, spec.n_layer, weights, kv, copy_bps, default_rates.get(kv_len))
            rep.add("speed", row, text, r["graph"] == "whole")
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", row, e)
    if profile and variant.profiled and shape.name in cfg.profile_shapes:
        for kv_len in cfg.profile_kv_lengths:
            label = f"{shape.label} KV {kv_len} kernels{variant.suffix()}"
            if budget.left() < shape.profile_s:
                rep.add("profile", label, _skip_text(budget, shape.profile_s), None)
                continue
            try:
                profile_engine(rep, cfg, budget, eng, label, kv_len, spec.n_layer, spec.n_vocab, copy_bps)
            except Exception as e:  # noqa: BLE001
                rep.fail("profile", label, e)
    del eng
