"""Write small synthetic GGUF models with random weights (tests, device checks, benchmarks).

(`metatp.testing.gguf_edit` beside it reads a GGUF into parts and writes it back, for tests
that change a file's keys or tensors.)

The weights are real GGUF tensors of the requested types (quantised with `gguf.quants`, or random
raw blocks for K-quants, which `gguf` cannot quantise), so the loader, the split table and every
backend see exactly what a downloaded model would give them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from metatp.testing.gguf_edit import finish_gguf

__all__ = ["SynthSpec", "write_synthetic_gguf", "random_weight_bytes", "byte_vocab"]


@dataclass
class SynthSpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None
    n_ff: int = 128
    n_vocab: int = 300
    n_ctx_train: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = True
    qkv_bias: bool = False           # qwen2
    qk_norm: bool = False            # qwen3
    types: dict[str, str] = field(default_factory=dict)   # role -> GGML type name (q, k, v, o, gate, up, down, embd, output)
    default_type: str = "F32"
    seed: int = 0
    # ---- other architectures (the defaults above write a plain llama model, as before)
    fused_qkv: bool = False          # phi3: one attn_qkv [n_embd, n_embd_q + 2*n_embd_kv] (role "qkv")
    fused_up_gate: bool = False      # phi3: ffn_up [n_embd, 2*n_ff] = [gate; up], no ffn_gate
    layer_norm: bool = False         # command-r: LayerNorm eps key, no ffn_norm (attention and FFN share one norm)
    qk_norm_per_head: bool = False   # command-r(+): q/k norms [head_dim, n_head(_kv)] instead of [head_dim]
    logit_scale: float = 0.0         # command-r: `{arch}.logit_scale`
    post_norms: bool = False         # gemma3: post_attention_norm and post_ffw_norm
    sliding_window: int = 0          # gemma3: `{arch}.attention.sliding_window`
    n_expert: int = 0                # MoE: experts per layer (roles gate_exps, up_exps, down_exps, router)
    n_expert_used: int = 0
    n_ff_exp: int = 0                # expert FFN width (0: n_ff, as mixtral stores it)
    n_ff_shexp: int = 0              # qwen2moe shared expert width (0: none; role "shexp")
    expert_down_bias: bool = False   # ffn_down_exps.bias [n_embd, n_expert] (the PARTIAL expert bias)
    expert_weights_scale: float = 0.0  # `{arch}.expert_weights_scale` (0: not written)
    write_expert_ff_len: bool = True  # write `{arch}.expert_feed_forward_length` (mixtral files do not)
    chat_template: str | None = None  # `tokenizer.chat_template` (None: not written)

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def byte_vocab(n_vocab: int) -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 byte-level vocabulary: 256 byte tokens, merges of common pairs, two control tokens."""
    from metatp.ir.tokenizer_tables import gpt2_byte_table

    table = gpt2_byte_table()
    tokens = ["<|bos|>", "<|eos|>"] + [table[b] for b in range(256)]
    types = [3, 3] + [1] * 256
    merges: list[str] = []
    letters = [table[b] for b in b"etaoinshr "]
    for a in letters:
        for b in letters:
            if len(tokens) >= n_vocab:
                break
            tokens.append(a + b)
            types.append(1)
            merges.append(f"{a} {b}")
    while len(tokens) < n_vocab:
        tokens.append(f"<|unused{len(tokens)}|>")
        types.append(5)
    return tokens[:n_vocab], merges, types[:n_vocab]


def random_weight_bytes(rng: np.random.Generator, ne: tuple[int, ...], type_name: str,
                        scale: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(data to store, its float32 dequantised value) for a weight of shape `ne` (ggml order)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    t = GGMLQuantizationType[type_name]
    shape = tuple(reversed(ne))
    if t == GGMLQuantizationType.F32:
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        return x, x
    if t == GGMLQuantizationType.F16:
        x = (rng.standard_normal(shape) * scale).astype(np.float16)
        return x, x.astype(np.float32)
    bs, tsz = GGML_QUANT_SIZES[t]
    if type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        n_blocks = int(np.prod(ne)) // bs
        raw = rng.integers(0, 256, size=(n_blocks, tsz), dtype=np.uint8)
        d = np.float16(scale / 8).view(np.uint16)
        dmin = np.float16(scale / 16).view(np.uint16)
        if type_name in ("Q4_K", "Q5_K", "Q2_K"):
            off = 0 if type_name != "Q2_K" else tsz - 4
            raw[:, off:off + 2] = np.frombuffer(np.uint16(d).tobytes(), np.uint8)
            raw[:, off + 2:off + 4] = np.frombuffer(np.uint16(dmin).tobytes(), np.uint8)
        else:   # Q6_K / Q3_K keep d in the last two bytes; Q6_K has int8 scales before it
            raw[:, tsz - 2:tsz] = np.frombuffer(np.uint16(d).tobytes(), np.uint8)
            if type_name == "Q6_K":
                raw[:, tsz - 18:tsz - 2] = rng.integers(-8, 8, size=(n_blocks, 16)).astype(np.int8).view(np.uint8)
        raw = raw.reshape(*shape[:-1], shape[-1] // bs * tsz)
        return raw, quants.dequantize(raw, t).reshape(shape).astype(np.float32)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    raw = quants.quantize(x, t)
    return raw, quants.dequantize(raw, t).reshape(shape).astype(np.float32)


def _write_metadata(w, spec: SynthSpec) -> None:
    """Hyper-parameters and a small byte-level BPE tokenizer."""
    w.add_name(f"synthetic-{spec.arch}")
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    if spec.head_dim:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_base)
    w.add_rope_dimension_count(spec.hd)
    if spec.layer_norm:
        w.add_layer_norm_eps(spec.norm_eps)
    else:
        w.add_layer_norm_rms_eps(spec.norm_eps)
    if spec.logit_scale:
        w.add_logit_scale(spec.logit_scale)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        if spec.n_ff_exp and spec.write_expert_ff_len:
            w.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
        if spec.expert_weights_scale:
            w.add_expert_weights_scale(spec.expert_weights_scale)
    w.add_vocab_size(spec.n_vocab)
    tokens, merges, ttypes = byte_vocab(spec.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    if spec.chat_template is not None:
        w.add_chat_template(spec.chat_template)


def write_synthetic_gguf(path: str | os.PathLike, spec: SynthSpec) -> dict[str, np.ndarray]:
    """Write the model; return every weight's float32 value (numpy shape = reversed ne)."""
    import gguf

    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    _write_metadata(w, spec)

    values: dict[str, np.ndarray] = {}

    def put(name: str, ne: tuple[int, ...], role: str | None, scale: float = 0.05, norm: bool = False) -> None:
        if norm:
            x = (1.0 + 0.1 * rng.standard_normal(tuple(reversed(ne)))).astype(np.float32)
            data, val = x, x
        else:
            tname = spec.types.get(role, spec.default_type) if role else "F32"
            data, val = random_weight_bytes(rng, ne, tname, scale)
            if tname not in ("F32", "F16"):
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[tname])
                values[name] = val
                return
        w.add_tensor(name, data)
        values[name] = val

    E = spec.n_embd
    put("token_embd.weight", (E, spec.n_vocab), "embd", scale=0.5)
    put("output_norm.weight", (E,), None, norm=True)
    if not spec.tied:
        put("output.weight", (E, spec.n_vocab), "output")
    for il in range(spec.n_layer):
        _put_attention(put, spec, f"blk.{il}")
        _put_ffn(put, spec, f"blk.{il}")
    finish_gguf(w)
    return values


def _put_attention(put, spec: SynthSpec, p: str) -> None:
    """attn_norm, q/k/v (separate or fused), biases, q/k norms, attn_output, post-attention norm."""
    E, hd = spec.n_embd, spec.hd
    n_q, n_kv = hd * spec.n_head, hd * spec.n_head_kv
    put(f"{p}.attn_norm.weight", (E,), None, norm=True)
    if spec.fused_qkv:
        put(f"{p}.attn_qkv.weight", (E, n_q + 2 * n_kv), "qkv")
        if spec.qkv_bias:
            put(f"{p}.attn_qkv.bias", (n_q + 2 * n_kv,), None, scale=0.1)
    else:
        put(f"{p}.attn_q.weight", (E, n_q), "q")
        put(f"{p}.attn_k.weight", (E, n_kv), "k")
        put(f"{p}.attn_v.weight", (E, n_kv), "v")
        if spec.qkv_bias:
            put(f"{p}.attn_q.bias", (n_q,), None, scale=0.1)
            put(f"{p}.attn_k.bias", (n_kv,), None, scale=0.1)
            put(f"{p}.attn_v.bias", (n_kv,), None, scale=0.1)
    if spec.qk_norm:
        q_ne = (hd, spec.n_head) if spec.qk_norm_per_head else (hd,)
        k_ne = (hd, spec.n_head_kv) if spec.qk_norm_per_head else (hd,)
        put(f"{p}.attn_q_norm.weight", q_ne, None, norm=True)
        put(f"{p}.attn_k_norm.weight", k_ne, None, norm=True)
    put(f"{p}.attn_output.weight", (n_q, E), "o")
    if spec.post_norms:
        put(f"{p}.post_attention_norm.weight", (E,), None, norm=True)


def _put_ffn(put, spec: SynthSpec, p: str) -> None:
    """ffn_norm (unless the layer shares one norm), then a dense, fused or mixture-of-experts FFN."""
    E = spec.n_embd
    if not spec.layer_norm:
        put(f"{p}.ffn_norm.weight", (E,), None, norm=True)
    if spec.n_expert:
        n_ff, n_x = spec.n_ff_exp or spec.n_ff, spec.n_expert
        put(f"{p}.ffn_gate_inp.weight", (E, n_x), "router", scale=0.3)
        put(f"{p}.ffn_gate_exps.weight", (E, n_ff, n_x), "gate_exps")
        put(f"{p}.ffn_up_exps.weight", (E, n_ff, n_x), "up_exps")
        put(f"{p}.ffn_down_exps.weight", (n_ff, E, n_x), "down_exps")
        if spec.expert_down_bias:
            put(f"{p}.ffn_down_exps.bias", (E, n_x), None, scale=0.1)
        if spec.n_ff_shexp:
            put(f"{p}.ffn_gate_inp_shexp.weight", (E,), "router", scale=0.3)
            put(f"{p}.ffn_gate_shexp.weight", (E, spec.n_ff_shexp), "shexp")
            put(f"{p}.ffn_up_shexp.weight", (E, spec.n_ff_shexp), "shexp")
            put(f"{p}.ffn_down_shexp.weight", (spec.n_ff_shexp, E), "shexp")
    elif spec.fused_up_gate:
        put(f"{p}.ffn_up.weight", (E, 2 * spec.n_ff), "up")
        put(f"{p}.ffn_down.weight", (spec.n_ff, E), "down")
    else:
        put(f"{p}.ffn_gate.weight", (E, spec.n_ff), "gate")
        put(f"{p}.ffn_up.weight", (E, spec.n_ff), "up")
        put(f"{p}.ffn_down.weight", (spec.n_ff, E), "down")
    if spec.post_norms:
        put(f"{p}.post_ffw_norm.weight", (E,), None, norm=True)
