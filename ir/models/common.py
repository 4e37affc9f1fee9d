"""Pieces shared by the model builders: the weight/KV leaf tensors and the batch description."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from metatp.ir import ops
from metatp.ir.errors import ConfigError, ModelFormatError
from metatp.ir.ops import RopeMode
from metatp.ir.tensor import Flag, GGMLType, Tensor, block_size

if TYPE_CHECKING:
    from metatp.ir.loader import HParams, Model
    from metatp.ir.models.inputs import StepInputs
    from metatp.ir.graph import Graph

__all__ = ["ArchSpec", "BatchSpec", "ModelTensors", "KV_PAD", "KV_CACHE_TYPES", "cache_type", "check_cache_type", "output_graph", "select_outputs"]

KV_PAD = 256   # attended KV length is padded to a multiple of this, so decode graphs are reused


@dataclass(frozen=True)
class BatchSpec:
    """What one forward pass computes: `n_tokens` new tokens attending over `n_kv` cache rows
    (a multiple of KV_PAD, masked beyond the filled part), logits for `n_outputs` of them; with
    `hidden`, their final hidden states (after the output norm, before the lm head: embeddings)
    instead of logits."""

    n_tokens: int
    n_kv: int
    n_outputs: int
    hidden: bool = False

    def key(self) -> tuple:
        base = (self.n_tokens, self.n_kv, self.n_outputs)
        return (*base, "hidden") if self.hidden else base


@dataclass(frozen=True)
class ArchSpec:
    """What one architecture is, beyond the code its builder shares with others: the builder,
    the rope mode (llama.cpp's llama_model_rope_type), what its loader hard-codes instead of
    reading (`hparams_fixup`), and MoE routing details (llama.cpp's build_moe_ffn norm_w).
    The table of these is `ir.models.registry.ARCHS`."""

    name: str
    build: Callable[["ModelTensors", BatchSpec, "ArchSpec"], "Graph"]
    rope: RopeMode
    hparams_fixup: Callable[[HParams, dict[str, Any]], None] | None = None
    normalise_expert_weights: bool = False


# KV-cache types by llama.cpp's -ctk / -ctv spelling. Quantized caches are cut per head (the split
# table keeps whole heads per device), so a head's row must be whole quant blocks.
KV_CACHE_TYPES: dict[str, GGMLType] = {
    "f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "q5_0": GGMLType.Q5_0, "q5_1": GGMLType.Q5_1,
}


def cache_type(name: str, which: str = "k") -> GGMLType:
    """The GGML type of a `-ct{which}` spelling (ConfigError naming the allowed ones)."""
    t = KV_CACHE_TYPES.get(name) if isinstance(name, str) else None
    if t is None:
        raise ConfigError(f"cache_type_{which}={name!r} is not a KV cache type; choose one of "
                          f"{', '.join(KV_CACHE_TYPES)}")
    return t


def check_cache_type(hp: HParams, t: GGMLType, which: str) -> None:
    """A quantized cache needs every layer's head size to be whole blocks of its type: attention
    reads one head's row at a time, and devices hold whole heads."""
    if t not in KV_CACHE_TYPES.values():
        raise ConfigError(f"{GGMLType(t).name} is not a KV cache type; choose one of {', '.join(KV_CACHE_TYPES)}")
    bs = block_size(t)
    head = hp.head_dim_k if which == "k" else hp.head_dim_v
    if head % bs:
        raise ConfigError(f"cache_type_{which}={GGMLType(t).name.lower()}: tensor cache_{which}_l0 has head size "
                          f"{head}, not a multiple of the {GGMLType(t).name} block size {bs}; use f16, bf16 or f32 "
                          f"for this model")


class ModelTensors:
    """Leaf tensors for every weight and KV-cache row block of one model context.

    Made once per context and shared by every graph built for it, so a backend can map a
    leaf to its buffer by identity.
    """

    def __init__(self, model: Model, n_ctx: int, kv_type: GGMLType = GGMLType.F32,
                 kv_type_v: GGMLType | None = None) -> None:
        self.model = model
        self.hp: HParams = model.hparams
        self.n_ctx = n_ctx
        self.kv_type = GGMLType(kv_type)
        self.kv_type_v = self.kv_type if kv_type_v is None else GGMLType(kv_type_v)
        check_cache_type(self.hp, self.kv_type, "k")
        check_cache_type(self.hp, self.kv_type_v, "v")
        self.weights: dict[str, Tensor] = {
            name: ops.new_tensor(name, info.ne, info.type, Flag.WEIGHT) for name, info in model.weights.items()
        }
        self.aliases: dict[str, str] = {}
        hp = self.hp
        self.cache_k = [ops.new_tensor(f"cache_k_l{i}", (hp.n_embd_k_gqa(i), n_ctx), self.kv_type, Flag.KV_CACHE)
                        for i in range(hp.n_layer)]
        self.cache_v = [ops.new_tensor(f"cache_v_l{i}", (hp.n_embd_v_gqa(i), n_ctx), self.kv_type_v, Flag.KV_CACHE)
                        for i in range(hp.n_layer)]

    def w(self, name: str, ne: tuple[int, ...] | None = None) -> Tensor:
        """A required weight, optionally checked against the shape the architecture expects."""
        t = self.weights.get(name)
        if t is None:
            raise ModelFormatError(f"{self.model.path.name}: missing tensor {name!r} required by {self.hp.arch}")
        if ne is not None:
            want = tuple(ne) + (1,) * (4 - len(ne))
            if t.ne != want:
                raise ModelFormatError(
                    f"{self.model.path.name}: tensor {name!r} has shape {list(t.ne[:len(ne)])}, "
                    f"expected {list(ne)} for {self.hp.arch}")
        return t

    def opt(self, name: str) -> Tensor | None:
        return self.weights.get(name)

    def output_weight(self) -> Tensor:
        """The lm head. A tied model stores none: it reads the token embedding's data, but as a leaf
        of its own named `output.weight`, so the split table can split it along the vocabulary
        while the embedding lookup stays mirrored (llama.cpp mirrors both, so every device
        computes the whole lm head)."""
        out = self.weights.get("output.weight")
        if out is None:
            emb = self.w("token_embd.weight")
            out = ops.new_tensor("output.weight", emb.ne, emb.type, Flag.WEIGHT)
            self.weights["output.weight"] = out
            self.aliases["output.weight"] = "token_embd.weight"
        return out

    def source_name(self, name: str) -> str:
        """The GGUF tensor that holds a leaf's data (differs only for the tied lm head)."""
        return self.aliases.get(name, name)


def output_graph(t: ModelTensors, spec: BatchSpec, inp: StepInputs[Tensor], logits: Tensor,
                 hidden: Tensor | None = None) -> Graph:
    """The finished forward graph; the engine finds its inputs and what it reads (`output`) in
    `meta`. Its output is `logits`, or with `spec.hidden` the final normed hidden state `hidden`
    (the lm head is then left out of the graph: nothing reads it)."""
    from metatp.ir.graph import Graph

    if not spec.hidden:
        return Graph([logits], name=f"{t.hp.arch}-T{spec.n_tokens}-kv{spec.n_kv}",
                     meta={"inputs": inp, "logits": logits, "output": logits, "spec": spec})
    if hidden is None:
        raise ConfigError(f"the {t.hp.arch} graph builder gives no hidden state to embed with")
    return Graph([hidden], name=f"{t.hp.arch}-T{spec.n_tokens}-kv{spec.n_kv}-hidden",
                 meta={"inputs": inp, "hidden": hidden, "output": hidden, "spec": spec})


def select_outputs(inp: StepInputs[Tensor], il: int, n_layer: int, *xs: Tensor) -> tuple[Tensor, ...]:
    """In the last layer keep only the rows whose logits are wanted (llama.cpp's inp_out_ids)."""
    if il != n_layer - 1 or inp.out_ids is None:
        return xs
    names = ("attn_out_sel", "inp_sel", "ffn_inp_sel")
    return tuple(ops.get_rows(x, inp.out_ids, name=names[i] if i < 3 else f"sel_{i}") for i, x in enumerate(xs))
