"""Write small synthetic GGUF models with random weights (tests, device checks, benchmarks).

The weights are real GGUF tensors of the requested types (quantised with `gguf.quants`, or random
raw blocks for K-quants, which `gguf` cannot quantise), so the loader, the split table and every
backend see exactly what a downloaded model would give them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def byte_vocab(n_vocab: int) -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 byte-level vocabulary: 256 byte tokens, merges of common pairs, two control tokens."""
    from metatp.ir.tokenizer import _gpt2_byte_table

    table = _gpt2_byte_table()
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


def write_synthetic_gguf(path: str | os.PathLike, spec: SynthSpec) -> dict[str, np.ndarray]:
    """Write the model; return every weight's float32 value (numpy shape = reversed ne)."""
    import gguf

    rng = np.random.default_rng(spec.seed)
    arch = spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
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
    w.add_layer_norm_rms_eps(spec.norm_eps)
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

    E, hd = spec.n_embd, spec.hd
    put("token_embd.weight", (E, spec.n_vocab), "embd", scale=0.5)
    put("output_norm.weight", (E,), None, norm=True)
    if not spec.tied:
        put("output.weight", (E, spec.n_vocab), "output")
    for il in range(spec.n_layer):
        p = f"blk.{il}"
        put(f"{p}.attn_norm.weight", (E,), None, norm=True)
        put(f"{p}.attn_q.weight", (E, hd * spec.n_head), "q")
        put(f"{p}.attn_k.weight", (E, hd * spec.n_head_kv), "k")
        put(f"{p}.attn_v.weight", (E, hd * spec.n_head_kv), "v")
        if spec.qkv_bias:
            put(f"{p}.attn_q.bias", (hd * spec.n_head,), None, scale=0.1)
            put(f"{p}.attn_k.bias", (hd * spec.n_head_kv,), None, scale=0.1)
            put(f"{p}.attn_v.bias", (hd * spec.n_head_kv,), None, scale=0.1)
        if spec.qk_norm:
            put(f"{p}.attn_q_norm.weight", (hd,), None, norm=True)
            put(f"{p}.attn_k_norm.weight", (hd,), None, norm=True)
        put(f"{p}.attn_output.weight", (hd * spec.n_head, E), "o")
        put(f"{p}.ffn_norm.weight", (E,), None, norm=True)
        put(f"{p}.ffn_gate.weight", (E, spec.n_ff), "gate")
        put(f"{p}.ffn_up.weight", (E, spec.n_ff), "up")
        put(f"{p}.ffn_down.weight", (spec.n_ff, E), "down")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
