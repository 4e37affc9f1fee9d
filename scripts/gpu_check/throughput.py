"""Throughput (issue 46 item 4): many sequences a step, long prompts, and `metatp serve` on the GPU.

On the Llama-3.2-1B shapes in Q8_0 (a synthetic GGUF written here, `fast_gguf`), rows named as
the issue names them:

- `MUL_MAT 1B gate/up 8192x2048 q8_0 T=64` for the 1B projections (and the 8B FFN with --big) at T = 1..256
  tokens: each way a product of many tokens can run timed alone (`scripts/mmq_crossover`: the matvec kernel,
  the tiled kernel `mmq`, dequantize + cuBLAS, the tiled kernel's f16 tiles on the tensor cores `mmq_h`,
  numerics q8's int8 tiles), then `many-token products, 1B Q8_0`: where the tiled kernel (f32, on the tensor
  cores, int8) is the fastest on every shape, against the default range (issue 46 item 2's crossover). Where
  the tensor-core tiles won (else where the f32 tiles' range differs from the default), the batched-bench rows
  at B = 64 and 256 run once more with that choice (`... B=64 [mmq_h 9..256]`, with its ratio to the
  default's row); where the int8 tiles are the fastest at T = 64, B = 64 once more with numerics q8 (`... [q8]`);
- `batched-bench 1B Q8_0 PP 128 TG 32 B=b` for B = 1, 8, 64, 256: llama-batched-bench's S_PP,
  S_TG and S (`metatp.tools.batched_bench.run_config`, every plan compiled in an untimed run
  first), then `S_TG B=64 / B=1, 1B Q8_0` and `S_TG B=256 / B=1, 1B Q8_0` (targets 25x, 60x);
- the same row at B=64 with `LLM(batch_invariant=True)` (`... B=64 batch_invariant`) and
  `S_TG B=64 batch_invariant / default, 1B Q8_0`: what batch invariance costs (issue 46 item 5);
- `pp512 1B Q8_0` and `pp4096 1B Q8_0`: one prompt's prefill tokens/s (target 50k for pp512);
  with --big the same for the Llama-3-8B shapes in Q4_K (`pp512 8B Q4_K`, target 10k);
- `serve 64 concurrent vs serial, 1B Q8_0`: 64 greedy 128-token completions through `metatp serve
  --backend cupy` (a subprocess: `python3 scripts/gpu_check --serve ...`) with the official
  `openai` client, all at once and one after another; aggregate completion tokens/s of each and
  their ratio (target 20x). One after another runs as many of the 64 as the time left allows (its
  rate is per request, the same for 16 as for 64); the row says how many.

Nothing is asserted: the rows are measurements (`info`), a failure is a FAIL row. Every part
checks the time left first and says `skipped (time budget ...)` when it does not fit.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from scripts.gpu_check.config import Budget, Config, cupy_llm
from scripts.gpu_check.fast_gguf import write_fast_gguf
from scripts.gpu_check.isolate import hand_on_if_lost
from scripts.gpu_check.report import Report
from scripts.gpu_check.shapes import SHAPES

__all__ = ["section_throughput", "serve_command", "serve_main"]

SECTION = "throughput"
#: seconds each part needs on the H200 (estimates; the budget guard skips a part that does not fit)
NEED_S = {"crossover": 20, "bench": 120, "tuned": 60, "invariant": 45, "prompts": 40, "prompts 8B": 150, "serve": 90}


def _shape(name: str):
    return next(s for s in SHAPES if s.name == name)


def _model_file(cfg: Config, shape, folder: Path) -> Path:
    """The shape's GGUF; on the emulator a one-layer stand-in narrower than `shape.small` (the
    section runs hundreds of steps there)."""
    path = folder / f"throughput-{shape.name}-{shape.qtype}{'-emu' if cfg.emulate else ''}.gguf"
    small = shape.small
    spec = replace(small, n_layer=1, n_embd=small.n_embd // 2, n_ff=small.n_ff // 2) if cfg.emulate else shape.spec
    write_fast_gguf(path, spec)
    return path


def _rate(x: float) -> str:
    """Tokens a second: thousands separated on a GPU, three digits on the emulator."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


#: the section's parts on the 1B file, in order (`throughput:prompts,serve` runs those alone)
PARTS_1B = ("crossover", "bench", "tuned", "invariant", "prompts", "serve")


def section_throughput(rep: Report, cfg: Config, budget: Budget, folder: Path,
                       parts: tuple[str, ...] | None = None) -> None:
    """The 1B shapes' batched-bench rows, long prompts and the serve comparison, then (--big) the
    8B shapes' long prompts; each part skipped with a row when the time left is short. `parts`: those
    of PARTS_1B alone (what a process that lost its GPU context left; the 8B prompts come after them).
    A part that fails and leaves the GPU unusable hands the parts left on (`Report.resume`)."""
    todo = PARTS_1B if parts is None else tuple(p for p in PARTS_1B if p in parts)
    one_b = _shape("1B")
    label = f"{one_b.name} {one_b.qtype}"
    if todo and not _fits(rep, cfg, budget, f"throughput {label}", NEED_S[todo[0]]):
        return
    path = _model_file(cfg, one_b, folder) if todo else None
    s_tg: dict[int, float] = {}
    measured: dict[str, tuple[int, int] | None] = {}
    try:
        for i, part in enumerate(todo):
            failures = rep.failures()
            if part == "crossover":
                measured = _crossover_rows(rep, cfg, budget, label)
            elif part == "bench":
                s_tg = _bench_rows(rep, cfg, budget, path, label)
            elif part == "tuned":
                _tuned_rows(rep, cfg, budget, path, label, measured, s_tg)
            elif part == "invariant":
                _invariant_rows(rep, cfg, budget, path, label, s_tg)
            elif part == "prompts":
                _prompt_rows(rep, cfg, budget, path, label, NEED_S["prompts"])
            else:
                _serve_rows(rep, cfg, budget, path, label)
            _free_device_memory(cfg)
            if hand_on_if_lost(rep, cfg, rep.failures() > failures, SECTION, part, "throughput",
                               [*todo[i + 1:], "8B"]):
                return
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
    if parts is not None and "8B" not in parts:
        return
    big = _shape("8B")
    label = f"{big.name} {big.qtype}"
    if not cfg.big:
        rep.add(SECTION, f"pp {label}", "not run (needs --big)", None)
        return
    if not _fits(rep, cfg, budget, f"pp {label}", NEED_S["prompts 8B"]):
        return
    path = _model_file(cfg, big, folder)
    try:
        _prompt_rows(rep, cfg, budget, path, label, 30)
    finally:
        path.unlink(missing_ok=True)


def _fits(rep: Report, cfg: Config, budget: Budget, what: str, need: float) -> bool:
    if cfg.emulate or budget.left() >= need:
        return True
    rep.add(SECTION, what, f"skipped (time budget: {budget.left():.0f} s left, needs ~{need:.0f})", None)
    return False


# ---------------------------------------------------------------- many-token products
def _crossover_rows(rep: Report, cfg: Config, budget: Budget, label: str) -> dict[str, tuple[int, int] | None]:
    """Each way a MUL_MAT of many tokens runs, timed alone on the 1B projections (the 8B FFN with
    --big; the emulator's tiny shapes, untimed, there): a row per (shape, T), a FAIL row for a path
    off its reference, then where the tiled kernel (f32, on the tensor cores) and the int8 tiles are the
    fastest on every shape. Returns those ranges ({"mmq" / "mmq_h" / "int8": (lo, hi) or None}) for the
    tuned rows."""
    from metatp.backends.cuda.kernels.mmq import MMQ_MAX_TOKENS, MMQ_MIN_TOKENS
    from scripts.mmq_crossover import (PATHS, SHAPES as PRODUCTS, crossover, disagreeing, suggest, suggest_int8,
                                       suggest_tensor_cores)

    if not _fits(rep, cfg, budget, f"many-token products, {label}", NEED_S["crossover"]):
        return {}
    shapes = None if cfg.emulate else tuple(s for s in PRODUCTS if s[0].startswith("1B") or cfg.big)
    try:
        rows = crossover(emulate=cfg.emulate, reps=cfg.crossover_reps, tokens=cfg.crossover_tokens, shapes=shapes)
    except Exception as e:  # noqa: BLE001
        rep.fail(SECTION, f"many-token products, {label}", e)
        return {}
    for r in rows:
        times = [f"{p} {'-' if r.get(f'{p}_us') is None else format(r[f'{p}_us'], ',.1f')}" for p in PATHS]
        rep.add(SECTION, f"MUL_MAT {r['shape']} {r['type']} T={r['tokens']}",
                f"{', '.join(times)} µs" + (" (emulator: untimed)" if cfg.emulate else ""), None)
    for r, path in disagreeing(rows):
        rep.add(SECTION, f"MUL_MAT {r['shape']} {r['type']} T={r['tokens']} [{path}]",
                f"max rel err {r[f'{path}_err']:.1e} against its reference: too far", False)
    found = {"mmq": suggest(rows), "mmq_h": suggest_tensor_cores(rows), "int8": suggest_int8(rows)}

    def span(x: tuple[int, int] | None) -> str:
        return "at no T" if x is None else f"for T = {x[0]}..{x[1]}"
    rep.add(SECTION, f"many-token products, {label}",
            f"the tiled kernel (mmq) is the fastest exact path on every shape {span(found['mmq'])} (default "
            f"T = {MMQ_MIN_TOKENS}..{MMQ_MAX_TOKENS}: mmq_min_tokens, mmq_max_tokens); its f16 tiles on the tensor "
            f"cores (mmq_tensor_cores) the fastest of all exact paths {span(found['mmq_h'])}; numerics q8's int8 "
            f"tiles the fastest {span(found['int8'])}", None)
    return found


def _tuned_range(found: tuple[int, int] | None, default: tuple[int, int] | None) -> tuple[int, int] | None:
    """The mmq range to try in the tuned rows: from the first token count past the matvec kernel's
    to the last T where the kernel won; None where that is `default` (what the engine does already),
    or it never won above the matvec kernel's rows (the bench's many-row steps then keep cuBLAS)."""
    from metatp.backends.cuda.kernels.mmq import MMQ_MIN_TOKENS

    if found is None or found[1] < MMQ_MIN_TOKENS:
        return None
    tuned = (MMQ_MIN_TOKENS, found[1])
    return None if tuned == default else tuned


def _tuned_rows(rep: Report, cfg: Config, budget: Budget, path: Path, label: str,
                found: dict[str, tuple[int, int] | None], s_tg: dict[int, float]) -> None:
    """The batched-bench rows of the many-row steps again with what the crossover rows measured (B above
    the matvec kernel's rows): the tiled kernel on the tensor cores over the range where it won, else the
    f32 tiled kernel's range where it differs from the default; numerics q8 at B=64 where the int8 tiles
    won at T=64; each with its S_TG against the default row's."""
    from metatp.backends.cuda.kernels.mmq import MMQ_MAX_TOKENS, MMQ_MIN_TOKENS
    from metatp.backends.cuda.launch import MATVEC_MAX_TOKENS

    runs = []
    many = [b for b in cfg.bench_batches if b > MATVEC_MAX_TOKENS]
    tensor_cores = _tuned_range(found.get("mmq_h"), None)
    mmq = _tuned_range(found.get("mmq"), (MMQ_MIN_TOKENS, MMQ_MAX_TOKENS))
    if tensor_cores is not None and many:
        lo, hi = tensor_cores
        runs.append((f"mmq_h {lo}..{hi}", {"backend_options": {"mmq_tensor_cores": True, "mmq_min_tokens": lo,
                                                               "mmq_max_tokens": hi}}, many))
    elif mmq is not None and many:
        lo, hi = mmq
        runs.append((f"mmq {lo}..{hi}", {"backend_options": {"mmq_min_tokens": lo, "mmq_max_tokens": hi}}, many))
    int8 = found.get("int8")
    b64 = max((b for b in cfg.bench_batches if b <= 64), default=0)
    if int8 is not None and b64 > MATVEC_MAX_TOKENS and int8[0] <= b64 <= int8[1]:
        runs.append(("q8", {"numerics": "q8"}, [b64]))
    if not runs:
        rep.add(SECTION, f"batched-bench {label} tuned", "not run: the crossover rows measured nothing to change "
                "(or did not run)", None)
        return
    for tag, kw, batches in runs:
        got = _bench_rows(rep, cfg, budget, path, label, batches, f" [{tag}]", kw)
        for b, rate in got.items():
            if s_tg.get(b):
                rep.add(SECTION, f"S_TG B={b} [{tag}] / default, {label}", f"{rate / s_tg[b]:.2f}x", None)


# ---------------------------------------------------------------- batched-bench
def _bench_rows(rep: Report, cfg: Config, budget: Budget, path: Path, label: str,
                batches: list[int] | None = None, tag: str = "", llm_kw: dict | None = None) -> dict[int, float]:
    """The batched-bench rows (of `batches`, default the config's; `tag` ends each row's name and
    `llm_kw` goes to the LLM: the tuned rows); returns S_TG by B (the ones that ran)."""
    from metatp.tools.batched_bench import run_config

    batches = list(cfg.bench_batches if batches is None else batches)
    pp, tg = cfg.bench_pp, cfg.bench_tg
    n_ctx = max(batches) * (pp + tg)
    try:
        llm = cupy_llm(cfg, path, n_ctx=n_ctx, n_batch=512, max_num_seqs=max(batches),
                       enable_prefix_caching=False, **(llm_kw or {}))
    except Exception as e:  # noqa: BLE001
        rep.fail(SECTION, f"batched-bench {label} LLM{tag}", e)
        return {}
    # a prompt pass attends over the cells in use rounded up to 256: B=256 prompts of 128 tokens make
    # 64 passes of 512 rows, each a plan of its own span; all are kept, so the timed run compiles none
    llm.engine.max_plans = max(llm.engine.max_plans, 2 * n_ctx // 512 + 32)
    s_tg: dict[int, float] = {}
    for b in batches:
        row = f"batched-bench {label} PP {pp} TG {tg} B={b}{tag}"
        if not _fits(rep, cfg, budget, row, 15 + b / 8):
            continue
        try:
            r = run_config(llm, pp, tg, b)
            s_tg[b] = r.s_tg
            rep.add(SECTION, row, f"S_PP {_rate(r.s_pp)} t/s, S_TG {_rate(r.s_tg)} t/s, S {_rate(r.s)} t/s "
                    f"(T_PP {r.t_pp:.3f} s, T_TG {r.t_tg:.3f} s, N_KV {r.n_kv:,})", None)
        except Exception as e:  # noqa: BLE001
            rep.fail(SECTION, row, e)
    if tag:
        return s_tg
    one = s_tg.get(1)
    for b in batches[1:]:
        if one and b in s_tg:
            rep.add(SECTION, f"S_TG B={b} / B=1, {label}", f"{s_tg[b] / one:.1f}x", None)
    _graph_note(rep, llm, label)
    return s_tg


def _invariant_rows(rep: Report, cfg: Config, budget: Budget, path: Path, label: str,
                    s_tg: dict[int, float]) -> None:
    """The batched-bench row at B=64 (the largest B up to 64) under `batch_invariant=True`, and its
    S_TG against the default run's: every matmul on the tiled kernel, the decode attention over
    128-key chunks, each sequence on 128-cell pages (so the cache holds B * 2 pages here)."""
    from metatp.tools.batched_bench import run_config

    b = max((n for n in cfg.bench_batches if n <= 64), default=1)
    pp, tg = cfg.bench_pp, cfg.bench_tg
    row = f"batched-bench {label} PP {pp} TG {tg} B={b} batch_invariant"
    if not _fits(rep, cfg, budget, row, NEED_S["invariant"]):
        return
    page = 128
    try:
        llm = cupy_llm(cfg, path, n_ctx=b * -(-(pp + tg) // page) * page, n_batch=512, max_num_seqs=b,
                       enable_prefix_caching=False, batch_invariant=True)
        llm.engine.max_plans = max(llm.engine.max_plans, 64)
        r = run_config(llm, pp, tg, b)
        rep.add(SECTION, row, f"S_PP {_rate(r.s_pp)} t/s, S_TG {_rate(r.s_tg)} t/s, S {_rate(r.s)} t/s "
                f"(T_PP {r.t_pp:.3f} s, T_TG {r.t_tg:.3f} s, N_KV {r.n_kv:,})", None)
    except Exception as e:  # noqa: BLE001
        rep.fail(SECTION, row, e)
        return
    if s_tg.get(b):
        rep.add(SECTION, f"S_TG B={b} batch_invariant / default, {label}", f"{r.s_tg / s_tg[b]:.2f}x", None)


def _graph_note(rep: Report, llm, label: str) -> None:
    """Which of the engine's plans replay a CUDA graph, by rows (one graph per row bucket once
    captured; `_plan_mode`), then whether the runtime lets a capture take its cuBLAS GEMMs."""
    modes_by_rows: dict[int, set[str]] = {}
    for key, (_, ex) in llm.engine._plans.items():
        modes_by_rows.setdefault(key[0], set()).add(_plan_mode(ex))
    text = ", ".join(f"{rows}: {'/'.join(sorted(modes))}" for rows, modes in sorted(modes_by_rows.items()))
    rep.add(SECTION, f"plans by rows, {label}", text or "none", None)
    rt = llm.engine.backend.rt
    rep.add(SECTION, f"cuBLAS GEMM in CUDA graphs, {label}",
            "yes" if rt.gemm_capturable() else
            "no (cuBLAS or the CUDA runtime below 12.2, or no cuBLAS: plans with a GEMM run eagerly)", None)


def _plan_mode(ex) -> str:
    """"whole" / "segments": the plan replays a graph; "eager": it ran again without one (a step
    CUDA cannot capture, or graphs off after a failed capture); "once": it ran once (captured from
    its second run on). " + cuBLAS" where its steps include cuBLAS GEMMs (the many-row products
    above 16 rows, exact numerics): captured with the kernels where the runtime's cuBLAS can be."""
    from metatp.backends.cuda.device_ops import StreamCall

    mode = ex.graph_mode or ("eager" if ex.runs > 1 else "once")
    gemm = any(isinstance(s, StreamCall) for per_dev in ex.steps for steps in per_dev for s in steps)
    return f"{mode} + cuBLAS" if gemm else mode


def _free_device_memory(cfg: Config) -> None:
    """After a part's LLM is gone: its device memory back from CuPy's pool (the next part, or the
    server process, needs it)."""
    gc.collect()
    if not cfg.emulate:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------- long prompts
def _prompt_rows(rep: Report, cfg: Config, budget: Budget, path: Path, label: str, need: float) -> None:
    from metatp.tools.batched_bench import run_config

    longest = max(cfg.prompt_lengths)
    try:
        llm = cupy_llm(cfg, path, n_ctx=longest + 16, n_batch=512, max_num_seqs=1, enable_prefix_caching=False)
    except Exception as e:  # noqa: BLE001
        rep.fail(SECTION, f"pp {label} LLM", e)
        return
    for n in cfg.prompt_lengths:
        row = f"pp{n} {label}"
        if not _fits(rep, cfg, budget, row, need):
            continue
        try:
            r = run_config(llm, n, 0, 1)
            rep.add(SECTION, row, f"{_rate(r.s_pp)} tok/s ({r.t_pp * 1e3:,.1f} ms, prompt in steps of "
                    f"{llm.engine.n_batch} tokens)", None)
        except Exception as e:  # noqa: BLE001
            rep.fail(SECTION, row, e)


# ---------------------------------------------------------------- metatp serve
def serve_command(cfg: Config, path: Path, port: int, parallel: int, n_ctx: int) -> list[str]:
    """`metatp serve --backend cupy` through this folder (`python3 scripts/gpu_check --serve`,
    on the emulator with `cfg.emulate`), so it runs from the source tree as the rest does. No prefix
    cache: a finished request's cells are free again, so the serial requests all attend over the
    same span (one plan), and the concurrent ones over the spans of the warm-up round."""
    folder = Path(__file__).resolve().parent
    return [sys.executable, str(folder), "--serve", *(["--emulate"] if cfg.emulate else []),
            "-m", str(path), "--backend", "cupy", "--port", str(port), "-a", "m", "-np", str(parallel),
            "-c", str(n_ctx), "--max-waiting", str(max(64, parallel)), "--no-prefix-caching"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, base: str, timeout: float) -> None:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"metatp serve exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"metatp serve did not answer /health within {timeout:.0f} s")


def _serve_rows(rep: Report, cfg: Config, budget: Budget, path: Path, label: str) -> None:
    row = f"serve {cfg.serve_clients} concurrent vs serial, {label}"
    if not _fits(rep, cfg, budget, row, NEED_S["serve"]):
        return
    try:
        import openai
    except ImportError as e:
        rep.add(SECTION, row, f"not run ({e}: carry the serve wheels, scripts/gpu_check/carry.py)", None)
        return
    n, tokens = cfg.serve_clients, cfg.serve_tokens
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = path.with_suffix(".serve.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command(cfg, path, port, n, n * (tokens + 32)), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, base, timeout=max(30.0, min(240.0, budget.left() - 30)))
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
        prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, 8)] for i in range(n)]

        def complete(p: list[int], max_tokens: int = tokens) -> int:
            r = client.completions.create(model="m", prompt=p, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        # warm-up: the same round once untimed, so every plan it meets (the decode step of n at each
        # span its growing cells reach, one per 256 cells) is compiled and its graph captured
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(complete, prompts))
        complete(prompts[0])                           # ... and the one-sequence step
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            done = sum(pool.map(complete, prompts))
        concurrent = done / (time.perf_counter() - t0)
        t0, done, serial_n = time.perf_counter(), 0, 0
        for p in prompts:
            done += complete(p)
            serial_n += 1
            spent = time.perf_counter() - t0
            if not cfg.emulate and budget.left() < 20 + spent / serial_n:
                break
        serial = done / (time.perf_counter() - t0)
        rep.add(SECTION, row, f"{concurrent / serial:.1f}x ({_rate(concurrent)} tok/s for {n} at once, "
                f"{_rate(serial)} tok/s one after another over {serial_n} of them; {tokens} tokens each)", None)
    except Exception as e:  # noqa: BLE001
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        rep.fail(SECTION, row, RuntimeError(f"{type(e).__name__}: {e}; server log: {tail}"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        log.unlink(missing_ok=True)


def serve_main(argv: list[str]) -> int:
    """`python3 scripts/gpu_check --serve [--emulate] ARGS`: `metatp serve ARGS` from this source
    tree; with --emulate its cupy backend runs on the CPU kernel emulator (the dry run's server)."""
    from metatp.cli import main

    if "--emulate" in argv:
        from scripts.gpu_check.config import on_emulator

        with on_emulator():
            return main(["serve", *[a for a in argv if a != "--emulate"]])
    return main(["serve", *argv])

