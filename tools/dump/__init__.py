"""`metatp dump`: show how a model's graph is split across devices, pass by pass.

The compiler's output (a Plan) is plain data; this tool prints it for a person (text), for a
program (json, schema in docs/dump-format.md) or as a picture (dot / svg, one cluster per
subgraph, nodes coloured by split state). Its summary adds what the Plan implies: per-device
weight and KV bytes, the mirrored overhead, and the communication bill of tensor parallelism
(bytes the chosen all-reduce schedule moves, reductions per token, tensor vs layer split,
latency per token); for -sm layer, the layer assignment and the copies between devices
(`layer_bill`).

The graph is built from the GGUF header only (tensor infos and scalar metadata); no weight is
read or dequantised, so dumping the default model takes well under two seconds.

Under `mpiexec -n N metatp dump ...` the device count defaults to the world size (as for
`generate`; a --devices or -ts that disagrees is one error line, printed once) and rank 0
alone compiles and prints: the other ranks check the flags, print nothing and exit 0. MPI
itself is not started (the launcher's environment says the rank and size).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from metatp.backends.collectives.schedule import resolve_mode
from metatp.backends.collectives.wire import wire_dtype
from metatp.ir.errors import ConfigError
from metatp.ir.graph import Graph
from metatp.ir.models.common import KV_CACHE_TYPES
from metatp.ir.tensor import Flag
from metatp.passes.plan import Plan
from metatp.tools.dump.view import (DEFAULT_N_CTX, DEFAULT_PREFILL_TOKENS, FORMATS, LINKS, PHASES, Link, PlanView, as_link,
                                    communication_bill, node_layers, plan_summary, raw_weight_bytes)
from metatp.tools.dump.text import format_text
from metatp.tools.dump.json_format import format_json
from metatp.tools.dump.layer_bill import transfer_bill
from metatp.tools.dump.stage_bill import stage_bill
from metatp.tools.dump.dot import format_dot, render_svg

__all__ = ["dump", "dump_model", "DumpRequest", "mpi_layout", "Link", "LINKS", "FORMATS", "PHASES",
           "communication_bill", "raw_weight_bytes", "node_layers", "add_parser"]


# ---------------------------------------------------------------- public entry points


def _info(plan: Plan, layer: int | None, model: dict | None, batch: dict | None) -> dict:
    lay = plan.layout
    return {
        "graph": plan.graph.name,
        "stage": (plan.stats or {}).get("stage", "lowered"),
        "layer": layer,
        "model": model,
        "batch": batch,
        "layout": {"n_devices": lay.n_devices, "split_mode": lay.split_mode,
                   "tensor_split": list(lay.tensor_split) if lay.tensor_split is not None else None},
    }


def _batch_from_graph(graph: Graph, n_ctx: int | None) -> dict | None:
    spec = graph.meta.get("spec")
    if spec is None:
        return None
    phase = "decode" if spec.n_tokens == 1 else "prefill"
    return {"phase": phase, "n_tokens": spec.n_tokens, "n_kv": spec.n_kv, "n_outputs": spec.n_outputs,
            "n_ctx": n_ctx}


def _infer_n_ctx(graph: Graph) -> int:
    """The context size, from the KV cache leaves (0 for graphs without a cache)."""
    return max((t.ne[1] for t in graph.leaves if t.flags & Flag.KV_CACHE), default=0)


def dump(plan: Plan, fmt: str = "text", *, layer: int | None = None, link: Link | str = "nvlink",
         hparams=None, n_ctx: int | None = None, n_tokens: int | None = None, lowered: Plan | None = None,
         model: dict | None = None, batch: dict | None = None, allreduce: str = "auto", wire: str = "f32") -> str:
    """The plan as text, json, dot or svg.

    layer: only that layer's nodes (and the leaves they read); the summary stays whole-plan.
    link: a preset name or a Link, for the communication bill. hparams: the model's HParams
    (n_embd / n_layer for the bill; read off the graph when absent). lowered: the final plan,
    when `plan` is an earlier stage, so per-device memory can still be reported. allreduce / wire:
    the all-reduce mode and wire dtype the bill charges (a mode of collectives.ALLREDUCE_MODES)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    resolve_mode(allreduce)
    wire_dtype(2, 0, wire)
    view = PlanView(plan, layer, allreduce, wire)
    if n_ctx is None:
        n_ctx = _infer_n_ctx(plan.graph)
    if n_tokens is None:
        spec = plan.graph.meta.get("spec")
        n_tokens = spec.n_tokens if spec is not None else 1
    if batch is None:
        batch = _batch_from_graph(plan.graph, n_ctx)
    info = _info(plan, layer, model, batch)
    if fmt in ("dot", "svg"):
        dot_text = format_dot(view, info)
        return dot_text if fmt == "dot" else render_svg(dot_text)
    summary = plan_summary(view, lowered, as_link(link), n_tokens, hparams, n_ctx)
    summary["transfers"] = None
    if plan.layout.split_mode == "layer" and plan.tensors:
        summary["communication"] = None          # nothing is all-reduced: the copies are the bill
        summary["transfers"] = transfer_bill(plan, as_link(link), n_tokens)
    summary["stages"] = None
    if plan.layout.split_mode == "layer,tensor" and plan.tensors:
        summary["communication"] = None          # all-reduces within each group, and copies: the stage bill
        summary["stages"] = stage_bill(plan, as_link(link), n_tokens, allreduce, wire)
    if fmt == "json":
        return format_json(view, info, summary, hparams)
    return format_text(view, info, summary, hparams)


@dataclass
class DumpRequest:
    """What `metatp dump` was asked for (the CLI flags, as data)."""

    model: str | None = None
    n_devices: int | None = None
    split_mode: str | None = None
    tensor_split: tuple[float, ...] | None = None       # -sm layer,tensor: a tensor group's shares (--tp of them)
    phase: str = "decode"
    n_tokens: int | None = None
    n_ctx: int | None = None
    stage: str = "lowered"
    layer: int | None = None
    fmt: str = "text"
    link: Link = LINKS["nvlink"]
    allreduce: str = "auto"
    wire: str = "f32"
    cache_type_k: str = "f32"
    cache_type_v: str | None = None


def _layout(req: DumpRequest):
    from metatp.passes.plan import DeviceLayout

    ts = req.tensor_split
    staged = req.split_mode == "layer,tensor"
    n = req.n_devices if req.n_devices is not None else (len(ts) if ts else 1)
    mode = req.split_mode or ("tensor" if n > 1 or ts else "none")
    return DeviceLayout(n, mode, tuple(ts) if ts else None, tp=len(ts) if staged and ts else None)


def _batch_spec(req: DumpRequest, n_ctx: int):
    """Decode: one token with the cache full (the largest decode step). Prefill: n_tokens into an
    empty cache, logits for the last one (as the engine runs a prompt)."""
    from metatp.engine import padded_kv
    from metatp.ir.models import BatchSpec

    if req.phase not in PHASES:
        raise ConfigError(f"--phase must be one of {', '.join(PHASES)}, got {req.phase!r}")
    if req.phase == "decode":
        if req.n_tokens not in (None, 1):
            raise ConfigError("--n-tokens sets the prefill batch; a decode step is always 1 token "
                              "(use --phase prefill)")
        return BatchSpec(1, padded_kv(n_ctx, n_ctx), 1)
    T = DEFAULT_PREFILL_TOKENS if req.n_tokens is None else req.n_tokens
    if T < 1:
        raise ConfigError(f"--n-tokens must be >= 1, got {T}")
    if T > n_ctx:
        raise ConfigError(f"--n-tokens {T} does not fit in the context of {n_ctx} (raise -c)")
    return BatchSpec(T, padded_kv(T, n_ctx), 1)


def _compile(graph: Graph, layout, hparams, stage: str) -> tuple[Plan, Plan]:
    """(the requested stage's plan, the lowered plan) -- memory needs the lowered one."""
    from metatp.passes.compile import STAGES, compile_stages
    from metatp.passes.plan import single_device_plan

    if stage not in STAGES:
        raise ConfigError(f"--stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if layout.split_mode == "none":
        plan = single_device_plan(graph)
        return plan, plan
    if layout.split_mode in ("layer", "layer,tensor") and stage not in ("built", "lowered"):
        raise ConfigError(f"--stage {stage}: -sm {layout.split_mode} has the stages built and lowered only (the "
                          "others are -sm tensor's passes)")
    stages = compile_stages(graph, layout, hparams, keep_all=stage != "lowered")
    return stages[stage], stages["lowered"]


def dump_model(req: DumpRequest) -> str:
    """Build the model's graph for the requested batch (no weights read), compile, dump."""
    from metatp.ir.models import ModelTensors, build_graph
    from metatp.ir.models.common import cache_type
    from metatp.models import resolve_model

    path = resolve_model(req.model)
    from metatp.ir.loader import load_model

    model = load_model(path, with_tokenizer=False)
    hp = model.hparams
    n_ctx = req.n_ctx if req.n_ctx is not None else min(DEFAULT_N_CTX, hp.n_ctx_train)
    if n_ctx < 1:
        raise ConfigError(f"-c must be >= 1, got {n_ctx}")
    layout = _layout(req)
    spec = _batch_spec(req, n_ctx)
    kt = cache_type(req.cache_type_k, "k")
    vt = kt if req.cache_type_v is None else cache_type(req.cache_type_v, "v")
    graph = build_graph(ModelTensors(model, n_ctx, kt, vt), spec)
    plan, lowered = _compile(graph, layout, hp, req.stage)
    model_info = {"path": str(path), "name": model.name, "arch": model.arch, "n_layer": hp.n_layer,
                  "n_embd": hp.n_embd, "n_head": hp.n_head, "n_head_kv": hp.n_head_kv[0] if hp.n_head_kv else None,
                  "n_vocab": hp.n_vocab, "tensor_data_bytes": model.weight_bytes()}
    batch = {"phase": req.phase, "n_tokens": spec.n_tokens, "n_kv": spec.n_kv, "n_outputs": spec.n_outputs,
             "n_ctx": n_ctx}
    return dump(plan, req.fmt, layer=req.layer, link=req.link, hparams=hp, n_ctx=n_ctx, n_tokens=spec.n_tokens,
                lowered=lowered, model=model_info, batch=batch, allreduce=req.allreduce, wire=req.wire)


# ---------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    from metatp.backends.collectives.schedule import MODE_NAMES
    from metatp.backends.collectives.wire import WIRE_MODES
    from metatp.passes.compile import STAGES

    d = sub.add_parser("dump", help="show how the graph is split across devices (text, json, dot, svg)",
                       description="Compile the model's graph for a device layout and print the plan: split "
                                   "state of every tensor, subgraphs, all-reduces, memory and the communication bill.")
    d.add_argument("-m", "--model", default=None, help="GGUF path or known model name (default: smollm2-135m)")
    d.add_argument("--devices", type=int, default=None, help="number of devices to split across")
    from metatp.cli_args import add_split_args

    add_split_args(d)
    d.add_argument("--phase", default="decode", choices=PHASES, help="decode (1 token, full cache) | prefill")
    d.add_argument("--n-tokens", type=int, default=None, help=f"prefill batch size (default {DEFAULT_PREFILL_TOKENS})")
    d.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help="context size (default 2048, capped at the model's trained context)")
    d.add_argument("--stage", default="lowered", choices=STAGES, help="dump the plan after this pass (default lowered)")
    d.add_argument("--layer", type=int, default=None, help="only this layer's nodes")
    d.add_argument("--format", dest="fmt", default="text", choices=FORMATS, help="text | json | dot | svg")
    d.add_argument("-o", "--output", default=None, help="write to FILE instead of stdout")
    d.add_argument("--link", default="nvlink", choices=sorted(LINKS), help="interconnect preset for the bill")
    d.add_argument("--latency-us", type=float, default=None, help="override: fixed cost of one all-reduce (us)")
    d.add_argument("--bandwidth-gbs", type=float, default=None, help="override: link bandwidth (GB/s)")
    d.add_argument("--allreduce", default="auto", help=f"all-reduce the bill charges: {' | '.join(MODE_NAMES)} "
                   "(auto: the butterfly, as the numpy backend; nccl is billed as a ring)")
    d.add_argument("-ctk", "--cache-type-k", default="f32", choices=list(KV_CACHE_TYPES), metavar="TYPE",
                   help="KV cache type for K (the memory summary counts its real bytes)")
    d.add_argument("-ctv", "--cache-type-v", default=None, choices=list(KV_CACHE_TYPES), metavar="TYPE",
                   help="KV cache type for V (default: as -ctk)")
    d.add_argument("--wire", default="f32", help=f"all-reduce wire dtype for the bill: {' | '.join(WIRE_MODES)}")
    d.set_defaults(func=_cmd_dump)


def _link_from_args(args: argparse.Namespace) -> Link:
    base = LINKS[args.link]
    lat = base.latency_us if args.latency_us is None else args.latency_us
    bw = base.bandwidth_gbs if args.bandwidth_gbs is None else args.bandwidth_gbs
    if not lat >= 0:
        raise ConfigError(f"--latency-us must be >= 0, got {lat}")
    if not bw > 0:
        raise ConfigError(f"--bandwidth-gbs must be > 0, got {bw}")
    return Link(base.name, lat, bw)


def mpi_layout(n_devices: int | None, split_mode: str | None,
               tensor_split: tuple[float, ...] | None) -> tuple[int | None, str | None, bool]:
    """(n_devices, split_mode, print here?) under an MPI launcher: the world size is the device
    count, checked as `generate` checks it (an error every rank raises, rank 0 prints), and only
    rank 0 prints. Outside mpiexec (or -n 1) the flags pass through."""
    from metatp.backends.distributed import World, launched_rank, launched_world_size

    size = launched_world_size()
    if size is None or size <= 1:
        return n_devices, split_mode, True
    rank = launched_rank() or 0
    world = World(comm=None, rank=rank, size=size)      # only its layout rules; MPI is not started
    n, mode = world.layout_for(n_devices, split_mode, tensor_split)
    return n, mode, rank == 0


def _request(args: argparse.Namespace) -> tuple[DumpRequest, bool]:
    """(the request the flags make, print on this process?)."""
    from metatp.passes.plan import DeviceLayout

    from metatp.cli_args import stage_layout

    ts = DeviceLayout.parse_split(args.tensor_split) if args.tensor_split else None
    n_devices, split_mode, prints = mpi_layout(args.devices, args.split_mode, ts)
    n_devices, split_mode, ts = stage_layout(n_devices, split_mode, ts, args.pp, args.tp)
    req = DumpRequest(model=args.model, n_devices=n_devices, split_mode=split_mode, tensor_split=ts,
                      phase=args.phase, n_tokens=args.n_tokens, n_ctx=args.n_ctx, stage=args.stage,
                      layer=args.layer, fmt=args.fmt, link=_link_from_args(args), allreduce=args.allreduce,
                      wire=args.wire, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    return req, prints


def _cmd_dump(args: argparse.Namespace) -> int:
    from metatp.backends.distributed import every_rank, launched_world_size
    from metatp.ir.errors import MetatpError

    try:
        req, prints = _request(args)
    except MetatpError as e:
        if (launched_world_size() or 1) > 1:
            raise every_rank(e) from None       # same flags on every rank: rank 0 says it once
        raise
    if not prints:
        return 0
    text = dump_model(req)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot write {args.output!r}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)
    return 0
