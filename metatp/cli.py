"""The `metatp` command: generate, serve, info, dump, bench, batched-bench. llama.cpp's flag spellings where they exist.

Every deliberate error is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from metatp.cli_args import (SPLIT_CHOICES, Parser, add_layout_args, add_micro_batches_arg, add_model_args,
                             add_numerics_arg, add_pooling_arg, add_speculative_args, add_split_args, add_webui_arg,
                             layout_kwargs, pooling_option, speculative_kwargs, stage_layout)
from metatp.cli_run import check_args as _check_args
from metatp.cli_run import run_command
from metatp.ir.errors import ConfigError
from metatp.tool_formats import PARSER_NAMES

# the argument builders live in metatp.cli_args (the tools import them from there); named here too
__all__ = ["main", "add_model_args", "add_layout_args", "add_split_args", "layout_kwargs", "stage_layout",
           "SPLIT_CHOICES"]


def _cmd_generate(args: argparse.Namespace) -> int:
    from metatp.api import LLM

    seed = None if args.seed == -1 else args.seed          # llama.cpp: -s -1 is a random seed
    llm = LLM(args.model, n_ctx=args.n_ctx, backend=args.backend, seed=seed, verbose=True, numerics=args.numerics,
              **layout_kwargs(args), **speculative_kwargs(args))
    if args.prompt is None:
        raise ConfigError("no prompt: pass -p TEXT (or -f FILE)")
    if args.n_predict < -1:
        raise ConfigError(f"-n/--n-predict must be >= -1 (-1: until the context is full), got {args.n_predict}")
    if llm.world is not None and not llm.world.is_root:
        sys.stdout = open(os.devnull, "w")     # under mpiexec rank 0 prints; the others follow its tokens
    kw = dict(max_tokens=None if args.n_predict < 0 else args.n_predict, temperature=args.temp, top_p=args.top_p,
              top_k=args.top_k, min_p=args.min_p, seed=seed, stop=args.stop or None,
              repeat_penalty=args.repeat_penalty, stream=True)
    if args.chat:
        chunks = llm.create_chat_completion([{"role": "user", "content": args.prompt}], **kw)
        for c in chunks:
            sys.stdout.write(c["choices"][0]["delta"].get("content", ""))
            sys.stdout.flush()
    else:
        chunks = llm.create_completion(args.prompt, **kw)       # refuses bad parameters before the echo
        sys.stdout.write(args.prompt)
        for c in chunks:
            sys.stdout.write(c["choices"][0]["text"])
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from metatp.api import LLM
    from metatp.server import refuse_mpi, serve

    import importlib.util

    refuse_mpi()        # before the model is read: every rank finds it, rank 0 says it

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise ConfigError("metatp serve needs FastAPI and uvicorn: pip install 'metatp[serve]'")
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be from 1 to 65535, got {args.port}")
    tenants = _api_key_tenants(args)         # a bad key file: an error now, before the model is read
    options = layout_kwargs(args)
    options["pooling"] = pooling_option(args)
    llm = LLM(args.model, n_ctx=args.n_ctx, backend=args.backend, max_num_seqs=args.parallel,
              max_waiting=args.max_waiting, n_batch=args.batch_size, max_model_len=args.max_model_len,
              enable_prefix_caching=args.prefix_caching, numerics=args.numerics, verbose=True, **options,
              **speculative_kwargs(args))
    if args.warmup and llm.world is None:
        # the plans of decode steps and of prompts arriving together, now, not in the first burst
        llm.engine.warm_up(args.parallel)
    if llm.world is None or llm.world.is_root:        # under mpiexec only rank 0 listens
        print(f"metatp: serving {llm.model_path} on http://{args.host}:{args.port}/v1 "
              f"(n_ctx {llm.n_ctx}, {args.parallel} parallel sequences, "
              f"max_model_len {llm.max_model_len or max(1, llm.n_ctx // args.parallel)})", file=sys.stderr, flush=True)
    serve(llm, host=args.host, port=args.port, model_name=args.alias, api_key=tenants, log_level=args.log_level,
          allowed_origins=args.allowed_origins or (), webui=args.webui, tool_call_parser=args.tool_call_parser)
    return 0


def _api_key_tenants(args: argparse.Namespace):
    """The tenants of --api-key (repeated) and --api-key-file; neither: $METATP_API_KEY, else no
    key (one anonymous tenant)."""
    from metatp.server.tenants import Tenants

    keys = args.api_key or []
    if not keys and args.api_key_file is None and os.environ.get("METATP_API_KEY"):
        keys = [os.environ["METATP_API_KEY"]]
    return Tenants.from_keys(keys, args.api_key_file)


def _cmd_info(args: argparse.Namespace) -> int:
    from metatp.tools.info import print_info

    print_info(args.model)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="metatp", description="GGUF models with tensor parallelism, from Python")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (streams to stdout)")
    add_model_args(g)
    add_layout_args(g)
    add_numerics_arg(g)
    g.add_argument("-p", "--prompt", default=None)
    g.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (-1: until the context is full)")
    g.add_argument("--temp", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("-s", "--seed", type=int, default=0, help="random seed (-1: a different one every run)")
    g.add_argument("-r", "--reverse-prompt", dest="stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_speculative_args(g)
    g.set_defaults(func=_cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_model_args(sv)
    add_layout_args(sv)
    add_numerics_arg(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    sv.add_argument("-np", "--parallel", type=int, default=4, help="sequences decoded together (slots; default 4)")
    sv.add_argument("--max-model-len", type=int, default=None,
                    help="most tokens one request may hold, prompt + completion (default: n_ctx / parallel)")
    sv.add_argument("-b", "--batch-size", type=int, default=512, help="tokens per step, prompts chunked to fit (default 512)")
    sv.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                    help="do not keep finished requests' KV blocks for prompts that start the same way")
    sv.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="do not compile the plans of decode steps of 1..parallel sequences (and of full "
                         "few-token passes) before listening")
    sv.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for a slot before 503 (default 64)")
    sv.add_argument("--api-key", action="append", default=None,
                    help="require Authorization: Bearer KEY; repeat it for several keys, each a tenant of its own "
                         "(tenant-<n>; default $METATP_API_KEY)")
    sv.add_argument("--api-key-file", default=None, metavar="FILE",
                    help="API keys, one a line: 'KEY' or 'KEY TENANT-NAME' (keys naming one tenant share its "
                         "prefix cache); blank lines and # comments skipped")
    sv.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                    help="answer browsers from ORIGIN with CORS headers (repeat it for several; '*': any; "
                         "default: none, no CORS headers)")
    add_webui_arg(sv)
    add_pooling_arg(sv)
    sv.add_argument("--tool-call-parser", default=None, choices=PARSER_NAMES, metavar="NAME",
                    help="tool-call format of the model's answers: " + ", ".join(PARSER_NAMES) +
                         " (default: detected from the chat template; generic for a template with no tool syntax)")
    sv.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted for vLLM's command lines: tool_choice 'auto' is always enabled")
    sv.add_argument("-a", "--alias", default=None, help="model name clients use (default: the GGUF file name)")
    sv.add_argument("-t", "--threads", type=int, default=None, help="numpy backend: threads of the compiled kernels (option kernel_threads; default $METATP_NUM_THREADS)")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_speculative_args(sv)
    sv.set_defaults(func=_cmd_serve)

    i = sub.add_parser("info", help="print metadata, tensor types and sizes")
    i.add_argument("-m", "--model", default=None)
    i.set_defaults(func=_cmd_info)

    try:
        from metatp.tools import dump as _dump

        _dump.add_parser(sub)
    except ImportError:
        pass
    try:
        from metatp.tools import bench as _bench

        _bench.add_parser(sub)
    except ImportError:
        pass
    from metatp.tools import batched_bench as _batched_bench

    _batched_bench.add_parser(sub)
    from metatp.tools import pipeline_bench as _pipeline_bench

    _pipeline_bench.add_parser(sub)
    if "bench" in sub.choices:          # tools/bench's parser (-p longer than -b pipelines)
        add_micro_batches_arg(sub.choices["bench"])
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
