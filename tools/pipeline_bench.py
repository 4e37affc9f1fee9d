"""`metatp pipeline-bench`: the pipeline bubble of -sm layer under mpiexec, with and without micro-batches.

    mpiexec -n 2 metatp pipeline-bench -sm layer -npl 8 --micro-batches 1,2

Every rank runs the same engine steps (`Engine.run`, as `metatp bench` does): B sequences get a
prompt of `-npp` tokens in one step, then `-ntg` decode steps of all B together, feeding each
sequence its greedy token (the logits every rank reads alike). For each micro-batch count M
(`metatp.pipeline`; 1: one pass after another) and each rank it reports the decode step time
and the share of it the rank spent waiting: for its input (`MpiSendRecv.recv_seconds`, the
hidden state from the stage before) and for the logits (`bcast_seconds`, the read from the last
stage), the rest being its own work; and the step time as a multiple of M=1's. The runs of the
M values alternate (`-r` repetitions) so that a machine whose speed drifts affects them alike.

It also checks what pipelining must keep: every M's logits are compared with M=1's, bit for bit
(`identical` in the output; tests/mpi/test_mpi_pipeline.py reads `--out`).

Ranks that share cores (more ranks than free cores) take turns on them instead of running side
by side: a wait fraction then falls with pipelining but the step time cannot.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["add_parser", "drive", "main"]


def drive(engine, prompts: list[list[int]], n_gen: int, micro: int, link=None) -> dict:
    """B sequences: one prefill step, a warm-up decode step, then `n_gen` timed decode steps with
    `engine.micro_batches = micro`. Per step: wall seconds and (with an MPI link) seconds in
    receives and in logits reads; every step's logits and the greedy tokens."""
    from metatp.engine import StepItem

    engine.micro_batches = micro
    seqs = [engine.new_sequence() for _ in prompts]
    try:
        got = engine.run([StepItem(s, p, "last") for s, p in zip(seqs, prompts)])
        logits = [np.stack(got)]
        nxt = [int(np.argmax(x)) for x in got]
        tokens = [nxt]
        rec = {"step_s": [], "recv_s": [], "read_s": []}
        for k in range(n_gen + 1):
            r0 = link.recv_seconds if link else 0.0
            b0 = link.bcast_seconds if link else 0.0
            t0 = time.perf_counter()
            got = engine.run([StepItem(s, [t], "last") for s, t in zip(seqs, nxt)])
            took = time.perf_counter() - t0
            if k:                      # the first decode step compiles the micro-batch plans
                rec["step_s"].append(took)
                rec["recv_s"].append((link.recv_seconds - r0) if link else 0.0)
                rec["read_s"].append((link.bcast_seconds - b0) if link else 0.0)
            logits.append(np.stack(got))
            nxt = [int(np.argmax(x)) for x in got]
            tokens.append(nxt)
    finally:
        for s in seqs:
            engine.free(s)
    return {**rec, "logits": logits, "tokens": tokens}


def _int_list(text: str, what: str) -> list[int]:
    from metatp.ir.errors import ConfigError

    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 1 for x in out):
        raise ConfigError(f"{what}: expected integers >= 1 separated by commas, got {text!r}")
    return out


def _cmd(args) -> int:
    from metatp.api import LLM
    from metatp.cli_args import layout_kwargs
    from metatp.ir.errors import ConfigError

    micros = _int_list(args.micro_list, "--micro-batches")
    if args.repetitions < 1:
        raise ConfigError(f"--repetitions must be >= 1, got {args.repetitions}")
    B, npp, ntg = _int_list(args.npl, "-npl")[0], _int_list(args.npp, "-npp")[0], _int_list(args.ntg, "-ntg")[0]
    n_ctx = args.n_ctx or max(512, B * 128 * (-(-(npp + ntg + 2) // 128)))     # each sequence on its own pages
    opts = layout_kwargs(args)
    llm = LLM(args.model, n_ctx=n_ctx, backend=args.backend, n_batch=args.batch_size, max_num_seqs=B, **opts)
    engine, world = llm.engine, llm.world
    link = llm.backend.collective.send_recv if llm.backend.collective is not None else None
    link = link if hasattr(link, "recv_seconds") else None
    rng = np.random.default_rng(args.seed)
    vocab = llm.model.hparams.n_vocab
    prompts = [[int(t) for t in rng.integers(1, vocab, npp)] for _ in range(B)]
    runs: dict[int, list[dict]] = {m: [] for m in micros}
    for _ in range(args.repetitions):
        for m in micros:
            runs[m].append(drive(engine, prompts, ntg, m, link))
    mine = {m: {k: float(sum(sum(r[k]) for r in rs)) for k in ("step_s", "recv_s", "read_s")}
            | {"steps": sum(len(r["step_s"]) for r in rs)} for m, rs in runs.items()}
    every = world.comm.gather(mine, root=0) if world is not None else [mine]
    if world is not None and not world.is_root:
        return 0
    first = {m: rs[0] for m, rs in runs.items()}
    base = first[micros[0]]
    identical = {m: all(np.array_equal(a, b) for a, b in zip(r["logits"], base["logits"]))
                 and r["tokens"] == base["tokens"] for m, r in first.items()}
    rows = _rows(every, micros, identical)
    load = os.getloadavg()
    head = {"split_mode": llm.layout.split_mode, "ranks": len(every), "sequences": B, "npp": npp, "ntg": ntg,
            "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in load]}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.json").write_text(json.dumps({**head, "rows": rows}))
        np.savez(out / "logits.npz", **{f"m{m}": np.concatenate(r["logits"]) for m, r in first.items()})
    print(f"pipeline bubble: -sm {head['split_mode']}, {head['ranks']} ranks, {B} sequences, "
          f"{npp}-token prompts, {ntg} decode steps x {args.repetitions}; {head['cpus']} CPUs, load average "
          + ", ".join(f"{x:.2f}" for x in load))
    print(f"\n| M | rank | step ms | wait input % | wait logits % | busy % | step vs M={micros[0]} | identical |")
    print("|---|------|---------|--------------|---------------|--------|------------|-----------|")
    for r in rows:
        print(f"| {r['micro_batches']} | {r['rank']} | {r['step_ms']:.1f} | {r['wait_input_pct']:.1f} | "
              f"{r['wait_logits_pct']:.1f} | {r['busy_pct']:.1f} | {r['step_ratio']:.3f} | {r['identical']} |")
    return 0


def _rows(every: list[dict], micros: list[int], identical: dict[int, bool]) -> list[dict]:
    """One row per (M, rank): mean step time, the shares of it spent waiting, the step ratio."""
    rows = []
    for m in micros:
        for rank, mine in enumerate(every):
            s = mine[m]
            step = s["step_s"] / max(1, s["steps"])
            ref = every[rank][micros[0]]
            ref_step = ref["step_s"] / max(1, ref["steps"])
            total = max(s["step_s"], 1e-12)
            rows.append({"micro_batches": m, "rank": rank, "step_ms": 1e3 * step,
                         "wait_input_pct": 100 * s["recv_s"] / total, "wait_logits_pct": 100 * s["read_s"] / total,
                         "busy_pct": 100 * (1 - (s["recv_s"] + s["read_s"]) / total),
                         "step_ratio": step / ref_step if ref_step else float("nan"), "identical": identical[m]})
    return rows


def add_parser(sub) -> None:
    from metatp.cli_args import add_model_args, add_split_args

    p = sub.add_parser("pipeline-bench", help="-sm layer under mpiexec: the pipeline bubble with and without micro-batches")
    add_model_args(p)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--devices", type=int, default=None, help="number of devices (default: the world size)")
    add_split_args(p)
    p.add_argument("-npl", default="8", help="sequences in flight (default 8)")
    p.add_argument("-npp", default="32", help="prompt tokens per sequence (default 32)")
    p.add_argument("-ntg", default="16", help="timed decode steps (default 16)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="tokens per pass (default 512)")
    p.add_argument("--micro-batches", dest="micro_list", default="1,2",
                   help="micro-batch counts to compare, comma-separated; the first is the baseline (default 1,2)")
    p.add_argument("-r", "--repetitions", type=int, default=2, help="runs per M, alternating (default 2)")
    p.add_argument("-s", "--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for pipeline.json and every M's logits (rank 0)")
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    """`metatp pipeline-bench` without the rest of the command line (its own parser, the same error lines)."""
    from metatp.cli_args import Parser
    from metatp.cli_run import run_command

    ap = Parser(prog="metatp")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    return run_command(ap, ["pipeline-bench", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
