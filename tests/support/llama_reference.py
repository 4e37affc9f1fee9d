"""An independent float64 forward pass of llama-family models, written plainly for tests.

It shares no code with metatp's graph or backends: rope uses complex rotation, attention is a
loop over heads, and everything is float64.
"""

from __future__ import annotations

import numpy as np


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """x: (T, H, D). Rotate pairs by pos * base^(-2i/D) using complex numbers."""
    T, H, D = x.shape
    freqs = base ** (-np.arange(0, D, 2) / D)
    rot = np.exp(1j * pos[:, None] * freqs[None, :])[:, None, :]          # (T, 1, D/2)
    if neox:
        z = (x[..., : D // 2] + 1j * x[..., D // 2:]) * rot
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def llama_forward(w: dict[str, np.ndarray], *, n_layer: int, n_head: int, n_head_kv: int, head_dim: int,
                  eps: float, rope_base: float, ids: list[int], neox: bool = False,
                  final_hidden: bool = False) -> np.ndarray:
    """Logits (T, n_vocab) in float64 for a fresh sequence of token ids; `final_hidden`: the
    final normed hidden states (T, n_embd) instead, the rows embeddings pool."""
    W = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    g = n_head // n_head_kv
    for il in range(n_layer):
        p = f"blk.{il}."
        h = _rmsnorm(x, W[p + "attn_norm.weight"], eps)
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0.0)
        k = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0.0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0.0)
        q, k, v = q.reshape(T, n_head, head_dim), k.reshape(T, n_head_kv, head_dim), v.reshape(T, n_head_kv, head_dim)
        if p + "attn_q_norm.weight" in W:
            q = _rmsnorm(q, W[p + "attn_q_norm.weight"], eps)
            k = _rmsnorm(k, W[p + "attn_k_norm.weight"], eps)
        q, k = _rope(q, pos, rope_base, neox), _rope(k, pos, rope_base, neox)
        att = np.zeros((T, n_head, head_dim))
        causal = np.triu(np.full((T, T), -np.inf), 1)
        for hh in range(n_head):
            kv = hh // g
            s = q[:, hh] @ k[:, kv].T / np.sqrt(head_dim) + causal
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, hh] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = _rmsnorm(x, W[p + "ffn_norm.weight"], eps)
        gate, up = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "ffn_down.weight"].T
    x = _rmsnorm(x, W["output_norm.weight"], eps)
    if final_hidden:
        return x
    out = W.get("output.weight", W["token_embd.weight"])
    return x @ out.T
