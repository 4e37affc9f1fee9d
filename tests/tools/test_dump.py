"""`metatp dump`: golden plans (default model, MoE block, parallel residual), the JSON schema doc,
the communication bill, every stage and format, and one-line errors."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from metatp.backends.collectives import butterfly_schedule, bytes_per_rank
from metatp.ir import ops
from metatp.ir.errors import ConfigError, MetatpError
from metatp.ir.graph import Graph
from metatp.ir.ops import GluOp, RopeMode
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.passes.compile import STAGES, compile_plan
from metatp.passes.memory import plan_memory
from metatp.passes.plan import DeviceLayout, Plan, Reduction, Subgraph
from metatp.tools import dump as dump_mod
from metatp.tools.dump import dot as dump_dot
from metatp.tools.dump import DumpRequest, Link, communication_bill, dump, dump_model, raw_weight_bytes
from metatp.testing.synth import SynthSpec
from support.require import require


DOC = Path(__file__).resolve().parents[2] / "docs" / "dump-format.md"
F32 = GGMLType.F32
TWO = DeviceLayout(2, "tensor")


# ---------------------------------------------------------------- small graphs built by hand


def _w(name: str, *ne: int) -> Tensor:
    return ops.new_tensor(name, ne, F32, Flag.WEIGHT)


def _inp(name: str, *ne: int, type: GGMLType = F32) -> Tensor:
    return ops.new_tensor(name, ne, type, Flag.INPUT)


def moe_block(n_embd: int = 64, n_ff: int = 256, n_expert: int = 8, n_used: int = 4, T: int = 1) -> Graph:
    """llama.cpp's build_moe_ffn for one layer: router, top-k, expert up/gate/down, weighted sum of
    the n_used expert outputs as views + adds, residual."""
    x = _inp("inp_x", n_embd, T)
    p = "blk.0"
    cur = ops.mul(ops.rms_norm(x, 1e-5, name="norm-0"), _w(f"{p}.ffn_norm.weight", n_embd), name="ffn_norm-0")
    logits = ops.mul_mat(_w(f"{p}.ffn_gate_inp.weight", n_embd, n_expert), cur, name="ffn_moe_logits-0")
    probs = ops.soft_max(logits, name="ffn_moe_probs-0")
    selected = ops.top_k(probs, n_used, name="ffn_moe_topk-0")
    weights = ops.get_rows(ops.reshape(probs, 1, n_expert, T), selected, name="ffn_moe_weights-0")
    xr = ops.reshape(cur, n_embd, 1, T)
    up = ops.mul_mat_id(_w(f"{p}.ffn_up_exps.weight", n_embd, n_ff, n_expert), xr, selected, name="ffn_moe_up-0")
    gate = ops.mul_mat_id(_w(f"{p}.ffn_gate_exps.weight", n_embd, n_ff, n_expert), xr, selected,
                          name="ffn_moe_gate-0")
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name="ffn_moe_swiglu-0")
    experts = ops.mul_mat_id(_w(f"{p}.ffn_down_exps.weight", n_ff, n_embd, n_expert), act, selected,
                             name="ffn_moe_down-0")
    experts = ops.mul(experts, weights, name="ffn_moe_weighted-0")
    views = [ops.view(experts, (n_embd, T), (experts.nb[2],), k * experts.nb[1], name=f"ffn_moe_view{k}-0")
             for k in range(n_used)]
    out = views[0]
    for k in range(1, n_used):
        out = ops.add(out, views[k], name=f"ffn_moe_sum{k}-0")
    return Graph([ops.add(out, x, name="l_out-0")], name="moe-block")


def parallel_residual_block(n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, hd: int = 16,
                            n_ff: int = 256, T: int = 1, n_ctx: int = 256) -> Graph:
    """Command-R style: attention and FFN both read the same normed input; out = attn + ffn + x."""
    x = _inp("inp_x", n_embd, T)
    pos = _inp("inp_pos", T, type=GGMLType.I32)
    kv_idxs = _inp("inp_kv_idxs", T, type=GGMLType.I32)
    mask = _inp("kq_mask", n_ctx, T)
    ck = ops.new_tensor("cache_k_l0", (hd * n_head_kv, n_ctx), F32, Flag.KV_CACHE)
    cv = ops.new_tensor("cache_v_l0", (hd * n_head_kv, n_ctx), F32, Flag.KV_CACHE)
    p = "blk.0"
    h = ops.mul(ops.norm(x, 1e-5, name="norm-0"), _w(f"{p}.attn_norm.weight", n_embd), name="attn_norm-0")
    q = ops.reshape(ops.mul_mat(_w(f"{p}.attn_q.weight", n_embd, hd * n_head), h), hd, n_head, T, name="Qcur-0")
    k = ops.reshape(ops.mul_mat(_w(f"{p}.attn_k.weight", n_embd, hd * n_head_kv), h), hd, n_head_kv, T,
                    name="Kcur-0")
    v = ops.reshape(ops.mul_mat(_w(f"{p}.attn_v.weight", n_embd, hd * n_head_kv), h), hd, n_head_kv, T,
                    name="Vcur-0")
    q = ops.rope(q, pos, hd, RopeMode.NORMAL, 10000.0, name="Qrope-0")
    k = ops.rope(k, pos, hd, RopeMode.NORMAL, 10000.0, name="Krope-0")
    k_w = ops.set_rows(ck, ops.reshape(k, hd * n_head_kv, T), kv_idxs, name="k_store-0")
    v_w = ops.set_rows(cv, ops.reshape(v, hd * n_head_kv, T), kv_idxs, name="v_store-0")
    kview = ops.view(k_w, (hd, n_head_kv, n_ctx), (hd * 4, ck.nb[1]), 0, name="k_view-0")
    vview = ops.view(v_w, (hd, n_head_kv, n_ctx), (hd * 4, cv.nb[1]), 0, name="v_view-0")
    att = ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3, name="q_perm-0"),
                             ops.permute(kview, 0, 2, 1, 3, name="k_perm-0"),
                             ops.permute(vview, 0, 2, 1, 3, name="v_perm-0"), mask, 1 / math.sqrt(hd), name="fattn-0")
    att = ops.reshape(att, hd * n_head, T, name="attn_flat-0")
    attn_out = ops.mul_mat(_w(f"{p}.attn_output.weight", hd * n_head, n_embd), att, name="attn_out-0")
    gate = ops.mul_mat(_w(f"{p}.ffn_gate.weight", n_embd, n_ff), h, name="ffn_gate-0")
    up = ops.mul_mat(_w(f"{p}.ffn_up.weight", n_embd, n_ff), h, name="ffn_up-0")
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name="ffn_act-0")
    ffn_out = ops.mul_mat(_w(f"{p}.ffn_down.weight", n_ff, n_embd), act, name="ffn_out-0")
    both = ops.add(attn_out, ffn_out, name="attn_ffn-0")
    return Graph([ops.add(both, x, name="l_out-0")], name="parallel-residual-block")


def _markers(text: str) -> list[str]:
    return [line for line in text.splitlines() if "==== all-reduce" in line]


def _assert_summary_matches(summary: dict, plan: Plan) -> None:
    """The dump's numbers are the Plan's numbers, not recomputed guesses."""
    assert summary["reductions_per_step"] == plan.stats["reductions_per_step"] == len(plan.reductions)
    assert summary["reductions_before_coalescing"] == plan.stats["reductions_before_coalescing"]
    assert summary["bytes_reduced_per_step"] == plan.stats["bytes_reduced_per_step"] \
        == sum(r.nbytes for r in plan.reductions)
    assert summary["n_subgraphs"] == plan.stats["n_subgraphs"] == len(plan.subgraphs)
    assert summary["n_nodes"] == len(plan.graph.nodes)


# ---------------------------------------------------------------- golden: hand-built blocks


def test_moe_expert_reductions_coalesced_into_one():
    n_embd, n_used, T = 64, 4, 1
    g = moe_block(n_embd=n_embd, n_used=n_used, T=T)
    plan = compile_plan(g, TWO, None)
    eager = compile_plan(g, TWO, None, coalesce=False)
    text = dump(plan)
    markers = _markers(text)
    assert len(markers) == 1
    data = json.loads(dump(plan, "json"))
    _assert_summary_matches(data["summary"], plan)
    (red,) = data["reductions"]
    # the one all-reduce comes after the last expert add, on [n_embd, T] ...
    assert red["node_label"] == f"ffn_moe_sum{n_used - 1}-0"
    assert red["cover_labels"] == ["ffn_moe_down-0"]
    assert red["nbytes"] == n_embd * T * 4
    # ... where reducing eagerly moves every expert's partial sum, [n_embd, n_used, T]
    assert sum(r.nbytes for r in eager.reductions) == n_embd * n_used * T * 4
    by_label = {n["label"]: n for n in data["nodes"]}
    chain = ["ffn_moe_down-0", "ffn_moe_weighted-0"] + [f"ffn_moe_view{k}-0" for k in range(n_used)]
    assert all(by_label[name]["state"]["kind"] == "partial" for name in chain)
    assert by_label[red["node_label"]]["sync_state"]["kind"] == "mirrored"
    assert len({by_label[name]["subgraph"] for name in chain + [red["node_label"]]}) == 1


def test_parallel_residual_branches_merged_into_one_reduction():
    n_embd, T = 64, 1
    g = parallel_residual_block(n_embd=n_embd, T=T)
    plan = compile_plan(g, TWO, None)
    text = dump(plan)
    (marker,) = _markers(text)
    assert "attn_out-0" in marker and "ffn_out-0" in marker and f"{n_embd * T * 4} B" in marker
    data = json.loads(dump(plan, "json"))
    s = data["summary"]
    _assert_summary_matches(s, plan)
    assert (s["reductions_before_coalescing"], s["reductions_per_step"], s["reductions_saved"]) == (2, 1, 1)
    (red,) = data["reductions"]
    assert red["cover_labels"] == ["attn_out-0", "ffn_out-0"]
    assert red["node_label"] == "attn_ffn-0"
    assert "reductions per step: 2 before coalescing, 1 after (1 saved)" in text


def test_every_stage_dumps_in_every_text_format():
    g = parallel_residual_block()
    lowered = compile_plan(g, TWO, None)
    for stage in STAGES:
        plan = compile_plan(g, TWO, None, stop_after=stage)
        text = dump(plan, lowered=lowered)
        assert f"stage={stage}" in text
        data = json.loads(dump(plan, "json", lowered=lowered))
        assert data["stage"] == stage
        assert data["summary"]["memory"] is not None            # always from the lowered plan
        placed = stage in ("partitioned", "coalesced", "lowered")
        assert (data["summary"]["reductions_per_step"] is not None) == placed
        assert (data["nodes"][0]["state"] is None) == (stage == "built")
        assert bool(data["nodes"][0]["local"]) == (stage == "lowered")
        assert "digraph" in dump(plan, "dot")
    partitioned = compile_plan(g, TWO, None, stop_after="partitioned")
    assert len(_markers(dump(partitioned))) == 2


def test_memory_is_raw_gguf_bytes_of_each_slice():
    g = parallel_residual_block()
    plan = compile_plan(g, TWO, None)
    mem = json.loads(dump(plan, "json"))["summary"]["memory"]
    assert mem == plan_memory(plan, raw_weight_bytes, 256).as_dict()
    full = sum(raw_weight_bytes(t, t.ne) for t in g.leaves if t.flags & Flag.WEIGHT)
    mirrored = sum(raw_weight_bytes(t, t.ne) for t in g.leaves
                   if t.flags & Flag.WEIGHT and plan.of(t).state.is_mirrored)
    assert sum(mem["weights"]) == full + mirrored            # split weights once, mirrored ones twice
    assert mem["kv_per_token"] == [2 * 16 * 4] * 2           # per device: one KV head (16 floats) of K and of V


def test_raw_weight_bytes_counts_whole_quant_blocks():
    q = ops.new_tensor("blk.0.ffn_down.weight", (256, 8), GGMLType.Q4_1, Flag.WEIGHT)
    assert raw_weight_bytes(q, (256, 8, 1, 1)) == 8 * (256 // 32) * 20
    assert raw_weight_bytes(q, (128, 8, 1, 1)) == 8 * 4 * 20
    assert raw_weight_bytes(q, (0, 8, 1, 1)) == 0


# ---------------------------------------------------------------- the bill


def test_bill_reproduces_the_seed_example():
    """h=4096, b=2 (BF16), L=32, p=4: ~786 KB per rank per token, 2L=64 all-reduces, ratio ~21."""
    h_bytes, L, p = 4096 * 2, 32, 4
    subs = [Subgraph(i, i, Reduction(i, [i], h_bytes)) for i in range(2 * L)]
    plan = Plan(Graph([]), DeviceLayout(p, "tensor"), {}, subs, {})
    hp = SimpleNamespace(n_layer=L, n_embd=h_bytes // 4)     # the hidden state as F32 of the same bytes
    bill = communication_bill(plan, Link("test", 20.0, 100.0), n_tokens=1, hparams=hp, allreduce="ring")
    assert bill["reductions_per_step"] == 64
    assert bill["ring_bytes_per_rank_per_token"] == 4 * L * 4096 * 2 * (p - 1) // p == 786432
    assert bill["allreduce"] == "ring" and bill["bytes_per_rank_per_token"] == 786432   # the real ring schedule
    assert bill["bytes_moved_per_step"] == 786432 * p
    assert bill["tensor_vs_layer_ratio"] == pytest.approx(2 * L / (p - 1))
    assert bill["tensor_vs_layer_ratio_formula"] == pytest.approx(64 / 3)
    assert bill["latency_per_token_us"] == pytest.approx(64 * 20.0 + 786432 / 100e9 * 1e6)
    # the default bills the butterfly the numpy backend runs: p = 4 is two full-buffer exchanges
    fly = communication_bill(plan, Link("test", 20.0, 100.0), n_tokens=1, hparams=hp)
    assert fly["allreduce"] == "butterfly" and fly["wire"] == "f32"
    assert fly["bytes_per_rank_per_step"] == 64 * 2 * h_bytes
    assert fly["latency_per_token_us"] == pytest.approx(64 * 20.0 + 64 * 2 * h_bytes / 100e9 * 1e6)
    bf16 = communication_bill(plan, Link("test", 20.0, 100.0), hparams=hp, allreduce="nccl", wire="bf16")
    assert bf16["allreduce"] == "nccl" and bf16["bytes_per_rank_per_step"] == 786432 // 2   # a BF16 ring
    with pytest.raises(ConfigError, match="allreduce must be one of"):
        communication_bill(plan, allreduce="tree")


def test_bill_scales_with_devices_and_tokens():
    g = parallel_residual_block(T=8)
    for p in (2, 4):
        plan = compile_plan(g, DeviceLayout(p, "tensor"), None)
        bill = communication_bill(plan, "pcie4", n_tokens=8)
        reduced = sum(r.nbytes for r in plan.reductions)
        assert bill["ring_factor"] == pytest.approx(2 * (p - 1) / p)
        assert bill["ring_bytes_per_rank_per_step"] == round(2 * (p - 1) / p * reduced)
        assert bill["ring_bytes_per_rank_per_token"] == round(2 * (p - 1) / p * reduced / 8)
        link = dump_mod.LINKS["pcie4"]
        per_rank = sum(bytes_per_rank(butterfly_schedule(p, r.nbytes // 4)) for r in plan.reductions)
        assert bill["bytes_per_rank_per_step"] == per_rank and bill["bytes_per_rank_per_token"] == round(per_rank / 8)
        step_us = len(plan.reductions) * link.latency_us + per_rank / (link.bandwidth_gbs * 1e3)
        assert bill["latency_per_step_us"] == pytest.approx(step_us, rel=1e-6)
        assert bill["latency_per_token_us"] == pytest.approx(step_us / 8, rel=1e-6)
    one = compile_plan(g, DeviceLayout(1, "none"), None)
    assert communication_bill(one)["tensor_vs_layer_ratio"] is None


# ---------------------------------------------------------------- the JSON schema document


def _doc_tables() -> dict[str, set[str]]:
    """Section heading -> the keys its table documents (first column, in backticks)."""
    tables: dict[str, set[str]] = {}
    section = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
            tables[section] = set()
        elif section and line.startswith("| `"):
            tables[section].add(re.match(r"\| `([^`]+)`", line).group(1))
    return tables


def _check_schema(data: dict) -> None:
    docs = _doc_tables()

    def same(section: str, obj: dict) -> None:
        assert set(obj) == docs[section], f"{section}: documented {sorted(docs[section])}, got {sorted(obj)}"

    same("Top level", data)
    for key in ("model", "batch", "layout"):
        if data[key] is not None:
            same(f"`{key}`", data[key])
    for t in data["leaves"] + data["nodes"]:
        same("Tensor objects (`leaves`, `nodes`)", t)
        for st in (t["state"], t["sync_state"]):
            if st is not None:
                same("State objects", st)
    for sg in data["subgraphs"]:
        same("Subgraph objects", sg)
    for r in data["reductions"]:
        same("Reduction objects", r)
    s = data["summary"]
    same("`summary`", s)
    if s["memory"] is not None:
        same("`summary.memory`", s["memory"])
    if s["communication"] is not None:
        same("`summary.communication`", s["communication"])
    assert data["format"] == "metatp-dump" and data["version"] == 1


def test_schema_doc_covers_hand_built_plans():
    for g in (moe_block(), parallel_residual_block()):
        _check_schema(json.loads(dump(compile_plan(g, TWO, None), "json")))


# ---------------------------------------------------------------- synthetic GGUF models through the CLI


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from metatp.cli import main

    rc = main(["dump", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_model_without_tokenizer_matches_the_full_load(synth_factory):
    from metatp.ir.loader import load_model

    specs = [SynthSpec(types={"q": "Q4_0", "down": "Q8_0"}),
             SynthSpec(arch="qwen2moe", n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64),
             SynthSpec(arch="command-r", layer_norm=True, logit_scale=0.5),
             SynthSpec(arch="gemma3", post_norms=True, sliding_window=64, qk_norm=True)]
    for spec in specs:
        path, _ = synth_factory(spec)
        fast, full = load_model(path, with_tokenizer=False), load_model(path)
        assert fast.hparams == full.hparams
        assert {k: (w.type, w.ne, w.n_bytes) for k, w in fast.weights.items()} == \
               {k: (w.type, w.ne, w.n_bytes) for k, w in full.weights.items()}
        skipped = {k for k, v in full.metadata.items() if isinstance(v, list) and v and isinstance(v[0], str)}
        assert {k: v for k, v in full.metadata.items() if k not in skipped} == fast.metadata


def test_cli_synthetic_moe_text_and_layer(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(arch="qwen3moe", n_layer=2, n_expert=4, n_expert_used=2, n_ff=256, n_ff_exp=256))
    rc, out, err = _cli(capsys, "-m", str(path), "--devices", "2", "--layer", "1")
    assert rc == 0, err
    node_lines = [l for l in out.splitlines() if re.match(r"^\s*\d+\s+[A-Z_]+\s", l)]
    assert node_lines and all("-0 " not in l and "blk.0." not in l for l in node_lines)
    assert len(_markers(out)) == 2                     # attention output, then the experts' sum
    data = json.loads(dump_model(DumpRequest(model=str(path), n_devices=2, fmt="json", layer=1)))
    assert {n["layer"] for n in data["nodes"]} == {1}
    assert data["summary"]["n_nodes_shown"] == len(data["nodes"]) < data["summary"]["n_nodes"]
    assert all(l["layer"] in (1, None) for l in data["leaves"])
    _check_schema(data)


def test_cli_prefill_with_tensor_split(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(n_layer=2, n_ff=256))
    rc, out, err = _cli(capsys, "-m", str(path), "-ts", "3,1", "--phase", "prefill", "--n-tokens", "16",
                        "-c", "64", "--format", "json", "--link", "pcie4", "--latency-us", "5")
    assert rc == 0, err
    data = json.loads(out)
    assert data["batch"] == {"phase": "prefill", "n_tokens": 16, "n_kv": 64, "n_outputs": 1, "n_ctx": 64}
    assert data["layout"] == {"n_devices": 2, "split_mode": "tensor", "tensor_split": [3.0, 1.0]}
    c = data["summary"]["communication"]
    assert c["link"] == {"name": "pcie4", "latency_us": 5.0, "bandwidth_gbs": 24.0}
    assert c["n_tokens_per_step"] == 16 and c["layer_split_hop_bytes"] == 64 * 16 * 4
    w = data["summary"]["memory"]["weights"]
    assert w[0] > w[1]                                  # 3:1
    assert c["allreduce"] == "butterfly" and c["wire"] == "f32"


def test_cli_bills_the_chosen_allreduce(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(n_layer=2, n_ff=256))
    rc, out, err = _cli(capsys, "-m", str(path), "--devices", "3", "-c", "64", "--format", "json",
                        "--allreduce", "ring", "--wire", "bf16")
    assert rc == 0, err
    data = json.loads(out)
    c = data["summary"]["communication"]
    assert c["allreduce"] == "ring" and c["wire"] == "bf16"
    assert c["bytes_per_rank_per_step"] == sum(r["bytes_per_rank"] for r in data["reductions"])
    for r in data["reductions"]:        # 64 floats over 3 ranks: chunks of 22, 21, 21 at 2 bytes
        assert r["nbytes"] == 64 * 4 and r["bytes_per_rank"] == 2 * (22 + 22) * 2
    rc, out, err = _cli(capsys, "-m", str(path), "--devices", "3", "-c", "64", "--allreduce", "nccl")
    assert rc == 0 and "communication bill (nccl all-reduce, f32 on the wire)" in out
    rc, out, err = _cli(capsys, "-m", str(path), "--allreduce", "tree")
    assert rc == 1 and "allreduce must be one of auto, butterfly, ring" in err and "'tree'" in err


def test_layer_filter_keeps_unnamed_and_selection_nodes_in_their_layer(synth_factory):
    """In a prompt graph the last layer selects the output rows (`attn_out_sel`, `inp_sel`): they
    belong to that layer, while the final norm and the head stay global."""
    path, _ = synth_factory(SynthSpec(n_layer=2, n_ff=256))
    req = DumpRequest(model=str(path), n_devices=2, phase="prefill", n_tokens=4, fmt="json")
    whole = json.loads(dump_model(req))
    layer_of = {n["label"]: n["layer"] for n in whole["nodes"]}
    assert layer_of["attn_out_sel"] == layer_of["inp_sel"] == layer_of["ffn_inp-1"] == 1
    assert layer_of["result_norm"] is None and layer_of["result_output"] is None
    assert layer_of["mul_mat(blk.0.attn_q.weight, attn_norm-0)"] == 0
    req.layer = 1
    last = json.loads(dump_model(req))
    assert {"attn_out_sel", "inp_sel"} <= {n["label"] for n in last["nodes"]}
    reduced = {r["node"] for r in last["reductions"]}
    shown = {n["index"] for n in last["nodes"]}
    assert len(reduced & shown) == 2                   # both of the layer's all-reduces are in view


@pytest.mark.parametrize("argv, message", [
    (["--n-tokens", "8"], "--n-tokens"),
    (["--phase", "prefill", "--n-tokens", "0"], "--n-tokens must be >= 1"),
    (["--phase", "prefill", "--n-tokens", "100", "-c", "64"], "does not fit"),
    (["-c", "0"], "-c must be >= 1"),
    (["--bandwidth-gbs", "0"], "--bandwidth-gbs"),
    (["-ts", "3,1", "--devices", "3"], "tensor_split has 2 entries"),
    (["--devices", "2", "--layer", "7"], "--layer 7"),
])
def test_bad_flags_give_one_line_errors(synth_factory, capsys, argv, message):
    path, _ = synth_factory(SynthSpec(n_layer=2, n_ff=256))
    rc, out, err = _cli(capsys, "-m", str(path), *argv)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("metatp: error:") and message in err


def test_unknown_architecture_is_one_line(synth_factory, capsys):
    path, _ = synth_factory(SynthSpec(arch="gpt2"))
    rc, _, err = _cli(capsys, "-m", str(path))
    assert rc == 1 and err.count("\n") == 1 and "unsupported architecture 'gpt2'" in err


def test_unknown_tensor_is_one_line(capsys):
    """A split-table miss (SplitError from the passes) reaches the user as one line too."""
    x = _inp("inp_x", 64, 1)
    g = Graph([ops.mul_mat(_w("blk.0.mystery.weight", 64, 64), x, name="y-0")])
    with pytest.raises(MetatpError, match="mystery"):
        dump(compile_plan(g, TWO, None))


# ---------------------------------------------------------------- dot / svg


def test_dot_has_clusters_colours_reductions_and_legend():
    plan = compile_plan(parallel_residual_block(), TWO, None)
    dot = dump(plan, "dot")
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert "subgraph cluster_sg0" in dot and "subgraph cluster_legend" in dot
    assert dot.count("all-reduce #") == 1
    assert dump_dot.STATE_COLOURS["PARTIAL"] in dot and dump_dot.STATE_COLOURS["AXIS_1"] in dot
    assert 'shape="cylinder"' in dot and 'style="dashed,filled"' in dot


def test_svg_renders_where_graphviz_is_installed():
    require("graphviz")
    svg = dump(compile_plan(moe_block(), TWO, None), "svg")
    assert "<svg" in svg and "all-reduce #0" in html.unescape(svg)


def test_svg_without_graphviz_says_how_to_install(monkeypatch):
    monkeypatch.setattr(dump_dot.shutil, "which", lambda name: None)
    with pytest.raises(MetatpError, match="apt-get install graphviz.*brew install graphviz"):
        dump(compile_plan(moe_block(), TWO, None), "svg")


def test_bad_format_and_layer_from_python():
    plan = compile_plan(moe_block(), TWO, None)
    with pytest.raises(ConfigError, match="format"):
        dump(plan, "yaml")
    with pytest.raises(ConfigError, match="--layer 3"):
        dump(plan, layer=3)


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_json(default_model) -> dict:
    """`metatp dump --devices 2 -sm tensor --format json | python -m json.tool`, parsed."""
    path = default_model
    dump_cmd = [sys.executable, "-m", "metatp", "dump", "-m", str(path), "--devices", "2", "-sm", "tensor",
                "--format", "json"]
    produced = subprocess.run(dump_cmd, capture_output=True, check=True)
    tool = subprocess.run([sys.executable, "-m", "json.tool"], input=produced.stdout, capture_output=True)
    assert tool.returncode == 0, tool.stderr.decode()
    return json.loads(tool.stdout)


def test_default_model_decode_has_two_reductions_per_layer(default_json):
    d = default_json
    n_layer = d["model"]["n_layer"]
    s = d["summary"]
    assert n_layer == 30
    assert s["reductions_per_step"] == s["reductions_before_coalescing"] == 2 * n_layer == 60
    per_layer: dict[int, int] = {}
    nodes = {n["index"]: n for n in d["nodes"]}
    for r in d["reductions"]:
        il = nodes[r["node"]]["layer"]
        per_layer[il] = per_layer.get(il, 0) + 1
    assert per_layer == {il: 2 for il in range(n_layer)}
    assert s["bytes_reduced_per_step"] == 60 * d["model"]["n_embd"] * 4
    assert s["communication"]["reductions_per_step"] == 60
    assert s["communication"]["tensor_vs_layer_ratio"] == pytest.approx(60.0)
    _check_schema(d)


def test_default_model_summary_matches_the_plan(default_model, default_json):
    from metatp.ir.models import BatchSpec, ModelTensors, build_graph

    from metatp.ir.loader import load_model

    model = load_model(default_model, with_tokenizer=False)
    graph = build_graph(ModelTensors(model, 2048), BatchSpec(1, 2048, 1))
    plan = compile_plan(graph, TWO, model.hparams)
    _assert_summary_matches(default_json["summary"], plan)
    assert default_json["summary"]["memory"] == plan_memory(plan, raw_weight_bytes, 2048).as_dict()
    text = dump(plan, hparams=model.hparams)
    assert len(_markers(text)) == 60
    assert re.search(r"compute=11 sg=0$", text, re.M)
    assert "reductions per step: 60 before coalescing, 60 after (0 saved)" in text
