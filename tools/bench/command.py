"""`metatp bench`'s flags, the BenchConfig they ask for, and the command (rank 0 prints the table)."""

from __future__ import annotations

import argparse
import sys

from metatp.tools.bench.config import BenchConfig, int_list
from metatp.tools.bench.run import run_bench
from metatp.tools.bench.setups import COMPARE
from metatp.tools.bench.slots import check_world
from metatp.tools.bench.table import format_rows
from metatp.tools.bench_comm import add_stage_args, parse_modes

__all__ = ["add_parser", "config_from_args", "cmd_bench"]


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
    b.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="instead of the tests: one sequence's greedy tokens/s with and without speculative "
                        "decoding (ngram lookup, or draft with -md), a quoting and a free-writing prompt, -n "
                        "tokens, with the acceptance rate (tools/bench/speculative.py)")
    b.add_argument("-md", "--model-draft", dest="model_draft", default=None, metavar="PATH",
                   help="--speculative draft: the draft model")
    b.add_argument("--draft-max", type=int, default=8, metavar="K", help="--speculative: tokens drafted a step (default 8)")
    b.add_argument("--lookup-ngram-max", dest="lookup_max", type=int, default=3, metavar="N",
                   help="--speculative ngram: longest n-gram looked up (default 3)")
    b.set_defaults(func=cmd_bench)


def cache_type_names(text: str | None) -> list[str | None]:
    """-ctk / -ctv values: comma-separated KV cache type names, checked; [None] when not given."""
    if text is None:
        return [None]
    from metatp.ir.models.common import cache_type

    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    for n in names:
        cache_type(n)                       # a ConfigError naming the choices
    return names or [None]


def config_from_args(args: argparse.Namespace, world) -> BenchConfig:
    """The BenchConfig the flags ask for; under mpiexec --devices defaults to the world size."""
    from metatp.ir.errors import ConfigError
    from metatp.passes.plan import DeviceLayout

    if args.repetitions < 1:
        raise ConfigError("-r must be >= 1")
    split_mode = args.split_mode or ("tensor" if world is not None else "none")
    modes = parse_modes(split_mode, args.pp, args.tp)
    ts = [DeviceLayout.parse_split(t) for t in args.tensor_split.split(",")] if args.tensor_split else [None]
    default_devices = [world.size] if world is not None else [1]
    return BenchConfig(model=args.model, n_prompt=int_list(args.n_prompt), n_gen=int_list(args.n_gen),
                       n_depth=int_list(args.n_depth), repetitions=args.repetitions, backend=args.backend,
                       n_devices=int_list(args.devices) if args.devices is not None else default_devices,
                       split_mode=modes, tensor_split=ts, pp=args.pp, tp=args.tp,
                       interleave=args.interleave, compare=args.compare,
                       numerics=[m.strip() for m in args.numerics.split(",") if m.strip()] or ["exact"],
                       cache_type_k=cache_type_names(args.cache_type_k), cache_type_v=cache_type_names(args.cache_type_v))


def cmd_bench(args: argparse.Namespace) -> int:
    from metatp.backends.distributed import every_rank, init_world
    from metatp.ir.errors import MetatpError

    if args.speculative is not None:
        return cmd_speculative(args)
    world = init_world("auto")          # None in one process; under mpiexec -n N (N > 1), this rank
    try:
        cfg = config_from_args(args, world)
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


def cmd_speculative(args: argparse.Namespace) -> int:
    """`--speculative`: plain vs speculative decoding rows (`tools/bench/speculative.py`), on the
    first of --devices / -sm, one process (not under mpiexec)."""
    from metatp.backends.distributed import launched_world_size
    from metatp.ir.errors import ConfigError
    from metatp.tools.bench.speculative import format_speculative, run_speculative

    if (launched_world_size() or 1) > 1:
        raise ConfigError("--speculative runs in one process; start it without mpiexec")
    if args.repetitions < 1:
        raise ConfigError("-r must be >= 1")
    n_gen = int_list(args.n_gen)[0] if int_list(args.n_gen) else 128
    cfg = {"method": args.speculative, "num_speculative_tokens": args.draft_max}
    if args.speculative == "draft":
        if not args.model_draft:
            raise ConfigError("--speculative draft needs a draft model: -md PATH")
        cfg["model"] = args.model_draft
    else:
        cfg["prompt_lookup_max"] = args.lookup_max
    devices = int_list(args.devices)[0] if args.devices else 1
    mode = (args.split_mode or ("tensor" if devices > 1 else "none")).split(",")[0]
    llm_kwargs = dict(model=args.model, backend=args.backend, n_ctx=max(512, n_gen + 320), n_devices=devices,
                      split_mode=mode)
    rows = run_speculative(llm_kwargs, cfg, n_gen, args.repetitions,
                           progress=lambda r: print(f"  {r['prompt']}: {r['plain_ts']:.2f} -> {r['spec_ts']:.2f} t/s, "
                                                    f"acceptance {r['acceptance']:.2f}", file=sys.stderr))
    print(format_speculative(rows, args.output))
    return 0
