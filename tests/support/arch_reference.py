"""Independent float64 forward passes for the architectures beyond llama, written plainly for tests.

Nothing here comes from metatp's graph or backends: weights come in as the float32 arrays the
synthetic writer returns (numpy shape = reversed ggml shape, so a linear layer is `h @ W.T`),
rope is a complex rotation, attention is a loop over heads, and everything is float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from support.llama_reference import _rmsnorm as rmsnorm, _rope as rope   # the same plain building blocks


@dataclass
class Config:
    """The hyper-parameters a forward pass needs."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float
    n_expert_used: int = 0
    normalise_expert_weights: bool = False
    expert_weights_scale: float = 0.0
    logit_scale: float = 0.0
    sliding_window: int = 0
    swa_period: int = 6
    swa_rope_base: float = 10000.0


# ---------------------------------------------------------------- building blocks


def layernorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm without bias."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_mask(T: int, window: int = 0) -> np.ndarray:
    """(T, T) additive mask: query i sees key j iff j <= i (and i - j < window when window > 0)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = j <= i
    if window > 0:
        visible &= (i - j) < window
    return np.where(visible, 0.0, -np.inf)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray) -> np.ndarray:
    """q (T, H, D), k/v (T, Hkv, D) -> (T, H*D); consecutive query heads share a kv head."""
    T, H, D = q.shape
    g = H // k.shape[1]
    out = np.zeros((T, H, v.shape[2]))
    for h in range(H):
        s = q[:, h] @ k[:, h // g].T * scale + mask
        out[:, h] = softmax(s) @ v[:, h // g]
    return out.reshape(T, -1)


def _f64(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in w.items()}


def _heads(x: np.ndarray, n: int, d: int) -> np.ndarray:
    return x.reshape(x.shape[0], n, d)


def _output(W: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return x @ W.get("output.weight", W["token_embd.weight"]).T


# ---------------------------------------------------------------- phi3


def phi3_forward(w: dict[str, np.ndarray], c: Config, ids: list[int]) -> np.ndarray:
    """Fused QKV rows [Q; K; V], NEOX rope, fused FFN rows [gate; up]."""
    W = _f64(w)
    T, hd = len(ids), c.head_dim
    pos = np.arange(T, dtype=np.float64)
    nq, nkv = c.n_head * hd, c.n_head_kv * hd
    x = W["token_embd.weight"][ids]
    for il in range(c.n_layer):
        p = f"blk.{il}."
        h = rmsnorm(x, W[p + "attn_norm.weight"], c.eps)
        qkv = h @ W[p + "attn_qkv.weight"].T
        q = _heads(qkv[:, :nq], c.n_head, hd)
        k = _heads(qkv[:, nq:nq + nkv], c.n_head_kv, hd)
        v = _heads(qkv[:, nq + nkv:], c.n_head_kv, hd)
        q, k = rope(q, pos, c.rope_base, True), rope(k, pos, c.rope_base, True)
        att = attention(q, k, v, 1.0 / np.sqrt(hd), causal_mask(T))
        x = x + att @ W[p + "attn_output.weight"].T
        h = rmsnorm(x, W[p + "ffn_norm.weight"], c.eps)
        gate_up = h @ W[p + "ffn_up.weight"].T
        n_ff = gate_up.shape[1] // 2
        x = x + (silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:]) @ W[p + "ffn_down.weight"].T
    return _output(W, rmsnorm(x, W["output_norm.weight"], c.eps))


# ---------------------------------------------------------------- command-r


def command_r_forward(w: dict[str, np.ndarray], c: Config, ids: list[int]) -> np.ndarray:
    """x + attn(LN(x)) + ffn(LN(x)); normal (adjacent-pair) rope; optional per-head LN q/k norms."""
    W = _f64(w)
    T, hd = len(ids), c.head_dim
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(c.n_layer):
        p = f"blk.{il}."
        h = layernorm(x, W[p + "attn_norm.weight"], c.eps)
        q = _heads(h @ W[p + "attn_q.weight"].T, c.n_head, hd)
        k = _heads(h @ W[p + "attn_k.weight"].T, c.n_head_kv, hd)
        v = _heads(h @ W[p + "attn_v.weight"].T, c.n_head_kv, hd)
        if p + "attn_q_norm.weight" in W:
            q = layernorm(q, W[p + "attn_q_norm.weight"], c.eps)
            k = layernorm(k, W[p + "attn_k_norm.weight"], c.eps)
        q, k = rope(q, pos, c.rope_base, False), rope(k, pos, c.rope_base, False)
        attn_out = attention(q, k, v, 1.0 / np.sqrt(hd), causal_mask(T)) @ W[p + "attn_output.weight"].T
        gate, up = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        ffn_out = (silu(gate) * up) @ W[p + "ffn_down.weight"].T
        x = x + attn_out + ffn_out
    logits = _output(W, layernorm(x, W["output_norm.weight"], c.eps))
    return logits * c.logit_scale if c.logit_scale else logits


# ---------------------------------------------------------------- mixture of experts


def moe_ffn(W: dict[str, np.ndarray], p: str, h: np.ndarray, c: Config) -> np.ndarray:
    """Per token: softmax router, top-k experts, (renormalised) weighted sum of SwiGLU experts,
    plus the sigmoid-gated shared expert when the model has one."""
    router = W[p + "ffn_gate_inp.weight"]                     # (E, n_embd)
    gate_e, up_e = W[p + "ffn_gate_exps.weight"], W[p + "ffn_up_exps.weight"]   # (E, n_ff, n_embd)
    down_e = W[p + "ffn_down_exps.weight"]                    # (E, n_embd, n_ff)
    bias_e = W.get(p + "ffn_down_exps.bias")                  # (E, n_embd)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        probs = softmax(router @ h[t])
        chosen = np.argsort(-probs, kind="stable")[: c.n_expert_used]
        weights = probs[chosen]
        if c.normalise_expert_weights:
            weights = weights / weights.sum()
        if c.expert_weights_scale:
            weights = weights * c.expert_weights_scale
        for e, wt in zip(chosen, weights):
            y = down_e[e] @ (silu(gate_e[e] @ h[t]) * (up_e[e] @ h[t]))
            if bias_e is not None:
                y = y + bias_e[e]
            out[t] += wt * y
    if p + "ffn_up_shexp.weight" in W:
        gate_logit = h @ W[p + "ffn_gate_inp_shexp.weight"]  # (T,)
        shared = (silu(h @ W[p + "ffn_gate_shexp.weight"].T) * (h @ W[p + "ffn_up_shexp.weight"].T)) \
            @ W[p + "ffn_down_shexp.weight"].T
        out = out + shared / (1.0 + np.exp(-gate_logit))[:, None]
    return out


def moe_forward(w: dict[str, np.ndarray], c: Config, ids: list[int], neox: bool) -> np.ndarray:
    """Pre-norm layers (q/k biases and q/k norms when present) with a routed-expert FFN."""
    W = _f64(w)
    T, hd = len(ids), c.head_dim
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(c.n_layer):
        p = f"blk.{il}."
        h = rmsnorm(x, W[p + "attn_norm.weight"], c.eps)
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0.0)
        k = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0.0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0.0)
        q, k, v = _heads(q, c.n_head, hd), _heads(k, c.n_head_kv, hd), _heads(v, c.n_head_kv, hd)
        if p + "attn_q_norm.weight" in W:
            q = rmsnorm(q, W[p + "attn_q_norm.weight"], c.eps)
            k = rmsnorm(k, W[p + "attn_k_norm.weight"], c.eps)
        q, k = rope(q, pos, c.rope_base, neox), rope(k, pos, c.rope_base, neox)
        x = x + attention(q, k, v, 1.0 / np.sqrt(hd), causal_mask(T)) @ W[p + "attn_output.weight"].T
        x = x + moe_ffn(W, p, rmsnorm(x, W[p + "ffn_norm.weight"], c.eps), c)
    return _output(W, rmsnorm(x, W["output_norm.weight"], c.eps))


# ---------------------------------------------------------------- gemma3


def gemma3_forward(w: dict[str, np.ndarray], c: Config, ids: list[int]) -> np.ndarray:
    """Scaled embedding, sandwich RMS norms, q/k norms, NEOX rope (10000 on sliding-window layers),
    sliding-window masks on all but every `swa_period`-th layer, GELU-tanh gated FFN."""
    W = _f64(w)
    T, hd = len(ids), c.head_dim
    pos = np.arange(T, dtype=np.float64)
    n_embd = W["token_embd.weight"].shape[1]
    x = W["token_embd.weight"][ids] * np.sqrt(n_embd)
    for il in range(c.n_layer):
        p = f"blk.{il}."
        sliding = c.sliding_window > 0 and (il + 1) % c.swa_period != 0
        base = c.swa_rope_base if sliding else c.rope_base
        mask = causal_mask(T, c.sliding_window if sliding else 0)
        h = rmsnorm(x, W[p + "attn_norm.weight"], c.eps)
        q = _heads(h @ W[p + "attn_q.weight"].T, c.n_head, hd)
        k = _heads(h @ W[p + "attn_k.weight"].T, c.n_head_kv, hd)
        v = _heads(h @ W[p + "attn_v.weight"].T, c.n_head_kv, hd)
        q = rope(rmsnorm(q, W[p + "attn_q_norm.weight"], c.eps), pos, base, True)
        k = rope(rmsnorm(k, W[p + "attn_k_norm.weight"], c.eps), pos, base, True)
        att = attention(q, k, v, 1.0 / np.sqrt(hd), mask) @ W[p + "attn_output.weight"].T
        x = x + rmsnorm(att, W[p + "post_attention_norm.weight"], c.eps)
        h = rmsnorm(x, W[p + "ffn_norm.weight"], c.eps)
        ffn = (gelu_tanh(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + rmsnorm(ffn, W[p + "post_ffw_norm.weight"], c.eps)
    return _output(W, rmsnorm(x, W["output_norm.weight"], c.eps))
