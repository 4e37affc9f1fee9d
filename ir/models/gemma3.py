"""Gemma 3 graph: interleaved sliding-window / global attention, sandwich norms, GELU-tanh gated FFN.

Mirrors llama.cpp's `llm_build_gemma3<iswa=true>` node for node:
- the token embedding is scaled by sqrt(n_embd);
- RMS norms everywhere, weights used as stored (llama.cpp's converter already added Gemma's +1);
- per-head RMS q/k norms, NEOX rope with `{arch}.rope.freq_base` on global layers and 10000 on
  sliding-window layers (llama.cpp hard-codes rope_freq_base_train_swa = 10000 for gemma3);
- Q is multiplied by f_attention_scale = 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B,
  62-layer model) and attention runs with kq_scale 1.0;
- sliding-window layers attend through their own mask input `kq_mask_swa` (standard SWA: a token
  at position p sees cache row j iff j <= p and p - j < window);
- post_attention_norm / post_ffw_norm on the branch outputs before each residual add;
- no final logit soft-capping (llama.cpp applies it only to the non-iswa variant).

Layer il is a sliding-window layer unless (il + 1) % 6 == 0 (llama.cpp's set_swa_pattern(6)).
`hparams_fixup` (run once by the loader) writes that pattern into `HParams.swa_layers`, which the
split table reads to rotate the remainder device per layer class.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.blocks import embed, kv_store_and_attend, linear, lm_head, project_qkv, rms_norm_weighted, rope
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors, output_graph, select_outputs
from metatp.ir.models.inputs import StepInputs, declare_inputs
from metatp.ir.ops import GluOp, RopeMode
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.ir.loader import HParams

__all__ = ["build_gemma3", "hparams_fixup", "swa_pattern", "attention_scale", "SWA_PERIOD", "SWA_FREQ_BASE"]

SWA_PERIOD = 6              # every 6th layer is global
SWA_FREQ_BASE = 10000.0     # rope base of the sliding-window layers


def swa_pattern(n_layer: int, period: int = SWA_PERIOD) -> list[bool]:
    """Per layer: True for sliding-window attention (llama_hparams::set_swa_pattern)."""
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


def hparams_fixup(hp: HParams, metadata: dict[str, Any]) -> None:
    """Fill in what llama.cpp's gemma3 loader hard-codes: the SWA layer pattern and the SWA rope base."""
    if hp.sliding_window > 0:
        hp.swa_layers = swa_pattern(hp.n_layer)
    else:
        hp.swa_layers = [False] * hp.n_layer
    hp.rope_freq_base_swa = SWA_FREQ_BASE


def attention_scale(hp: HParams) -> float:
    """f_attention_scale: 1/sqrt(n_embd/n_head) for Gemma 3 27B (62 layers), else 1/sqrt(head_dim)."""
    if hp.n_layer == 62:
        return 1.0 / math.sqrt(hp.n_embd / hp.n_head)
    return 1.0 / math.sqrt(hp.head_dim_k)


def _rope_params(hp: HParams, il: int) -> tuple[float, float]:
    """(freq_base, freq_scale) of layer il: the SWA layers use base 10000 and no scaling."""
    if hp.is_swa(il):
        return hp.rope_freq_base_swa, 1.0
    return hp.rope_freq_base, hp.rope_freq_scale


def _attention(t: ModelTensors, il: int, cur: Tensor, inp: StepInputs[Tensor], spec: BatchSpec,
               rope_mode: RopeMode) -> Tensor:
    hp = t.hp
    p = f"blk.{il}"
    q, k, v = project_qkv(t, il, cur, spec.n_tokens)
    base, fscale = _rope_params(hp, il)
    q = rms_norm_weighted(t, q, f"{p}.attn_q_norm.weight", f"Qnorm-{il}")
    q = rope(t, q, inp, rope_mode, f"Qrope-{il}", base, fscale)
    k = rms_norm_weighted(t, k, f"{p}.attn_k_norm.weight", f"Knorm-{il}")
    k = rope(t, k, inp, rope_mode, f"Krope-{il}", base, fscale)
    q = ops.scale(q, attention_scale(hp), name=f"Qscaled-{il}")
    mask = inp.kq_mask_swa if hp.is_swa(il) else inp.kq_mask
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0, mask=mask)
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * hp.n_head, hp.n_embd), out_name=f"attn_out-{il}")


def _ffn_geglu(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    """LLM_FFN_GELU + LLM_FFN_PAR: gelu_tanh(gate x) * (up x), then down."""
    hp = t.hp
    p = f"blk.{il}"
    up = ops.mul_mat(t.w(f"{p}.ffn_up.weight", (hp.n_embd, hp.n_ff[il])), cur)
    gate = ops.mul_mat(t.w(f"{p}.ffn_gate.weight", (hp.n_embd, hp.n_ff[il])), cur)
    act = ops.glu_split(gate, up, GluOp.GEGLU_TANH, name=f"ffn_geglu-{il}")
    return ops.mul_mat(t.w(f"{p}.ffn_down.weight", (hp.n_ff[il], hp.n_embd)), act, name=f"ffn_out-{il}")


def build_gemma3(t: ModelTensors, spec: BatchSpec, arch: ArchSpec) -> Graph:
    hp = t.hp
    E = hp.n_embd
    inp = declare_inputs(spec, swa=any(hp.swa_layers))
    x = embed(t, inp)
    x = ops.scale(x, math.sqrt(E), name="inp_scaled")
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        cur = rms_norm_weighted(t, x, f"{p}.attn_norm.weight", f"attn_norm-{il}")
        cur = _attention(t, il, cur, inp, spec, arch.rope)
        cur, x = select_outputs(inp, il, hp.n_layer, cur, x)
        cur = rms_norm_weighted(t, cur, f"{p}.post_attention_norm.weight", f"attn_post_norm-{il}")
        sa_out = ops.add(cur, x, name=f"sa_out-{il}")
        cur = rms_norm_weighted(t, sa_out, f"{p}.ffn_norm.weight", f"ffn_norm-{il}")
        cur = _ffn_geglu(t, il, cur)
        cur = rms_norm_weighted(t, cur, f"{p}.post_ffw_norm.weight", f"ffn_post_norm-{il}")
        x = ops.add(cur, sa_out, name=f"l_out-{il}")
    x = rms_norm_weighted(t, x, "output_norm.weight", "result_norm")
    return output_graph(t, spec, inp, lm_head(t, x), hidden=x)
