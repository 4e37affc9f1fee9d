"""The `metatp` command: generate, serve, info, dump, bench, batched-bench. llama.cpp's flag spellings where they exist.

Every deliberate error is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from metatp.backends.registry import ALLREDUCE_CHOICES
from metatp.ir.models.common import KV_CACHE_TYPES
from metatp.ir.errors import ConfigError, MetatpError
from metatp import pipeline

__all__ = ["main", "add_model_args", "add_layout_args", "add_split_args", "layout_kwargs", "stage_layout", "SPLIT_CHOICES"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (`metatp: error: ...`), not the whole usage block.
    Subcommand parsers are made from this class too (argparse uses the parent's class)."""

    def error(self, message: str):
        prog = self.prog.split()[-1] if " " in self.prog else None
        where = f" {prog}" if prog and prog != "metatp" else ""
        if _first_rank():
            print(f"metatp{where}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _first_rank() -> bool:
    """Print a flag error here? Under mpiexec every rank parses the same flags: rank 0 says it."""
    from metatp.backends.distributed import launched_rank

    return launched_rank() in (None, 0)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF path or known model name (default: smollm2-135m)")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help="context size (default 2048, capped at the model's trained context)")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="auto | numpy | cupy (default auto)")
    p.add_argument("-ctk", "--cache-type-k", default="f32", choices=list(KV_CACHE_TYPES), metavar="TYPE",
                   help="KV cache type for K: " + " | ".join(KV_CACHE_TYPES) + " (default f32)")
    p.add_argument("-ctv", "--cache-type-v", default=None, choices=list(KV_CACHE_TYPES), metavar="TYPE",
                   help="KV cache type for V (default: as -ctk)")
    p.add_argument("--devices", type=int, default=None, help="number of devices to split across")
    add_split_args(p)
    p.add_argument("--mem", dest="memory_budget", default=None, help="memory budget per device, e.g. 8GiB")
    p.add_argument("--fit", action="store_true", help="shrink the context to what fits the memory budget")
    p.add_argument("--allreduce", default=os.environ.get("GGML_CUDA_ALLREDUCE", "auto"), metavar="MODE",
                   help="all-reduce between devices: " + " | ".join(ALLREDUCE_CHOICES)
                   + " (llama.cpp's GGML_CUDA_ALLREDUCE spellings; default $GGML_CUDA_ALLREDUCE or auto)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="cupy backend: run eagerly, no CUDA graphs (llama.cpp's GGML_CUDA_DISABLE_GRAPHS=1)")
    add_micro_batches_arg(p)


SPLIT_CHOICES = ["none", "tensor", "layer", "layer,tensor"]


def add_micro_batches_arg(p: argparse.ArgumentParser) -> None:
    """`--micro-batches M` (`main` sets $METATP_MICRO_BATCHES from it, `metatp.pipeline`)."""
    p.add_argument("--micro-batches", default=None, metavar="M",
                   help="-sm layer under mpiexec: passes of a step in flight at once, the stages working on "
                        "different micro-batches (1: off; default auto, $METATP_MICRO_BATCHES; metatp.pipeline)")


def add_numerics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numerics", default="exact", choices=["exact", "q8", "llamacpp"],
                   help="numpy backend: exact (float32) | q8 (llama.cpp's int8 activations and rounding; "
                        "also spelt llamacpp); default exact")


def add_split_args(p: argparse.ArgumentParser) -> None:
    """-sm, -ts, and -sm layer,tensor's --pp / --tp (vLLM's spellings)."""
    p.add_argument("-sm", "--split-mode", default=None, choices=SPLIT_CHOICES,
                   help="none | tensor | layer (whole layers per device, -ts their shares) | layer,tensor "
                        "(--pp stages, each a tensor group of --tp devices)")
    p.add_argument("-ts", "--tensor-split", default=None,
                   help="share per device, e.g. 3,1 (-sm layer,tensor: per device of a tensor group)")
    p.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=None,
                   help="-sm layer,tensor: pipeline stages (layers split between them as -sm layer does)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                   help="-sm layer,tensor: devices per stage, splitting its layers as -sm tensor does")


def stage_layout(n: int | None, mode: str | None, ts: tuple[float, ...] | None, pp: int | None,
                 tp: int | None) -> tuple[int | None, str | None, tuple[float, ...] | None]:
    """(n_devices, split_mode, tensor_split) with -sm layer,tensor's --pp / --tp applied: P x T
    devices, -ts one share per device of a tensor group (equal shares by default: its length is
    how `DeviceLayout` knows T). `n`: --devices or the world size, if given. Errors name the flag."""
    if pp is None and tp is None:
        if mode == "layer,tensor" and ts is None:
            raise ConfigError("-sm layer,tensor needs --tp T (devices per stage) and --pp P (stages), or "
                              "--tp with --devices / mpiexec -n P*T")
        return n, mode, ts
    if mode != "layer,tensor":
        raise ConfigError(f"--pp / --tp need -sm layer,tensor (got -sm {mode or 'none'})")
    for flag, v in (("--pp", pp), ("--tp", tp)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    if tp is None:
        tp = len(ts) if ts else None
        if tp is None and n is not None and n % pp == 0:
            tp = n // pp
        if tp is None:
            raise ConfigError(f"--pp {pp}: give --tp T too (devices per stage)")
    if ts is not None and len(ts) != tp:
        raise ConfigError(f"-ts has {len(ts)} shares but --tp is {tp}: under -sm layer,tensor -ts gives each "
                          "device of a tensor group its share")
    if pp is None:
        if n is None or n % tp:
            raise ConfigError(f"--tp {tp}: give --pp P too (stages)" if n is None else
                              f"--tp {tp} does not divide the {n} devices into stages; give --pp P")
        pp = n // tp
    if n is not None and n != pp * tp:
        raise ConfigError(f"--pp {pp} x --tp {tp} is {pp * tp} devices, but --devices / mpiexec -n gives {n}")
    return pp * tp, mode, ts if ts is not None else (1.0,) * tp


def layout_kwargs(args: argparse.Namespace) -> dict:
    """n_devices / split_mode / tensor_split from the flags (-ts alone implies its device count;
    under `mpiexec -n N` without either, the world size does), and the backend options the
    flags set (`--no-cuda-graphs`; `-t N`: the numpy backend's kernel_threads)."""
    from metatp.backends.distributed import every_rank, launched_world_size
    from metatp.passes.plan import DeviceLayout

    ts = DeviceLayout.parse_split(args.tensor_split) if args.tensor_split else None
    staged = args.split_mode == "layer,tensor"
    n = args.devices if args.devices is not None else (len(ts) if ts and not staged else None)
    world = launched_world_size()
    if n is None and world is not None and world > 1:
        n = world
    try:
        n, mode, ts = stage_layout(n, args.split_mode, ts, getattr(args, "pp", None), getattr(args, "tp", None))
    except ConfigError as e:
        raise every_rank(e) from None     # every rank parses the same flags: rank 0 says it
    if n is None:
        n = len(ts) if staged and ts else 1     # -sm layer,tensor -ts alone: one stage
    mode = mode or ("tensor" if n > 1 or ts else "none")
    options = {} if getattr(args, "cuda_graphs", True) else {"cuda_graphs": False}
    if getattr(args, "threads", None):
        options["kernel_threads"] = args.threads
    return {"n_devices": n, "split_mode": mode, "tensor_split": ts,
            "memory_budget": getattr(args, "memory_budget", None), "fit_context": getattr(args, "fit", False),
            "allreduce": getattr(args, "allreduce", "auto"), "backend_options": options,
            "cache_type_k": getattr(args, "cache_type_k", "f32"), "cache_type_v": getattr(args, "cache_type_v", None)}


def _cmd_generate(args: argparse.Namespace) -> int:
    from metatp.api import LLM

    seed = None if args.seed == -1 else args.seed          # llama.cpp: -s -1 is a random seed
    llm = LLM(args.model, n_ctx=args.n_ctx, backend=args.backend, seed=seed, verbose=True, numerics=args.numerics,
              **layout_kwargs(args))
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
    options = layout_kwargs(args)
    llm = LLM(args.model, n_ctx=args.n_ctx, backend=args.backend, max_num_seqs=args.parallel,
              max_waiting=args.max_waiting, n_batch=args.batch_size, max_model_len=args.max_model_len,
              enable_prefix_caching=args.prefix_caching, numerics=args.numerics, verbose=True, **options)
    key = args.api_key or os.environ.get("METATP_API_KEY") or None
    if args.warmup and llm.world is None:
        # the plans of decode steps and of prompts arriving together, now, not in the first burst
        llm.engine.warm_up(args.parallel)
    if llm.world is None or llm.world.is_root:        # under mpiexec only rank 0 listens
        print(f"metatp: serving {llm.model_path} on http://{args.host}:{args.port}/v1 "
              f"(n_ctx {llm.n_ctx}, {args.parallel} parallel sequences, "
              f"max_model_len {llm.max_model_len or max(1, llm.n_ctx // args.parallel)})", file=sys.stderr, flush=True)
    serve(llm, host=args.host, port=args.port, model_name=args.alias, api_key=key, log_level=args.log_level)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from metatp.tools.info import print_info

    print_info(args.model)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="metatp", description="GGUF models with tensor parallelism, from Python")
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
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (default $METATP_API_KEY)")
    sv.add_argument("-a", "--alias", default=None, help="model name clients use (default: the GGUF file name)")
    sv.add_argument("-t", "--threads", type=int, default=None, help="numpy backend: threads of the compiled kernels (option kernel_threads; default $METATP_NUM_THREADS)")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
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
    if "bench" in sub.choices:          # tools/bench.py's parser (-p longer than -b pipelines)
        add_micro_batches_arg(sub.choices["bench"])
    return ap


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"metatp: warning: {message}", file=sys.stderr)


def _check_args(args: argparse.Namespace) -> None:
    """What argparse's types cannot say: bench's device counts (a list) are >= 1; generate's single
    count is checked by the layout (n_devices); --micro-batches is 1..64 or auto (then applied)."""
    micro = getattr(args, "micro_batches", None)
    if micro is not None:          # every engine of this process reads it (metatp.pipeline)
        os.environ[pipeline.ENV] = str(pipeline.parse_micro_batches(micro, "--micro-batches") or "auto")
    devices = getattr(args, "devices", None)
    if isinstance(devices, str):
        for part in devices.split(","):
            part = part.strip()
            if part and (not part.lstrip("-").isdigit() or int(part) < 1):
                raise ConfigError(f"--devices: device counts must be integers >= 1, got {devices!r}")


def _read_prompt_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read prompt file {path!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read prompt file {path!r}: it is not UTF-8 text "
                          f"(byte 0x{data[e.start]:02x} at offset {e.start})") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = _build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:          # --help, or a bad flag (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    try:
        _check_args(args)
        if getattr(args, "file", None):
            args.prompt = _read_prompt_file(args.file)
    except MetatpError as e:
        if _first_rank():
            print(f"metatp: error: {e}", file=sys.stderr)
        return 1
    warnings.showwarning = _warning_line
    from metatp.backends.distributed import finish_error     # under mpiexec: print once, end every rank

    try:
        return int(args.func(args) or 0)
    except MetatpError as e:
        return finish_error(e, f"metatp: error: {e}", 1)
    except KeyboardInterrupt as e:
        return finish_error(e, "\nmetatp: interrupted", 130)
    except BrokenPipeError:
        return 0
    except MemoryError as e:
        return finish_error(e, "metatp: error: out of memory (try a smaller -c / n_ctx or more devices)", 1)
    except RecursionError:
        print("metatp: error: the model is nested too deeply to process (recursion limit)", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line for the user, the traceback on request
        if os.environ.get("METATP_DEBUG"):
            raise
        return finish_error(e, f"metatp: internal error: {type(e).__name__}: {e}\n"
                            "metatp: hint: this is a bug in metatp; rerun with METATP_DEBUG=1 for the traceback", 2)


if __name__ == "__main__":
    raise SystemExit(main())
