"""Time the ways a MUL_MAT of a quantized weight runs, at T = 1..512 tokens, to set the
tiled kernel's token range (`kernels.mmq.MMQ_MIN_TOKENS` / `MMQ_MAX_TOKENS`, the cupy
options ``mmq_min_tokens`` / ``mmq_max_tokens``) and to see where numerics "q8"'s int8
tensor-core path (quantize + ``mmq_i8_<type>``) beats dequantize + cuBLAS:

    python -m scripts.mmq_crossover                 # on a GPU: markdown table + the suggested range
    python -m scripts.mmq_crossover --reps 20 --json out.json
    python -m scripts.mmq_crossover --emulate       # no GPU: tiny shapes, the three paths checked, untimed

The paths are the ones `matvec._run_mul_mat` records: "matvec" (launched 8 tokens at a time),
"mmq" (the tiled kernel) and "gemm" (dequantize to f16, convert x, one cuBLAS GEMM), the exact
numerics' choices; "mmq_h" (the tiled kernel's f16 tiles on the tensor cores, the cupy option
``mmq_tensor_cores``: the GEMM path's operand rounding without its f16 copy of the weight); and
"mmq_i8" (numerics "q8": x rounded to Q8 blocks by q8_quantize, then the int8 mma.sync kernel;
checked against the float64 product of the rounded x). Shapes: the
Llama-3.2-1B projections (Q8_0) and the Llama-3-8B FFN (Q4_K), as in ``tools/gpu_check``'s shapes.
Each row is the median of ``--reps`` timed runs after one warm-up (CUDA events).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from metatp.backends.cuda.kernels.dequant import dequantize
from metatp.backends.cuda.kernels.elementwise import copy
from metatp.backends.cuda.kernels.matvec import matvec
from metatp.backends.cuda.kernels.mmq import MMQ_Q8_KIND, mmq, mmq_q8, q8_acts_empty
from metatp.backends.cuda.launch import WEIGHT_TYPES, device_ptr

__all__ = ["PATHS", "EXACT_PATHS", "F16_PATHS", "TOKENS", "SHAPES", "crossover", "suggest", "suggest_tensor_cores",
           "suggest_int8", "disagreeing", "markdown", "main"]

#: the exact numerics' paths (what `suggest` compares), the f16 tensor-core tiles (`suggest_tensor_cores`)
#: and numerics "q8"'s int8 path
EXACT_PATHS = ("matvec", "mmq", "gemm")
PATHS = EXACT_PATHS + ("mmq_h", "mmq_i8")
#: the paths whose operands are rounded to f16 (their error against the exact product is f16's)
F16_PATHS = ("gemm", "mmq_h")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: (label, n_rows, ne0, weight type)
SHAPES = (("1B q/o 2048x2048", 2048, 2048, "q8_0"), ("1B gate/up 8192x2048", 8192, 2048, "q8_0"),
          ("1B down 2048x8192", 2048, 8192, "q8_0"), ("8B gate/up 14336x4096", 14336, 4096, "q4_k"))
_EMU_SHAPES = (("tiny q8_0 70x64", 70, 64, "q8_0"), ("tiny q4_k 20x256", 20, 256, "q4_k"),
               ("tiny q4_1 9x96", 9, 96, "q4_1"))
_EMU_TOKENS = (1, 9, 17)

# where each type keeps its f16 scale fields (byte offsets in a block): set to sane values so a
# random block decodes to finite numbers
_SCALE_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def _timing_weight(rng: np.random.Generator, wtype: str, n_rows: int, ne0: int) -> np.ndarray:
    """Random raw blocks with small f16 scales: fast to make at 8B sizes, finite when decoded."""
    qk, nbytes = WEIGHT_TYPES[wtype]
    if wtype in ("f32", "f16"):
        return rng.standard_normal((n_rows, ne0)).astype(np.float32 if wtype == "f32" else np.float16).view(np.uint8)
    raw = rng.integers(0, 256, (n_rows, ne0 // qk, nbytes), dtype=np.uint8)
    for off in _SCALE_FIELDS[wtype]:
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(n_rows, -1)


class _Paths:
    """The three paths on one runtime (CupyRuntime or EmuRuntime), with the GEMM path's scratch."""

    def __init__(self, rt, xp, max_tokens: int, shapes) -> None:
        self.rt, self.xp = rt, xp
        self.wbuf = rt.empty((max(r * k for _, r, k, _ in shapes),), np.float16)
        self.xbuf = rt.empty((max_tokens * max(k for _, _, k, _ in shapes),), np.float16)
        self.stream = xp.cuda.get_current_stream() if xp is not np else None

    def run(self, path: str, w, wtype: str, x, y, ne0: int, n_rows: int, acts=None) -> None:
        if path == "matvec":
            matvec(w, wtype, x, y, ne0=ne0, n_rows=n_rows)
        elif path in ("mmq", "mmq_h"):
            mmq(w, wtype, x, y, ne0=ne0, n_rows=n_rows, tensor_cores=path == "mmq_h")
        elif path == "mmq_i8":
            mmq_q8(w, wtype, x, y, acts, ne0=ne0, n_rows=n_rows)
        else:
            n_tok = x.shape[0]
            w2 = self.wbuf[: n_rows * ne0].reshape(n_rows, ne0)
            x2 = self.xbuf[: n_tok * ne0].reshape(n_tok, ne0)
            dequantize(w, wtype, w2, ne0=ne0, n_rows=n_rows)
            copy(x, x2)
            self.rt.gemm(n_rows, n_tok, ne0, device_ptr(w2), device_ptr(x2), device_ptr(y), n_rows, "f16",
                         self.stream, 0)


def _time_us(xp, run, reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        e0, e1 = xp.cuda.Event(), xp.cuda.Event()
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(xp.cuda.get_elapsed_time(e0, e1) * 1000.0)
    return float(np.median(times))


def crossover(*, emulate: bool = False, reps: int = 10, tokens=None, shapes=None, seed: int = 0) -> list[dict]:
    """One row per (shape, T): each path's time in µs (None when emulated) and its max
    relative error against the float64 product (the three paths must agree to be compared)."""
    from metatp.testing.kernel_checks.mmq import ref_mmq_q8
    from metatp.testing.oracles import make_weight, rel_err

    if emulate:
        from metatp.testing import EmuRuntime

        rt, xp = EmuRuntime(), np
    else:
        import cupy as cp

        from metatp.backends.cuda.runtime import CupyRuntime

        rt, xp = CupyRuntime(), cp
    tokens = tuple(tokens or (_EMU_TOKENS if emulate else TOKENS))
    shapes = tuple(shapes or (_EMU_SHAPES if emulate else SHAPES))
    rng = np.random.default_rng(seed)
    paths = _Paths(rt, xp, max(tokens), shapes)
    host = (lambda a: a) if xp is np else xp.asnumpy
    rows = []
    with rt.kernels():
        for label, n_rows, ne0, wtype in shapes:
            if emulate:
                raw, deq = make_weight(rng, wtype, n_rows, ne0)
                w = raw
            else:               # a big random weight: the reference reads its own f32 decoding (on the GPU)
                raw = _timing_weight(rng, wtype, n_rows, ne0)
                w = xp.asarray(raw)
                deq = rt.empty((n_rows, ne0), np.float32)
                dequantize(w, wtype, deq, ne0=ne0, n_rows=n_rows)
            deq64 = xp.asarray(deq).astype(np.float64)
            for n_tok in tokens:
                x_host = rng.standard_normal((n_tok, ne0)).astype(np.float32)
                x = xp.asarray(x_host)
                refs = {"exact": host(x.astype(np.float64) @ deq64.T)}
                acts = None
                if wtype in MMQ_Q8_KIND:
                    refs["q8"] = host(ref_mmq_q8(wtype, MMQ_Q8_KIND[wtype], raw, deq64, x_host, xp=xp))
                    acts = q8_acts_empty(MMQ_Q8_KIND[wtype], n_tok, ne0)
                row = {"shape": label, "type": wtype, "tokens": n_tok}
                for path in PATHS:
                    if path == "mmq_i8" and acts is None:
                        row[f"{path}_err"] = row[f"{path}_us"] = None
                        continue
                    y = xp.full((n_tok, n_rows), np.nan, np.float32)
                    paths.run(path, w, wtype, x, y, ne0, n_rows, acts)
                    row[f"{path}_err"] = rel_err(host(y), refs["q8" if path == "mmq_i8" else "exact"])
                    row[f"{path}_us"] = None if emulate else _time_us(
                        xp, lambda p=path, y=y: paths.run(p, w, wtype, x, y, ne0, n_rows, acts), reps)
                rows.append(row)
    return rows


def _wins(rows: list[dict], winner: str, rivals: tuple[str, ...]) -> tuple[int, int] | None:
    """(first, last) token count where `winner` beats every rival on every shape, or None
    (untimed rows, or no such count)."""
    wins: dict[int, bool] = {}
    for r in rows:
        times = {p: r.get(f"{p}_us") for p in (winner, *rivals)}
        if any(t is None for t in times.values()):
            return None
        best = min(times, key=times.get)
        wins[r["tokens"]] = wins.get(r["tokens"], True) and best == winner
    won = [t for t in sorted(wins) if wins[t]]
    return (won[0], won[-1]) if won else None


def suggest(rows: list[dict]) -> tuple[int, int] | None:
    """(mmq_min_tokens, mmq_max_tokens) where the tiled kernel is the fastest of the exact
    numerics' paths for every shape, or None (untimed rows, or no count where it wins everywhere)."""
    return _wins(rows, "mmq", ("matvec", "gemm"))


def suggest_tensor_cores(rows: list[dict]) -> tuple[int, int] | None:
    """The token counts (first, last) where the tiled kernel on the tensor cores (option
    mmq_tensor_cores) beats every exact path on every shape (the range mmq_min_tokens /
    mmq_max_tokens should take with the option on), or None."""
    return _wins(rows, "mmq_h", EXACT_PATHS)


def suggest_int8(rows: list[dict]) -> tuple[int, int] | None:
    """The token counts (first, last) where numerics "q8"'s int8 path beats dequantize + cuBLAS
    and the f32 tiled kernel on every shape (the crossover `mmq.use_int8_mmq` should follow), or None."""
    return _wins(rows, "mmq_i8", ("mmq", "gemm"))


def disagreeing(rows: list[dict]) -> list[tuple[dict, str]]:
    """(row, path) where a path's result is off its reference by more than it may be: f16 operands on
    the GEMM path and the tensor-core tiles (their error grows like sqrt(ne0) * 2^-11), f32 sums
    elsewhere. A path that has no result (mmq_i8 for a type without an int8 kernel) is not counted."""
    def bound(path: str) -> float:
        return 3e-3 if path in F16_PATHS else 1e-5 * math.sqrt(8192)
    return [(r, p) for r in rows for p in PATHS if r.get(f"{p}_err") is not None and not r[f"{p}_err"] <= bound(p)]


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | type | T | matvec µs | mmq µs | gemm µs | mmq_h µs | mmq_i8 µs | fastest exact | "
             "max rel err (mv/mmq/gemm/h/i8) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = {p: r.get(f"{p}_us") for p in PATHS}
        cells = ["-" if v is None else f"{v:.1f}" for v in t.values()]
        exact = {p: t[p] for p in EXACT_PATHS}
        fastest = "-" if None in exact.values() else min(exact, key=exact.get)
        errs = "/".join("-" if r.get(f"{p}_err") is None else f"{r[f'{p}_err']:.1e}" for p in PATHS)
        lines.append(f"| {r['shape']} | {r['type']} | {r['tokens']} | {' | '.join(cells)} | {fastest} | {errs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="timed runs per cell (median)")
    ap.add_argument("--tokens", type=int, nargs="*", help=f"token counts (default {' '.join(map(str, TOKENS))})")
    ap.add_argument("--emulate", action="store_true", help="the CPU emulator: tiny shapes, checked, untimed")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = crossover(emulate=args.emulate, reps=args.reps, tokens=args.tokens)
    print(markdown(rows))
    bad = disagreeing(rows)
    s, sh, s8 = suggest(rows), suggest_tensor_cores(rows), suggest_int8(rows)
    print(f"\nsuggested mmq_min_tokens, mmq_max_tokens: {s[0]}, {s[1]}" if s else
          "\nno suggestion (untimed, or the tiled kernel is not the fastest for every shape at any T)")
    print(f"mmq_tensor_cores: the f16 tensor-core tiles are the fastest on every shape for T = {sh[0]}..{sh[1]}"
          if sh else "mmq_tensor_cores: no range (untimed, or the f16 tiles are not the fastest everywhere at any T)")
    print(f"numerics q8: the int8 path is the fastest on every shape for T = {s8[0]}..{s8[1]}" if s8 else
          "numerics q8: no int8 crossover (untimed, or the int8 path is not the fastest everywhere at any T)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "suggested": s, "tensor_cores_fastest": sh, "int8_fastest": s8}, f, indent=1)
    if bad:
        print(f"{len(bad)} path results disagree with the reference", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
