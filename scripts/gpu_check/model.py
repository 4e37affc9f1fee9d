"""Step 3: a synthetic GGUF with the default model's shapes, and the cupy backend's logits
against the numpy backend's (N=1, N=3 virtual devices, uneven splits, a q8_0 KV cache, and N=1
under each kernel variant the speed rows compare), greedy tokens compared; and -sm layer over 2 devices (a peer copy between two GPUs where there are two,
else a device copy between virtual devices) against one cupy device, exact storage, 1e-5."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from metatp.testing.compare import teacher_forced
from metatp.testing.oracles import rel_err
from scripts.gpu_check.config import Budget, Config, cupy_engine, numpy_engine
from scripts.gpu_check.report import Report


def write_model(rep: Report, cfg: Config, folder: Path):
    """Write and load the synthetic model of `cfg` (one info row: its size and write time)."""
    from metatp.ir.loader import load_model
    from metatp.testing.synth import write_synthetic_gguf

    path = folder / f"smollm2-shape-{cfg.n_layer}l{'-emu' if cfg.emulate else ''}.gguf"
    t0 = time.perf_counter()
    write_synthetic_gguf(path, cfg.spec())
    rep.add("model", "synthetic GGUF", f"{cfg.n_layer} layers, {path.stat().st_size / 2**20:.0f} MiB, written in "
            f"{time.perf_counter() - t0:.1f} s", None)
    return load_model(path)


def greedy_report(got, want) -> tuple[str, bool]:
    """'k/n same greedy token' (+ worst rel err); a mismatch only counts where the
    reference's top two are further apart than the error."""
    same, bad = 0, 0
    for a, b in zip(got, want):
        ia, ib = int(np.argmax(a)), int(np.argmax(b))
        if ia == ib:
            same += 1
        elif b[ib] - b[ia] > 2 * np.abs(a - b).max():
            bad += 1
    worst = max(rel_err(a, b) for a, b in zip(got, want))
    return f"{same}/{len(got)} same greedy token, max rel err {worst:.1e}", bad == 0 and worst < 5e-2


CASES = ((1, None, {}, "N=1 (f16 KV, f16 GEMM)"),
         (1, None, {"kv_dtype": "f32", "matmul_dtype": "f32"}, "N=1 exact (f32 KV, f32 GEMM)"),
         (3, None, {}, "N=3 virtual devices"),
         (3, (1.0, 2.0, 1.0), {}, "N=3 virtual, tensor_split 1,2,1"),
         (3, (1.0, 2.0, 1.0), {"cache": "q8_0", "matmul_dtype": "f32"},
          "N=3 virtual, tensor_split 1,2,1, q8_0 KV cache (f32 GEMM) vs numpy with a q8_0 cache"))


def section_model(rep: Report, cfg: Config, model, budget: Budget) -> None:
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(300, cfg.vocab, cfg.prompt_len)]
    refs = {}
    for n, ts, kw, label in CASES:
        if budget.left() < 120:
            rep.add("model", label, "skipped (time budget)", None)
            continue
        try:
            cache = kw.get("cache", "f32")
            if cache not in refs:         # a quantized cache is compared with the same cache
                refs[cache] = numpy_engine(model, 512, cache)
            ref = refs[cache]
            ref.reset()
            eng = cupy_engine(cfg, model, 512, n, ts, **kw)
            got, want = teacher_forced(eng, ref, prompt, cfg.greedy_steps)
            res, ok = greedy_report(got, want)
            rep.add("model", f"logits vs numpy, {label}", res, ok)
            del eng
        except Exception as e:  # noqa: BLE001
            rep.fail("model", label, e)
    variant_logits(rep, cfg, model, budget, prompt, refs)


def variant_logits(rep: Report, cfg: Config, model, budget: Budget, prompt: list[int], refs: dict) -> None:
    """N=1 logits and greedy tokens of each non-default kernel variant the run measures (variants.py)
    against numpy, as the default's: a variant's speed rows mean nothing if its tokens are wrong. A
    variant the tree's backend refuses is one info row."""
    from scripts.gpu_check.variants import DEFAULT, by_names, refusal

    for variant in by_names(cfg.variants):
        if variant.name == DEFAULT:
            continue
        label = f"logits vs numpy, N=1 [{variant.name}] ({', '.join(f'{k}={v}' for k, v in variant.options.items())})"
        if (why := refusal(variant)) is not None:
            rep.add("model", label, f"skipped: {why}", None)
            continue
        if budget.left() < 120:
            rep.add("model", label, "skipped (time budget)", None)
            continue
        try:
            if "f32" not in refs:
                refs["f32"] = numpy_engine(model, 512)
            ref = refs["f32"]
            ref.reset()
            eng = cupy_engine(cfg, model, 512, 1, **variant.options)
            got, want = teacher_forced(eng, ref, prompt, cfg.greedy_steps)
            res, ok = greedy_report(got, want)
            rep.add("model", label, res, ok)
            del eng
        except Exception as e:  # noqa: BLE001
            rep.fail("model", label, e)


def section_layer(rep: Report, cfg: Config, model, budget: Budget) -> None:
    """-sm layer, N=2, -ts 1,2, exact (f32 KV, f32 GEMM) against one exact cupy device on the same
    teacher-forced path: the copies between devices (captured into the decode graph) must not
    change the logits beyond 1e-5 relative, nor any greedy token."""
    label = "-sm layer N=2 (ts 1,2) vs one device, exact"
    if budget.left() < 120:
        rep.add("model", label, "skipped (time budget)", None)
        return
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(300, cfg.vocab, cfg.prompt_len)]
    exact = {"kv_dtype": "f32", "matmul_dtype": "f32"}
    try:
        one = cupy_engine(cfg, model, 512, 1, **exact)
        two = cupy_engine(cfg, model, 512, 2, (1.0, 2.0), split_mode="layer", **exact)
        got, want = teacher_forced(two, one, prompt, cfg.greedy_steps)
        worst = max(rel_err(a, b) for a, b in zip(got, want))
        same = sum(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(got, want))
        gpus = sorted({dev.gpu for dev in two.backend.local_devices})
        how = "peer copies between GPUs" if len(gpus) > 1 else "virtual devices on one GPU"
        modes = sorted({str(ex.graph_mode) for ex in two.backend._executables.values()})
        rep.add("model", label, f"{same}/{len(got)} same greedy token, max rel err {worst:.1e} ({how}, graphs "
                f"{modes})", worst <= 1e-5 and same == len(got))
    except Exception as e:  # noqa: BLE001
        rep.fail("model", label, e)
