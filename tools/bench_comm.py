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
- none: nothing.
"""

from __future__ import annotations

from metatp.tools.dump.layer_bill import transfer_bill
from metatp.tools.dump.view import DEFAULT_PREFILL_TOKENS, LINKS, communication_bill

__all__ = ["COMM_FIELDS", "modelled_communication", "format_bytes"]

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
