"""A synthetic GGUF written fast and tensor by tensor: random quant codes with sane per-block
scales laid down straight as bytes (no float weights, no quantisation), so a Llama-3-8B-shaped
file (~4.5 GB) is written on the GPU machine in seconds without ever being held in memory.

The speed section only needs weights of the right types and sizes with finite values; the
numbers are random. `tensor_plan` is also what the section counts the bytes read a token from.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from metatp.testing.synth import SynthSpec, _write_metadata

# GGML block layouts written here: type -> (values a block, bytes a block)
BLOCKS = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "F32": (1, 4)}
WEIGHT_STD = 0.02      # about the spread of a trained model's weights


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]     # ggml order: ne[0] is the row length
    type_name: str

    @property
    def nbytes(self) -> int:
        per, size = BLOCKS[self.type_name]
        if self.ne[0] % per:           # blocks run along a row
            raise ValueError(f"{self.name}: a row of {self.ne[0]} values is not a whole number of "
                             f"{self.type_name} blocks of {per}")
        return int(np.prod(self.ne)) // per * size


def tensor_plan(spec: SynthSpec) -> list[TensorSpec]:
    """Every tensor of a plain llama model of `spec`, in file order (F32 norms; the weights of the
    role's type in `spec.types`, else `spec.default_type`)."""
    E, hd = spec.n_embd, spec.hd
    n_q, n_kv = hd * spec.n_head, hd * spec.n_head_kv

    def typ(role: str) -> str:
        return spec.types.get(role, spec.default_type)

    out = [TensorSpec("token_embd.weight", (E, spec.n_vocab), typ("embd")),
           TensorSpec("output_norm.weight", (E,), "F32")]
    if not spec.tied:
        out.append(TensorSpec("output.weight", (E, spec.n_vocab), typ("output")))
    for il in range(spec.n_layer):
        p = f"blk.{il}"
        out += [TensorSpec(f"{p}.attn_norm.weight", (E,), "F32"),
                TensorSpec(f"{p}.attn_q.weight", (E, n_q), typ("q")),
                TensorSpec(f"{p}.attn_k.weight", (E, n_kv), typ("k")),
                TensorSpec(f"{p}.attn_v.weight", (E, n_kv), typ("v")),
                TensorSpec(f"{p}.attn_output.weight", (n_q, E), typ("o")),
                TensorSpec(f"{p}.ffn_norm.weight", (E,), "F32"),
                TensorSpec(f"{p}.ffn_gate.weight", (E, spec.n_ff), typ("gate")),
                TensorSpec(f"{p}.ffn_up.weight", (E, spec.n_ff), typ("up")),
                TensorSpec(f"{p}.ffn_down.weight", (spec.n_ff, E), typ("down"))]
    return out


def _f16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def random_blocks(rng: np.random.Generator, t: TensorSpec, chunk_blocks: int) -> Iterator[np.ndarray]:
    """The tensor's bytes in chunks of at most `chunk_blocks` blocks: random codes, then each
    block's scale fields overwritten so a weight's spread is about WEIGHT_STD, its mean about 0."""
    per, size = BLOCKS[t.type_name]
    n_blocks = t.nbytes // size
    for start in range(0, n_blocks, chunk_blocks):
        n = min(chunk_blocks, n_blocks - start)
        if t.type_name == "F32":                   # norms: about 1
            yield (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
            continue
        raw = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
        if t.type_name == "Q8_0":                  # d, then 32 int8 codes (std ~74)
            raw[:, 0:2] = _f16_bytes(WEIGHT_STD / 74)
        elif t.type_name == "Q4_1":                # d, m, then 32 nibbles (0..15: mean 7.5, std 4.6)
            d = WEIGHT_STD / 4.6
            raw[:, 0:2] = _f16_bytes(d)
            raw[:, 2:4] = _f16_bytes(-7.5 * d)
        else:                                      # Q4_K: d, dmin, 12 bytes of 6-bit scales/mins, nibbles
            raw[:, 4:16] = 0x21                    # 0x21 in every byte: sub-block scales and mins 1..33
            d = WEIGHT_STD / (33 * 4.6)
            raw[:, 0:2] = _f16_bytes(d)
            raw[:, 2:4] = _f16_bytes(7.5 * d)      # value = d*sc*q - dmin*m: small, finite
        yield raw.reshape(-1)


def write_fast_gguf(path: str | os.PathLike, spec: SynthSpec, chunk_bytes: int = 64 * 2**20) -> int:
    """Write the model of `spec` (a plain llama; the tokenizer of `metatp.testing.synth`) in
    chunks of about `chunk_bytes`; returns the file's size in bytes."""
    import gguf

    plan = tensor_plan(spec)
    w = gguf.GGUFWriter(os.fspath(path), spec.arch)
    _write_metadata(w, spec)
    for t in plan:
        dtype = np.float32 if t.type_name == "F32" else np.uint8
        raw = None if t.type_name == "F32" else gguf.GGMLQuantizationType[t.type_name]
        shape = tuple(reversed(t.ne))
        if raw is not None:                         # byte shape: the last dimension in bytes
            shape = shape[:-1] + (shape[-1] // BLOCKS[t.type_name][0] * BLOCKS[t.type_name][1],)
        w.add_tensor_info(t.name, shape, np.dtype(dtype), t.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    fout = w.fout[0]
    for t in plan:                                  # the writer's own padding rules, one chunk at a time
        w.write_padding(fout, fout.tell())
        w.tensors[0].pop(t.name)
        for part in random_blocks(rng, t, max(1, chunk_bytes // BLOCKS[t.type_name][1])):
            part.tofile(fout)
        w.write_padding(fout, t.nbytes)
    w.close()
    return os.path.getsize(path)
