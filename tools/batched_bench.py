"""`metatp batched-bench`: throughput of B parallel sequences, in the shape of llama.cpp's llama-batched-bench.

For every (PP, TG, B): B sequences each get a PP-token prompt (all prefilled together, in
steps of at most n_batch tokens), then TG decode steps that each carry one token of every
sequence. Columns as llama-batched-bench prints them:

    PP, TG, B, N_KV (cells used: B*(PP+TG)), T_PP s, S_PP t/s (B*PP / T_PP), T_TG s,
    S_TG t/s (B*TG / T_TG: the aggregate decode rate), T s, S t/s ((B*PP + B*TG) / T)

Each configuration runs once untimed first, so every plan it needs is compiled before the
clock starts. `--ttft` also sends B requests at once through the scheduler (as a server's
clients would) and reports the median and worst time to first token.

`--compare llama-cpp` measures every configuration through llama.cpp too, in the same
invocation (llama-cpp-python's batch API in a child process, tools/llamacpp.py, with metatp's
kernel thread count): per configuration both warm up, then their `-r` repetitions alternate,
and every metatp row carries S_PP and S_TG divided by llama.cpp's. If the llama.cpp side cannot
run (not installed, a load failure, the child killed by a signal) one line on stderr says why
and metatp's rows are printed without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["BatchedRow", "run_config", "add_parser", "main"]


@dataclass
class BatchedRow:
    pp: int
    tg: int
    b: int
    n_kv: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float
    t: float
    s: float
    split_mode: str = "none"
    n_devices: int = 1
    ttft_median: float | None = None
    ttft_max: float | None = None
    program: str = "metatp"
    vs_llama_cpp_s_pp: float | None = None    # this row's S_PP / llama.cpp's (with --compare)
    vs_llama_cpp_s_tg: float | None = None


def _int_list(text: str, name: str) -> list[int]:
    from metatp.ir.errors import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not out or any(v < 0 for v in out):
        raise ConfigError(f"{name}: expected integers >= 0, got {text!r}")
    return out


def _timed(engine, pp: int, tg: int, b: int, rng: np.random.Generator) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for b sequences of pp prompt and tg generated tokens."""
    from metatp.engine import StepItem

    n_vocab = engine.model.hparams.n_vocab
    seqs = [engine.new_sequence(pp + tg) for _ in range(b)]
    try:
        prompts = [list(rng.integers(1, n_vocab, max(pp, 1))) for _ in range(b)]
        t0 = time.perf_counter()
        if pp:
            left = [list(p) for p in prompts]
            while any(left):                           # chunked prefill: n_batch tokens per step
                budget, items = engine.n_batch, []
                for s, rest in zip(seqs, left):
                    if rest and budget > 0:
                        chunk, rest[:] = rest[:budget], rest[budget:]
                        items.append(StepItem(s, chunk, "none" if rest else "last"))
                        budget -= len(chunk)
                engine.run(items)
        t1 = time.perf_counter()
        for k in range(tg):
            engine.run([StepItem(s, [int(1 + (k * 7 + i) % (n_vocab - 1))], "last") for i, s in enumerate(seqs)])
        t2 = time.perf_counter()
    finally:
        for s in seqs:
            engine.free(s)
    return t1 - t0, t2 - t1


def _ttft(llm, pp: int, b: int, rng: np.random.Generator) -> tuple[float, float]:
    """Median and worst time to first token of b prompts submitted at once (continuous batching)."""
    from metatp import SamplingParams

    prompts = [[int(t) for t in rng.integers(1, llm.n_vocab, max(pp, 1))] for _ in range(b)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    ttfts = [o.metrics["time_to_first_token"] for o in outs]
    return statistics.median(ttfts), max(ttfts)


def _row(pp: int, tg: int, b: int, t_pp: float, t_tg: float, **extra) -> BatchedRow:
    t = t_pp + t_tg
    return BatchedRow(pp, tg, b, b * (pp + tg), t_pp, b * pp / t_pp if t_pp > 0 else 0.0, t_tg,
                      b * tg / t_tg if t_tg > 0 else 0.0, t, b * (pp + tg) / t if t > 0 else 0.0, **extra)


def run_config(llm, pp: int, tg: int, b: int, warmup: bool = True, ttft: bool = False, seed: int = 0,
               repetitions: int = 1, partner=None) -> BatchedRow:
    """One row of the table (the configuration runs once untimed first when `warmup`); times are
    means over `repetitions`. `partner(pp, tg, b, seed)`, if given, runs right after each of
    metatp's runs (the warm-up included), so another program's repetitions interleave with ours."""
    from metatp.ir.errors import ConfigError

    eng = llm.engine
    if b < 1:
        raise ConfigError(f"-npl: the number of parallel sequences must be >= 1, got {b}")
    if b * (pp + tg) > eng.n_ctx:
        raise ConfigError(f"PP={pp}, TG={tg}, B={b} needs {b * (pp + tg)} KV cells but the context has "
                          f"{eng.n_ctx}; raise -c")
    if repetitions < 1:
        raise ConfigError(f"-r: repetitions must be >= 1, got {repetitions}")
    rng = np.random.default_rng(seed)
    if warmup:
        _timed(eng, pp, tg, b, rng)
        if partner is not None:
            partner(pp, tg, b, seed)
    t_pp = t_tg = 0.0
    for r in range(repetitions):
        dt_pp, dt_tg = _timed(eng, pp, tg, b, rng)
        t_pp, t_tg = t_pp + dt_pp / repetitions, t_tg + dt_tg / repetitions
        if partner is not None:
            partner(pp, tg, b, seed + 1 + r)
    row = _row(pp, tg, b, t_pp, t_tg, split_mode=llm.layout.split_mode, n_devices=llm.layout.n_devices)
    if ttft:
        if warmup:
            _ttft(llm, pp, b, rng)
        row.ttft_median, row.ttft_max = _ttft(llm, pp, b, rng)
    return row


class _LlamaCppSide:
    """llama.cpp's rows of a --compare run: a partner for run_config that sums its timed runs,
    and turns a failure of the child into one line (`failed`) and no more llama.cpp rows."""

    def __init__(self, model_path: str, n_threads: int, n_batch: int) -> None:
        from metatp.tools import llamacpp

        self.failed: str | None = None
        self.child = None
        self._runs: list[tuple[float, float]] = []
        try:
            self.child = llamacpp.LlamaCppChild(model_path, n_threads, n_batch)
        except llamacpp.ComparisonFailed as e:
            self._fail(str(e))

    def _fail(self, line: str) -> None:
        self.failed = line
        print(f"metatp: warning: {line}", file=sys.stderr, flush=True)
        if self.child is not None:
            self.child.close()
            self.child = None

    def __call__(self, pp: int, tg: int, b: int, seed: int) -> None:
        from metatp.tools import llamacpp

        if self.child is None:
            return
        try:
            self._runs.append(self.child.timed(pp, tg, b, seed))
        except llamacpp.ComparisonFailed as e:
            self._fail(str(e))

    def start(self) -> None:
        """A new configuration: forget the runs so far (the warm-up's among them)."""
        self._runs = []

    def row(self, ours: BatchedRow, warmup: bool) -> BatchedRow | None:
        """llama.cpp's row of the configuration just run (its timed runs' means), and our ratios."""
        timed = self._runs[1:] if warmup else self._runs
        if self.child is None or not timed:
            return None
        t_pp, t_tg = (sum(x) / len(timed) for x in zip(*timed))
        ref = _row(ours.pp, ours.tg, ours.b, t_pp, t_tg, program="llama.cpp")
        ours.vs_llama_cpp_s_pp = ours.s_pp / ref.s_pp if ref.s_pp > 0 else None
        ours.vs_llama_cpp_s_tg = ours.s_tg / ref.s_tg if ref.s_tg > 0 else None
        return ref

    def close(self) -> None:
        if self.child is not None:
            self.child.close()


def _ratio(x: float | None) -> str:
    return f"{x:7.2f}x" if x is not None else f"{'-':>8s}"


def format_table(rows: list[BatchedRow]) -> str:
    """llama-batched-bench's table; with llama.cpp rows, a program column and metatp's ratios."""
    compare = any(r.program != "metatp" for r in rows)
    head = (("| program   " if compare else "")
            + "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
            + (" S_PP vs llama.cpp | S_TG vs llama.cpp |" if compare else "")
            + (" TTFT med s | TTFT max s |" if any(r.ttft_median is not None for r in rows) else ""))
    sep = "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"
    out = [head, sep]
    for r in rows:
        line = ((f"| {r.program:9s} " if compare else "")
                + f"| {r.pp:5d} | {r.tg:6d} | {r.b:4d} | {r.n_kv:6d} | {r.t_pp:8.3f} | {r.s_pp:8.2f} | "
                f"{r.t_tg:8.3f} | {r.s_tg:8.2f} | {r.t:8.3f} | {r.s:8.2f} |")
        if compare:
            line += f" {_ratio(r.vs_llama_cpp_s_pp):>17s} | {_ratio(r.vs_llama_cpp_s_tg):>17s} |"
        if r.ttft_median is not None:
            line += f" {r.ttft_median:10.3f} | {r.ttft_max:10.3f} |"
        elif any(x.ttft_median is not None for x in rows):
            line += f" {'-':>10s} | {'-':>10s} |"
        out.append(line)
    return "\n".join(out)


def _threads(llm) -> int:
    """The kernel threads metatp runs with (llama.cpp gets the same count)."""
    from metatp.backends.numpy.native import default_threads

    n = llm.backend.describe().kernel_threads
    return n if n else default_threads()


def _cmd(args: argparse.Namespace) -> int:
    from metatp.api import LLM
    from metatp.cli_args import layout_kwargs

    pps, tgs, npls = _int_list(args.npp, "-npp"), _int_list(args.ntg, "-ntg"), _int_list(args.npl, "-npl")
    need = max(b * (pp + tg) for pp in pps for tg in tgs for b in npls)
    llm = LLM(args.model, n_ctx=args.n_ctx or max(need, 512), backend=args.backend, n_batch=args.batch_size,
              max_num_seqs=max(npls), numerics=args.numerics, enable_prefix_caching=False,   # every prefill timed
              **layout_kwargs(args))
    threads = _threads(llm)
    rows = []
    if args.output == "md":
        info = llm.backend.describe()
        numerics = dict(info.options).get("numerics", "exact")
        print(f"model {llm.model_path}, backend {info.name}, numerics {numerics}, split {llm.layout.split_mode} x "
              f"{llm.layout.n_devices}, n_ctx {llm.n_ctx}, n_batch {llm.engine.n_batch}, kernel threads "
              f"{info.kernel_threads if info.kernel_threads is not None else '-'}, "
              f"kernels {info.kernels}, load {os.getloadavg()[0]:.2f}", flush=True)
    side = _LlamaCppSide(str(llm.model_path), threads, llm.engine.n_batch) if args.compare else None
    if args.output == "md":
        if side is not None and side.child is not None:
            print(f"compared with {side.child.version}, {threads} threads, f16 KV cache, interleaved")
        print()
    try:
        for pp in pps:
            for tg in tgs:
                for b in npls:
                    if side is not None:
                        side.start()
                    row = run_config(llm, pp, tg, b, warmup=not args.no_warmup, ttft=args.ttft,
                                     repetitions=args.repetitions, partner=side)
                    ref = side.row(row, warmup=not args.no_warmup) if side is not None else None
                    rows += [row] + ([ref] if ref is not None else [])
                    if args.output == "jsonl":
                        for r in [row] + ([ref] if ref is not None else []):
                            print(json.dumps(asdict(r)), flush=True)
    finally:
        if side is not None:
            side.close()
    if args.output == "md":
        print(format_table(rows))
    return 0


def add_parser(sub) -> None:
    from metatp.cli_args import add_layout_args, add_model_args

    p = sub.add_parser("batched-bench", help="throughput of B parallel sequences (llama-batched-bench's table)")
    add_model_args(p)
    add_layout_args(p)
    p.add_argument("-npp", default="128", help="prompt tokens per sequence, comma-separated (default 128)")
    p.add_argument("-ntg", default="32", help="generated tokens per sequence, comma-separated (default 32)")
    p.add_argument("-npl", default="1,2,4,8", help="parallel sequences B, comma-separated (default 1,2,4,8)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="tokens per step (default 512)")
    p.add_argument("--numerics", default="exact", choices=["exact", "llamacpp", "q8"],
                   help="numpy backend: exact float32, or llama.cpp's Q8 activations and integer dot products")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="numpy backend: kernel threads (option kernel_threads; default $METATP_NUM_THREADS)")
    p.add_argument("--ttft", action="store_true", help="also time to first token of B requests sent at once")
    p.add_argument("--no-warmup", action="store_true", help="time the first run (plans compile inside it)")
    p.add_argument("-r", "--repetitions", type=int, default=1, help="timed runs per row, averaged (default 1)")
    p.add_argument("--compare", default=None, choices=["llama-cpp"],
                   help="also run every row through llama.cpp (llama-cpp-python, in a child process), "
                        "interleaved, with metatp's S_PP and S_TG as multiples of llama.cpp's")
    p.add_argument("-o", "--output", default="md", choices=["md", "jsonl"])
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    """`metatp batched-bench` without the rest of the command line (its own parser, the same error lines)."""
    from metatp.cli_args import Parser
    from metatp.cli_run import run_command

    ap = Parser(prog="metatp")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    return run_command(ap, ["batched-bench", *(argv if argv is not None else sys.argv[1:])])
