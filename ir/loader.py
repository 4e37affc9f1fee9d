"""GGUF loader: hyper-parameters, memory-mapped weights, tokenizer metadata.

The file is validated first (`gguf_validate`), so a hostile file fails with a
`ModelFormatError` naming the field, never with a numpy error from deep inside `gguf`.
Weights stay memory-mapped until a backend asks for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from metatp.ir.errors import ModelFormatError, ModelNotFoundError
from metatp.ir.tensor import GGMLType

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


def _as_per_layer(v: Any, n_layer: int, what: str) -> list[int]:
    if isinstance(v, (list, tuple)):
        if len(v) != n_layer:
            raise ModelFormatError(f"{what} has {len(v)} entries for {n_layer} layers")
        return [int(x) for x in v]
    return [int(v)] * n_layer


class Model:
    """A loaded GGUF: metadata, hyper-parameters, weights (memory-mapped), tokenizer."""

    def __init__(self, path: Path, metadata: dict[str, Any], weights: dict[str, WeightInfo]) -> None:
        self.path = path
        self.metadata = metadata
        self.weights = weights
        self.arch = str(metadata.get("general.architecture", ""))
        self.name = str(metadata.get("general.name", path.stem))
        from metatp.ir.models import check_architecture, prepare_hparams

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

    def _read_hparams(self) -> HParams:
        k = self._key
        n_layer = int(k("block_count", required=True))
        n_embd = int(k("embedding_length", required=True))
        n_head = int(k("attention.head_count", required=True))
        if n_layer <= 0 or n_embd <= 0 or n_head <= 0:
            raise ModelFormatError(f"{self.path.name}: block_count, embedding_length and head_count must be positive")
        n_head_kv = _as_per_layer(k("attention.head_count_kv", n_head), n_layer, "head_count_kv")
        n_ff = _as_per_layer(k("feed_forward_length", 0), n_layer, "feed_forward_length")
        head_dim_k = int(k("attention.key_length", n_embd // n_head))
        head_dim_v = int(k("attention.value_length", n_embd // n_head))
        if any(h <= 0 or n_head % h for h in n_head_kv):
            raise ModelFormatError(f"{self.path.name}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv[0]}")
        emb = self.weights.get("token_embd.weight")
        if emb is None:
            raise ModelFormatError(f"{self.path.name}: no token_embd.weight tensor")
        n_vocab = int(k("vocab_size", emb.ne[1]))
        eps = k("attention.layer_norm_rms_epsilon", None)
        if eps is None:
            eps = k("attention.layer_norm_epsilon", 1e-5)
        rope_scale = 1.0
        if k("rope.scaling.type", "none") == "linear":
            rope_scale = 1.0 / float(k("rope.scaling.factor", 1.0))
        hp = HParams(
            arch=self.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
            n_vocab=n_vocab, n_ctx_train=int(k("context_length", 2048)), head_dim_k=head_dim_k,
            head_dim_v=head_dim_v, rope_dims=int(k("rope.dimension_count", head_dim_k)),
            rope_freq_base=float(k("rope.freq_base", 10000.0)), rope_freq_scale=rope_scale,
            rope_freq_base_swa=float(k("rope.freq_base_swa", 10000.0)), norm_eps=float(eps),
            n_expert=int(k("expert_count", 0)), n_expert_used=int(k("expert_used_count", 0)),
            n_ff_exp=int(k("expert_feed_forward_length", 0)),
            n_ff_shexp=int(k("expert_shared_feed_forward_length", 0)),
            expert_weights_norm=bool(k("expert_weights_norm", False)),
            sliding_window=int(k("attention.sliding_window", 0)),
            attn_logit_softcap=float(k("attn_logit_softcapping", 0.0)),
            final_logit_softcap=float(k("final_logit_softcapping", 0.0)),
        )
        return hp

    @cached_property
    def tokenizer(self):
        from metatp.ir.tokenizer import Tokenizer

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
            return (h.astype(np.uint32) << 16).view(np.float32)
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
    from metatp.ir.gguf_reader import read_metadata
    from metatp.ir.gguf_validate import validate_gguf

    layout = validate_gguf(p)
    metadata = read_metadata(p, layout.n_kv, with_string_arrays=with_tokenizer)
    data = np.memmap(p, dtype=np.uint8, mode="r") if layout.tensors else None
    weights: dict[str, WeightInfo] = {}
    for t in layout.tensors:
        ggml_type = GGMLType(int(t.ggml_type))
        start = layout.data_offset + t.offset
        raw = data[start:start + t.n_bytes]
        weights[t.name] = WeightInfo(t.name, ggml_type, tuple(int(x) for x in t.ne), _typed_view(raw, ggml_type, t.ne))
    return Model(p, metadata, weights)


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
