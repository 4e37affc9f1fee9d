"""GGUF loader: hyper-parameters, memory-mapped weights, tokenizer metadata.

The file is validated first (`gguf_validate`), so a hostile file fails with a
`ModelFormatError` naming the field, never with a numpy error from deep inside `gguf`.
Weights stay memory-mapped until a backend asks for them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from metatp.ir.dtypes import bf16_bits_to_f32
from metatp.ir.errors import ModelFormatError, ModelNotFoundError
from metatp.ir.gguf_reader import read_metadata
from metatp.ir.gguf_validate import validate_gguf
from metatp.ir.models import check_architecture, prepare_hparams
from metatp.ir.tensor import GGMLType
from metatp.ir.tokenizer import Tokenizer

__all__ = ["HParams", "WeightInfo", "Model", "load_model"]


@dataclass
class HParams:
    """Architecture hyper-parameters, with per-layer lists where models vary them by layer."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: list[int]
    n_ff: list[int]
    n_vocab: int
    n_ctx_train: int
    head_dim_k: int
    head_dim_v: int
    rope_dims: int
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    norm_eps: float
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_weights_norm: bool = False
    sliding_window: int = 0
    swa_layers: list[bool] = field(default_factory=list)
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    logit_scale: float = 0.0             # command-r: logits times this (0: none)
    expert_weights_scale: float = 0.0    # MoE: router weights times this (0 or 1: none)
    parallel_residual: bool = False

    def n_embd_k_gqa(self, il: int) -> int:
        return self.head_dim_k * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.head_dim_v * self.n_head_kv[il]

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]


@dataclass
class WeightInfo:
    name: str
    type: GGMLType
    ne: tuple[int, ...]
    raw: Any            # numpy memmap of the stored bytes / values, as gguf returns it

    @property
    def n_bytes(self) -> int:
        return int(self.raw.nbytes)


# Upper bounds far above any real model, low enough that nothing sized by them explodes.
MAX_LAYERS = 4096
MAX_EMBD = 1 << 17
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14
MAX_FF = 1 << 20
MAX_VOCAB = 1 << 24
MAX_CTX = 1 << 27
MAX_EXPERTS = 1 << 12

_BLOCK = re.compile(r"blk\.(\d+)\.")
# Weights that are matrices (2-D), or stacks of expert matrices (3-D), whatever their block.
_MATRIX_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_output.weight",
                    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp.weight",
                    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


class Model:
    """A loaded GGUF: metadata, hyper-parameters, weights (memory-mapped), tokenizer."""

    def __init__(self, path: Path, metadata: dict[str, Any], weights: dict[str, WeightInfo]) -> None:
        self.path = path
        self.metadata = metadata
        self.weights = weights
        arch = metadata.get("general.architecture", "")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{path.name}: metadata general.architecture = {arch!r} is not a string")
        self.arch = arch
        self.name = str(metadata.get("general.name", path.stem))
        check_architecture(self.arch)
        self.hparams = self._read_hparams()
        prepare_hparams(self.hparams, self.metadata)     # per-architecture fields (e.g. gemma3's SWA layers)

    # ---------------------------------------------------------------- metadata
    def _key(self, suffix: str, default: Any = None, required: bool = False) -> Any:
        k = f"{self.arch}.{suffix}"
        if k in self.metadata:
            return self.metadata[k]
        if required:
            raise ModelFormatError(f"{self.path.name}: missing metadata key {k!r}")
        return default

    def _bad(self, suffix: str, value: Any, want: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path.name}: metadata {self.arch}.{suffix} = {value!r} is invalid: "
                                f"expected {want}")

    def _int(self, suffix: str, default: Any, lo: int, hi: int, required: bool = False) -> int:
        """An integer hyper-parameter in [lo, hi]; a float, string, bool or NaN names the key."""
        v = self._key(suffix, default, required)
        if not _is_int(v) or not lo <= v <= hi:
            raise self._bad(suffix, v, f"an integer in [{lo}, {hi}]")
        return v

    def _float(self, suffix: str, default: float, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
        v = self._key(suffix, default)
        if not _is_real(v) or v < lo or (lo_open and v == lo) or v > hi:
            bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise self._bad(suffix, v, f"a finite number {bound}" + (f" and <= {hi:g}" if hi != math.inf else ""))
        return float(v)

    def _per_layer(self, suffix: str, default: Any, n_layer: int, lo: int, hi: int) -> list[int]:
        v = self._key(suffix, default)
        if isinstance(v, (list, tuple)):
            if len(v) != n_layer:
                raise ModelFormatError(f"{self.path.name}: metadata {self.arch}.{suffix} has {len(v)} entries "
                                       f"for {n_layer} layers (block_count)")
            for x in v:
                if not _is_int(x) or not lo <= x <= hi:
                    raise self._bad(suffix, x, f"integers in [{lo}, {hi}] (one per layer)")
            return list(v)
        if not _is_int(v) or not lo <= v <= hi:
            raise self._bad(suffix, v, f"an integer in [{lo}, {hi}] or one per layer")
        return [v] * n_layer

    def _bool(self, suffix: str, default: bool) -> bool:
        v = self._key(suffix, default)
        if not isinstance(v, bool):
            raise self._bad(suffix, v, "a boolean")
        return v

    def _read_hparams(self) -> HParams:
        """Hyper-parameters, each checked for type and range (naming the key), then against each
        other and against the tensors, so that a hostile file fails here and not mid-generation."""
        name = self.path.name
        n_layer = self._int("block_count", None, 1, MAX_LAYERS, required=True)
        self._check_blocks(n_layer)
        n_embd = self._int("embedding_length", None, 1, MAX_EMBD, required=True)
        n_head = self._int("attention.head_count", None, 1, MAX_HEADS, required=True)
        n_head_kv = self._per_layer("attention.head_count_kv", n_head, n_layer, 1, n_head)
        if any(n_head % h for h in n_head_kv):
            raise ModelFormatError(f"{name}: head_count {n_head} is not a multiple of head_count_kv "
                                   f"{next(h for h in n_head_kv if n_head % h)}")
        n_ff = self._per_layer("feed_forward_length", 0, n_layer, 0, MAX_FF)
        default_hd = n_embd // n_head
        head_dim_k = self._int("attention.key_length", default_hd if default_hd else None, 1, MAX_HEAD_DIM)
        head_dim_v = self._int("attention.value_length", default_hd if default_hd else None, 1, MAX_HEAD_DIM)
        emb = self.weights.get("token_embd.weight")
        if emb is None:
            raise ModelFormatError(f"{name}: no token_embd.weight tensor")
        if len(emb.ne) != 2 or emb.ne[0] != n_embd:
            raise ModelFormatError(f"{name}: tensor 'token_embd.weight' has shape {list(emb.ne)}, expected "
                                   f"[{n_embd}, n_vocab] (embedding_length = {n_embd})")
        n_vocab = self._int("vocab_size", emb.ne[1], 1, MAX_VOCAB)
        if n_vocab != emb.ne[1]:
            raise ModelFormatError(f"{name}: metadata {self.arch}.vocab_size = {n_vocab} but 'token_embd.weight' "
                                   f"has {emb.ne[1]} rows")
        out = self.weights.get("output.weight")
        if out is not None and (len(out.ne) != 2 or tuple(out.ne) != (n_embd, n_vocab)):
            raise ModelFormatError(f"{name}: tensor 'output.weight' has shape {list(out.ne)}, expected "
                                   f"[{n_embd}, {n_vocab}] (embedding_length, n_vocab)")
        self._check_ranks()
        eps_key = ("attention.layer_norm_rms_epsilon" if f"{self.arch}.attention.layer_norm_rms_epsilon" in self.metadata
                   else "attention.layer_norm_epsilon")
        eps = self._float(eps_key, 1e-5, 0.0, 1.0)
        rope_scale = 1.0
        scaling = self._key("rope.scaling.type", "none")
        if not isinstance(scaling, str):
            raise self._bad("rope.scaling.type", scaling, "a string such as 'none' or 'linear'")
        if scaling == "linear":
            rope_scale = 1.0 / self._float("rope.scaling.factor", 1.0, 0.0, 1e6, lo_open=True)
        rope_dims = self._int("rope.dimension_count", head_dim_k, 2, head_dim_k)
        if rope_dims % 2:
            raise self._bad("rope.dimension_count", rope_dims, f"an even number <= the head size {head_dim_k}")
        n_expert = self._int("expert_count", 0, 0, MAX_EXPERTS)
        n_expert_used = self._int("expert_used_count", 0, 1 if n_expert else 0, n_expert)
        logit_scale = self._float("logit_scale", 0.0, -1e6, 1e6)
        expert_weights_scale = self._float("expert_weights_scale", 0.0, -1e6, 1e6)
        hp = HParams(
            arch=self.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
            n_vocab=n_vocab, n_ctx_train=self._int("context_length", 2048, 1, MAX_CTX), head_dim_k=head_dim_k,
            head_dim_v=head_dim_v, rope_dims=rope_dims,
            rope_freq_base=self._float("rope.freq_base", 10000.0, 0.0, 1e12, lo_open=True), rope_freq_scale=rope_scale,
            rope_freq_base_swa=self._float("rope.freq_base_swa", 10000.0, 0.0, 1e12, lo_open=True), norm_eps=eps,
            n_expert=n_expert, n_expert_used=n_expert_used,
            n_ff_exp=self._int("expert_feed_forward_length", 0, 0, MAX_FF),
            n_ff_shexp=self._int("expert_shared_feed_forward_length", 0, 0, MAX_FF),
            expert_weights_norm=self._bool("expert_weights_norm", False),
            logit_scale=logit_scale, expert_weights_scale=expert_weights_scale,
            sliding_window=self._int("attention.sliding_window", 0, 0, MAX_CTX),
            attn_logit_softcap=self._float("attn_logit_softcapping", 0.0, 0.0, 1e6),
            final_logit_softcap=self._float("final_logit_softcapping", 0.0, 0.0, 1e6),
        )
        return hp

    def _check_blocks(self, n_layer: int) -> None:
        """block_count must match the blk.N tensors: a count far above them would size per-layer
        lists and KV caches by a number the file does not back."""
        present = {int(m.group(1)) for n in self.weights if (m := _BLOCK.match(n))}
        if not present:
            return          # tools build graphs from metadata-only files
        missing = [i for i in range(min(n_layer, max(present) + 2)) if i not in present]
        if n_layer > max(present) + 1 or missing:
            first = missing[0] if missing else max(present) + 1
            raise ModelFormatError(f"{self.path.name}: metadata {self.arch}.block_count = {n_layer} but the file "
                                   f"has no tensors for block {first} (blk.{first}.*)")
        if max(present) >= n_layer:
            raise ModelFormatError(f"{self.path.name}: metadata {self.arch}.block_count = {n_layer} but the file has "
                                   f"tensors for block {max(present)} (blk.{max(present)}.*)")

    def _check_ranks(self) -> None:
        """Matrices are 2-D and expert stacks 3-D (trailing 1s aside): a reshaped weight is refused by name."""
        for w in self.weights.values():
            want = 3 if w.name.endswith(_EXPERT_SUFFIXES) else 2 if w.name.endswith(_MATRIX_SUFFIXES) else None
            if want is None:
                continue
            rank = len(w.ne)
            while rank > want and w.ne[rank - 1] == 1:
                rank -= 1
            if rank != want:
                raise ModelFormatError(f"{self.path.name}: tensor {w.name!r} has shape {list(w.ne)}; "
                                       f"expected a {want}-D weight")

    def check_tokenizer(self) -> None:
        """The vocabulary must have one token per embedding row: more tokens could not be embedded,
        fewer would let the model emit ids that cannot be printed."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) != self.hparams.n_vocab:
            raise ModelFormatError(f"{self.path.name}: the vocabulary (tokenizer.ggml.tokens) has {len(tokens)} "
                                   f"tokens but 'token_embd.weight' has {self.hparams.n_vocab} rows")

    @cached_property
    def tokenizer(self):

        return Tokenizer.from_metadata(self.metadata)

    # ---------------------------------------------------------------- weights
    def has(self, name: str) -> bool:
        return name in self.weights

    def weight(self, name: str) -> WeightInfo:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: missing tensor {name!r}") from None

    def dequantize(self, name: str) -> np.ndarray:
        """The weight as float32, numpy shape reversed(ne)."""
        from gguf import quants

        w = self.weight(name)
        shape = tuple(reversed(w.ne))
        if w.type == GGMLType.F32:
            return np.asarray(w.raw, dtype=np.float32).reshape(shape)
        if w.type in (GGMLType.F16, GGMLType.BF16):     # exact, and whatever shape the reader gave the raw view
            h = np.ascontiguousarray(w.raw).view(np.uint16).reshape(shape)
            if w.type == GGMLType.F16:
                return h.view(np.float16).astype(np.float32)
            return bf16_bits_to_f32(h)
        try:
            out = quants.dequantize(np.asarray(w.raw), w.type)
        except NotImplementedError:
            raise ModelFormatError(f"{name}: tensor type {w.type.name} cannot be dequantized") from None
        return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)

    def raw_bytes(self, name: str) -> np.ndarray:
        """The stored bytes of a weight as uint8 rows (one row per ne[1..3] index)."""
        w = self.weight(name)
        a = np.asarray(w.raw)
        rows = int(np.prod(w.ne[1:])) if len(w.ne) > 1 else 1
        return a.view(np.uint8).reshape(rows, -1)

    def weight_bytes(self) -> int:
        return sum(w.n_bytes for w in self.weights.values())


def load_model(path: str | os.PathLike, with_tokenizer: bool = True) -> Model:
    """Open and validate a GGUF file; weights remain memory-mapped.

    with_tokenizer=False skips reading the vocabulary (tools that only build graphs)."""
    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelNotFoundError(f"model path is a directory, not a GGUF file: {p}")

    layout = validate_gguf(p)
    metadata = read_metadata(p, layout.n_kv, with_string_arrays=with_tokenizer)
    data = np.memmap(p, dtype=np.uint8, mode="r") if layout.tensors else None
    weights: dict[str, WeightInfo] = {}
    for t in layout.tensors:
        ggml_type = GGMLType(int(t.ggml_type))
        start = layout.data_offset + t.offset
        raw = data[start:start + t.n_bytes]
        weights[t.name] = WeightInfo(t.name, ggml_type, tuple(int(x) for x in t.ne), _typed_view(raw, ggml_type, t.ne))
    model = Model(p, metadata, weights)
    if with_tokenizer:
        model.check_tokenizer()
    return model


def _typed_view(raw: np.ndarray, ggml_type: GGMLType, ne: tuple[int, ...]) -> np.ndarray:
    """Stored data as gguf returns it: plain types as their dtype (numpy shape reversed ne),
    quantized types as uint8 rows."""
    shape = tuple(reversed([int(x) for x in ne]))
    plain = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.I32: np.int32,
             GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.F64: np.float64, GGMLType.I64: np.int64}
    if ggml_type in plain:
        return raw.view(plain[ggml_type]).reshape(shape)
    if ggml_type == GGMLType.BF16:
        return raw.view(np.uint16).reshape(shape)
    return raw.reshape(*shape[:-1], -1)
