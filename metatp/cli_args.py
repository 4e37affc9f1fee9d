"""The command line's argument builders and the layout they describe, shared by `metatp.cli` and
the subcommands in `metatp.tools` (dump, bench, batched-bench, pipeline-bench), so no tool needs
to import the command itself (that was an import cycle).

Also `Parser`: argparse whose flag errors are one line, the class every metatp parser uses.
"""

from __future__ import annotations

import argparse
import os
import sys

from metatp.backends.registry import ALLREDUCE_CHOICES
from metatp.cli_options import FUSION_OPTIONS, backend_options
from metatp.ir.errors import ConfigError
from metatp.ir.models.common import KV_CACHE_TYPES
from metatp.parallel import FLAGS, parallel_layout

__all__ = ["Parser", "first_rank", "add_model_args", "add_layout_args", "add_split_args", "add_micro_batches_arg",
           "add_numerics_arg", "add_webui_arg", "layout_kwargs", "stage_layout", "SPLIT_CHOICES", "add_speculative_args",
           "speculative_kwargs"]


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (`metatp: error: ...`), not the whole usage block.
    Subcommand parsers are made from this class too (argparse uses the parent's class)."""

    def error(self, message: str):
        prog = self.prog.split()[-1] if " " in self.prog else None
        where = f" {prog}" if prog and prog != "metatp" else ""
        if first_rank():
            print(f"metatp{where}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def first_rank() -> bool:
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
                   help="cupy backend: run eagerly, no CUDA graphs (also llama.cpp's $GGML_CUDA_DISABLE_GRAPHS)")
    p.add_argument("--no-fusion", dest="fusion", action="store_const", const=False, default=None,
                   help="cupy backend: its optional fusions off (options " + ", ".join(FUSION_OPTIONS) + ": the "
                        "attention KV-split merge and the one-token norm+q/k/v+RoPE+KV-write launch run as separate "
                        "kernels; the other fusions have no switch and stay; also llama.cpp's "
                        "$GGML_CUDA_DISABLE_FUSION=1)")
    p.add_argument("--pdl", action="store_const", const=True, default=None,
                   help="cupy backend: programmatic dependent launch (sm_90+ and the pdl extra's cuda-bindings, "
                        "refused otherwise; also llama.cpp's $GGML_CUDA_PDL=1; default off)")
    p.add_argument("--backend-option", dest="backend_option", action="append", default=None, metavar="KEY=VALUE",
                   help="any option of the chosen backend (repeatable; e.g. kv_dtype=f32, mmq_max_tokens=64, "
                        "attn_merge=false; the backends' tables: metatp.backends.registry); a flag setting the "
                        "same option to another value is an error")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's tokens and logits do not depend on its batch-mates, bitwise (also "
                        "$METATP_BATCH_INVARIANT=1 or vLLM's $VLLM_BATCH_INVARIANT=1; cupy: one matmul kernel, "
                        "fixed KV chunks, slower; numpy: the compiled kernels, as by default)")
    add_micro_batches_arg(p)


SPLIT_CHOICES = ["none", "tensor", "layer", "layer,tensor"]


def add_micro_batches_arg(p: argparse.ArgumentParser) -> None:
    """`--micro-batches M` (`main` sets $METATP_MICRO_BATCHES from it, `metatp.pipeline`)."""
    p.add_argument("--micro-batches", default=None, metavar="M",
                   help="-sm layer under mpiexec: passes of a step in flight at once, the stages working on "
                        "different micro-batches (1: off; default auto, $METATP_MICRO_BATCHES; metatp.pipeline)")


def add_numerics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numerics", default="exact", choices=["exact", "q8", "llamacpp"],
                   help="exact (float32) | q8 (llama.cpp's int8 activations and rounding, numpy and cupy "
                        "backends; also spelt llamacpp); default exact")


def add_webui_arg(p: argparse.ArgumentParser) -> None:
    """`metatp serve --no-webui` (llama-server's spelling): no chat page at / (`args.webui`)."""
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / and /chat (default: served, without an API key: "
                        "the page holds no data and asks for the key)")


def add_pooling_arg(p: argparse.ArgumentParser) -> None:
    """llama-server's --pooling (how /v1/embeddings pools a prompt's final hidden states)."""
    p.add_argument("--pooling", default=None, choices=["none", "mean", "cls", "last", "rank"], metavar="NAME",
                   help="embeddings' pooling: mean | cls | last (none and rank are refused); default: the "
                        "model's pooling_type, 'last' where it has none")


def pooling_option(args: argparse.Namespace) -> str | None:
    """--pooling checked before the model is read (a ConfigError naming the flag)."""
    from metatp.embeddings import check_pooling

    return check_pooling(getattr(args, "pooling", None), "--pooling")


def add_split_args(p: argparse.ArgumentParser) -> None:
    """-sm, -ts, and -sm layer,tensor's --pp / --tp (also vLLM's -pp / -tp, --pipeline-parallel-size /
    --tensor-parallel-size)."""
    p.add_argument("-sm", "--split-mode", default=None, choices=SPLIT_CHOICES,
                   help="none | tensor | layer (whole layers per device, -ts their shares) | layer,tensor "
                        "(--pp stages, each a tensor group of --tp devices)")
    p.add_argument("-ts", "--tensor-split", default=None,
                   help="share per device, e.g. 3,1 (-sm layer,tensor: per device of a tensor group)")
    p.add_argument("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=None,
                   help="pipeline stages, layers split between them as -sm layer does (vLLM's -pp; alone: -sm "
                        "layer over P devices; with --tp: -sm layer,tensor)")
    p.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                   help="devices per stage, splitting its layers as -sm tensor does (vLLM's -tp; alone: -sm "
                        "tensor over T devices; with --pp: -sm layer,tensor)")


def stage_layout(n: int | None, mode: str | None, ts: tuple[float, ...] | None, pp: int | None,
                 tp: int | None) -> tuple[int | None, str | None, tuple[float, ...] | None]:
    """(n_devices, split_mode, tensor_split) with -sm layer,tensor's --pp / --tp applied: P x T
    devices, -ts one share per device of a tensor group (equal shares by default: its length is
    how `DeviceLayout` knows T). `n`: --devices or the world size, if given. Errors name the flag.
    Without -sm the sizes choose the mode as vLLM's -tp / -pp do (T alone: tensor; P alone: layer;
    both: layer,tensor); the mapping is `metatp.parallel`'s, shared with `LLM`."""
    if pp is None and tp is None:
        if mode == "layer,tensor" and ts is None:
            raise ConfigError("-sm layer,tensor needs --tp T (devices per stage) and --pp P (stages), or "
                              "--tp with --devices / mpiexec -n P*T")
        return n, mode, ts
    return parallel_layout(n, mode, ts, pp, tp, FLAGS)


def layout_kwargs(args: argparse.Namespace) -> dict:
    """n_devices / split_mode / tensor_split from the flags (-ts alone implies its device count;
    under `mpiexec -n N` without either, the world size does), and the backend options the
    flags set, checked against the chosen backend (`cli_options.backend_options`: --no-cuda-graphs,
    --no-fusion, --pdl, -t N, --batch-invariant, --backend-option KEY=VALUE, llama.cpp's
    GGML_CUDA_* switches on cupy)."""
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
    try:
        options = backend_options(args)
    except ConfigError as e:
        raise every_rank(e) from None
    out = {"n_devices": n, "split_mode": mode, "tensor_split": ts,
           "memory_budget": getattr(args, "memory_budget", None), "fit_context": getattr(args, "fit", False),
           "allreduce": getattr(args, "allreduce", "auto"), "backend_options": options,
           "cache_type_k": getattr(args, "cache_type_k", "f32"), "cache_type_v": getattr(args, "cache_type_v", None)}
    return out


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (`metatp.speculative`): llama.cpp's -md / --draft-max and lookup
    decoding's n-gram sizes; `--spec ngram|draft` names the method (-md alone means draft)."""
    p.add_argument("--spec", "--speculative", dest="spec", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: ngram (prompt lookup, no draft model) | draft (with -md)")
    p.add_argument("-md", "--model-draft", dest="model_draft", default=None, metavar="PATH",
                   help="draft model for speculative decoding (GGUF path or known name; implies --spec draft)")
    p.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default 8)")
    p.add_argument("--lookup-ngram-max", dest="lookup_max", type=int, default=3, metavar="N",
                   help="--spec ngram: longest n-gram looked up (vLLM's prompt_lookup_max; default 3)")
    p.add_argument("--lookup-ngram-min", dest="lookup_min", type=int, default=1, metavar="N",
                   help="--spec ngram: shortest n-gram looked up (vLLM's prompt_lookup_min; default 1)")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """LLM's speculative_config from the flags ({} without --spec / -md)."""
    method = args.spec or ("draft" if args.model_draft else None)
    if method is None:
        if args.draft_max is not None:
            raise ConfigError("--draft-max needs --spec ngram or -md PATH (a draft model)")
        return {}
    if args.draft_max is not None and args.draft_max < 1:
        raise ConfigError(f"--draft-max must be >= 1, got {args.draft_max}")
    cfg = {"method": method, "num_speculative_tokens": 8 if args.draft_max is None else args.draft_max}
    if method == "ngram":
        cfg.update(prompt_lookup_max=args.lookup_max, prompt_lookup_min=args.lookup_min)
        if args.model_draft:
            raise ConfigError("--spec ngram takes no draft model (-md); use --spec draft")
    else:
        if not args.model_draft:
            raise ConfigError("--spec draft needs a draft model: -md PATH")
        cfg["model"] = args.model_draft
    return {"speculative_config": cfg}
