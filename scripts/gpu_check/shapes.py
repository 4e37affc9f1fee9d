"""Speed at three model sizes (issue 44 item 4): SmolLM2-135M shapes in Q4_1 (launch-bound),
Llama-3.2-1B shapes in Q8_0 and Llama-3-8B shapes in Q4_K (bandwidth-bound), each a synthetic
GGUF written on the GPU machine (`fast_gguf`). A row per shape and KV length: decode tokens/s
with the CUDA graph, µs and launches a token, the bytes of weights and KV read a token, and
that traffic as a fraction of a device-to-device copy's bandwidth measured in the same run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metatp.testing.synth import SynthSpec
from scripts.gpu_check.config import Budget, Config, cupy_engine
from scripts.gpu_check.fast_gguf import tensor_plan, write_fast_gguf
from scripts.gpu_check.report import Report
from scripts.gpu_check.speed import time_decode

KV_BYTES = 2            # the cupy backend's default KV storage (f16)


@dataclass(frozen=True)
class Shape:
    """One model size: its name in the rows, its weights' type, the real shapes, a small stand-in
    (same head geometry ratios, widths the type's blocks divide) for the emulator, and the
    seconds it needs on the GPU (write, load, two KV lengths) so the budget guard can skip it."""

    name: str
    qtype: str
    spec: SynthSpec
    small: SynthSpec
    need_s: float
    big: bool = False        # only with --big


def _llama(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, qtype, tied, embd_type=None) -> SynthSpec:
    roles = ("q", "k", "v", "o", "gate", "up", "down", "output")
    types = {r: qtype for r in roles} | {"embd": embd_type or qtype}
    return SynthSpec(arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                     n_vocab=n_vocab, n_ctx_train=8192, rope_base=500000.0, norm_eps=1e-5, tied=tied, types=types,
                     seed=0)


SHAPES = (
    Shape("135M", "Q4_1", _llama(30, 576, 9, 3, 1536, 49152, "Q4_1", True, "Q8_0"),
          _llama(2, 192, 3, 1, 256, 512, "Q4_1", True, "Q8_0"), need_s=40),
    Shape("1B", "Q8_0", _llama(16, 2048, 32, 8, 8192, 128256, "Q8_0", True),
          _llama(2, 256, 4, 1, 512, 512, "Q8_0", True), need_s=60),
    Shape("8B", "Q4_K", _llama(32, 4096, 32, 8, 14336, 128256, "Q4_K", False),
          _llama(2, 256, 4, 1, 512, 512, "Q4_K", False), need_s=150, big=True),
)


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


def section_shapes(rep: Report, cfg: Config, budget: Budget, folder: Path) -> None:
    """The copy bandwidth, then each shape in turn: write, load, decode at each KV length; a shape
    that no longer fits the time left is skipped with a row saying so; the 8B one only with `cfg.big`."""
    from metatp.ir.loader import load_model

    try:
        copy_bps = copy_bandwidth(cfg)
        rep.add("speed", "device-to-device copy bandwidth (read + written)", f"{copy_bps / 1e9:,.0f} GB/s", None)
    except Exception as e:  # noqa: BLE001 - the decode rows still come, their fraction 'nan'
        rep.fail("speed", "device-to-device copy bandwidth", e)
        copy_bps = float("nan")
    kv_lengths = cfg.shape_kv_lengths
    for shape in SHAPES:
        label = f"decode {shape.name} {shape.qtype}"
        if shape.big and not cfg.big:
            rep.add("speed", label, "not run (needs --big)", None)
            continue
        spec = shape.small if cfg.emulate else shape.spec
        if not cfg.emulate and budget.left() < shape.need_s + 30:
            rep.add("speed", label, f"skipped (time budget: {budget.left():.0f} s left, needs ~{shape.need_s:.0f})",
                    None)
            continue
        path = folder / f"shape-{shape.name}-{shape.qtype}{'-emu' if cfg.emulate else ''}.gguf"
        try:
            t0 = time.perf_counter()
            size = write_fast_gguf(path, spec)
            t1 = time.perf_counter()
            model = load_model(path)
            eng = cupy_engine(cfg, model, max(kv_lengths) + 256, cuda_graphs=True)
            rep.add("speed", f"{label} model", f"{spec.n_layer} layers, {size / 2**20:,.0f} MiB written in "
                    f"{t1 - t0:.1f} s, loaded and uploaded in {time.perf_counter() - t1:.1f} s", None)
        except Exception as e:  # noqa: BLE001
            rep.fail("speed", f"{label} model", e)
            path.unlink(missing_ok=True)
            continue
        for kv_len in kv_lengths:
            row = f"{label} KV {kv_len} CUDA graph"
            if budget.left() < 20:
                rep.add("speed", row, "skipped (time budget)", None)
                continue
            try:
                r = time_decode(cfg, eng, kv_len, cfg.shape_decode_steps, vocab=spec.n_vocab)
                weights, kv = bytes_read_per_token(spec, kv_len)
                rep.add("speed", row, row_text(r, weights, kv, copy_bps), r["graph"] == "whole")
            except Exception as e:  # noqa: BLE001
                rep.fail("speed", row, e)
        del eng, model
        path.unlink(missing_ok=True)           # the next shape's file needs the disk
