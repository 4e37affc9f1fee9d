"""What a `metatp bench` row's split moves between devices, as `metatp dump` bills it.

A user choosing a split mode weighs the measured tokens/s against what each mode sends over
the links (issue 27): a tensor split all-reduces twice per layer, a layer split hands one hidden
vector across each device boundary. The row carries the dump's numbers for its layout (bytes
only: they do not depend on the link preset):

- per token, a one-token decode step: tensor, the bytes the busiest rank sends in the step's
  all-reduces (`dump` summary `communication.bytes_per_rank_per_token`, the all-reduce the
  backend runs, MPI billed as the butterfly); layer, the copies of the step (`transfers.bytes_per_token`);
- per prompt of DEFAULT_PREFILL_TOKENS (512) tokens, logits for the last: tensor, the same for
  that prefill step (`dump --phase prefill`: `communication.bytes_per_rank_per_step`); layer,
  `transfers.bytes_per_prompt`;
- layer,tensor: the busiest rank's bytes, its group's all-reduces (over its T devices) plus the
  copies it sends at its stage boundary (`stage_bill`), per one-token step and per 512-token
  prefill step;
- none: nothing.

-sm layer,tensor rows take `--pp P --tp T` (`add_stage_args`); in bench's comma-separated -sm
list the combined mode is `layer+tensor` (or the whole -sm value `layer,tensor` with --pp/--tp).
"""

from __future__ import annotations

from metatp.ir.errors import ConfigError
from metatp.tools.dump.layer_bill import transfer_bill
from metatp.tools.dump.stage_bill import stage_bill
from metatp.tools.dump.view import DEFAULT_PREFILL_TOKENS, LINKS, communication_bill

__all__ = ["COMM_FIELDS", "modelled_communication", "format_bytes", "add_stage_args", "parse_modes", "stage_layouts",
           "MODES"]

MODES = ("none", "tensor", "layer", "layer,tensor")

COMM_FIELDS = ("comm_bytes_per_token", "comm_bytes_per_prompt", "comm_prompt_tokens")


def _plan(llm, n_tokens: int):
    """The plan `metatp dump` compiles for this layout: n_tokens into a cache that holds them,
    logits for the last (no weights read, no buffers)."""
    from metatp.engine import padded_kv
    from metatp.ir.models import BatchSpec, ModelTensors, build_graph
    from metatp.passes import compile_plan

    tensors = llm.engine.tensors
    n_ctx = max(llm.n_ctx, n_tokens)
    graph = build_graph(ModelTensors(llm.model, n_ctx, tensors.kv_type, tensors.kv_type_v),
                        BatchSpec(n_tokens, padded_kv(n_tokens, n_ctx), 1))
    return compile_plan(graph, llm.layout, llm.model.hparams)


def modelled_communication(llm) -> dict:
    """The row fields: bytes per token, per prompt, and the prompt's length (see the module doc)."""
    mode, prompt = llm.layout.split_mode, DEFAULT_PREFILL_TOKENS
    out = {"comm_bytes_per_token": 0, "comm_bytes_per_prompt": 0, "comm_prompt_tokens": prompt}
    if mode == "none" or llm.layout.n_devices == 1:
        return out
    link = LINKS["nvlink"]
    if mode == "layer":
        bill = transfer_bill(_plan(llm, 1), link, 1)
        return dict(out, comm_bytes_per_token=bill["bytes_per_token"], comm_bytes_per_prompt=bill["bytes_per_prompt"])
    info = llm.backend.describe()
    billed = "butterfly" if info.allreduce == "mpi" else info.allreduce
    if mode == "layer,tensor":
        token = stage_bill(_plan(llm, 1), link, 1, billed, info.wire)
        step = stage_bill(_plan(llm, prompt), link, prompt, billed, info.wire)
        return dict(out, comm_bytes_per_token=token["busiest_rank_bytes_per_token"],
                    comm_bytes_per_prompt=step["busiest_rank_bytes_per_step"])
    hp = llm.model.hparams
    token = communication_bill(_plan(llm, 1), link, n_tokens=1, hparams=hp, allreduce=billed, wire=info.wire)
    step = communication_bill(_plan(llm, prompt), link, n_tokens=prompt, hparams=hp, allreduce=billed,
                              wire=info.wire)
    return dict(out, comm_bytes_per_token=token["bytes_per_rank_per_token"],
                comm_bytes_per_prompt=step["bytes_per_rank_per_step"])


def format_bytes(n: int | None) -> str:
    """A byte count for the table: B, KiB, MiB (empty for None)."""
    if n is None:
        return ""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def add_stage_args(b) -> None:
    """bench's --pp / --tp: the stages and tensor-group size of its -sm layer,tensor rows."""
    b.add_argument("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=None,
                   help="-sm layer+tensor rows: pipeline stages")
    b.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                   help="-sm layer+tensor rows: devices per stage (a tensor group)")


def parse_modes(text: str, pp: int | None, tp: int | None) -> list[str]:
    """bench's -sm list: modes separated by commas, `layer+tensor` the combined one; the whole
    value `layer,tensor` with --pp / --tp is that mode alone. ConfigErrors name the flag."""
    staged = pp is not None or tp is not None
    if text.replace(" ", "") == "layer,tensor" and staged:
        modes = ["layer,tensor"]
    else:
        modes = ["layer,tensor" if m.strip() == "layer+tensor" else m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"-sm: unknown split mode {m!r} (none, tensor, layer, layer+tensor)")
    if "layer,tensor" in modes:
        for flag, v in (("--pp", pp), ("--tp", tp)):
            if v is None or v < 1:
                raise ConfigError(f"-sm layer+tensor needs {flag} >= 1, got {v}")
    elif staged:
        raise ConfigError("--pp / --tp need -sm layer+tensor (or -sm layer,tensor) in bench's -sm list")
    return modes


def stage_layouts(layouts: list[tuple], pp: int | None, tp: int | None) -> list[tuple]:
    """bench's (n_devices, split_mode, tensor_split) rows with each layer,tensor row made
    --pp x --tp devices, -ts a group's shares (equal unless a -ts of --tp shares was given)."""
    out: list[tuple] = []
    for n, sm, ts in layouts:
        if sm == "layer,tensor":
            n, ts = pp * tp, ts if ts is not None and len(ts) == tp else (1.0,) * tp
        if (n, sm, ts) not in out:
            out.append((n, sm, ts))
    return out
