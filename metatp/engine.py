"""The forward-pass engine: graphs and plans per batch shape, weights on the backend, one KV cache.

Graphs are built and compiled once per (n_tokens, padded KV length, n_outputs) and reused,
so decoding a token costs one pass over prepared closures, not a rebuild.

One KV cache serves every sequence of an `LLM` (streams advanced in turn, threads): each
sequence is a `SequenceState` that records the forward calls that built its cache rows. The
engine remembers which sequence the cache currently holds; when another one takes its next
step, its rows are rebuilt by replaying its calls exactly as they ran (same chunks, same
plans), which gives bit-identical rows -- the backend contract has no in-place KV write to
restore a snapshot with. All of it runs under one lock per engine, held for one forward call
(never across a generator's yield). The one-sequence case costs a lock and an identity check.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from metatp.backends.base import Backend, WeightSource
from metatp.ir.errors import ConfigError, ContextOverflowError, UnsupportedOpError
from metatp.ir.loader import Model
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.ir.models.common import KV_PAD
from metatp.ir.tensor import Flag, GGMLType
from metatp.passes.compile import compile_plan
from metatp.passes.memory import plan_memory
from metatp.passes.plan import DeviceLayout, Plan

__all__ = ["Engine", "SequenceState", "sliding_window_mask"]


def sliding_window_mask(mask: np.ndarray, pos: np.ndarray, window: int) -> np.ndarray:
    """The causal mask with rows `window` or more positions back hidden as well (llama.cpp's standard
    SWA: the token at position p sees cache row j iff j <= p and p - j < window). Cache row j
    holds position j, as the engine writes token p to row p."""
    if window <= 0:
        return mask
    rows = np.arange(mask.shape[1])
    out = mask.copy()
    out[pos[:, None] - rows[None, :] >= window] = -np.inf
    return out


def padded_kv(n_used: int, n_ctx: int) -> int:
    """Attended KV length: the used length rounded up to KV_PAD, capped at the context size."""
    return min(-(-n_used // KV_PAD) * KV_PAD, n_ctx)


class SequenceState:
    """One sequence's claim on the shared KV cache: the forward calls that built its rows.

    Replaying `calls` in order (from an empty cache) rebuilds exactly the rows the sequence
    had, because each call runs the same chunks through the same plans again."""

    __slots__ = ("calls", "n_past")

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], bool]] = []     # (tokens, all_logits) per forward call
        self.n_past = 0


class Engine:
    """Runs forward passes of one model on a backend; sequences share one KV cache (see module doc)."""

    def __init__(self, model: Model, n_ctx: int, layout: DeviceLayout, backend: Backend, n_batch: int = 512) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.layout = layout
        self.backend = backend
        self.n_batch = n_batch
        self.tensors = ModelTensors(model, n_ctx, GGMLType.F32)
        self.n_past = 0
        self._plans: OrderedDict[tuple[int, int, int], tuple[Plan, object]] = OrderedDict()
        self.max_plans = 12
        self._uploaded = False
        self._weight_states: dict = {}
        self.lock = threading.RLock()       # one forward step (or one whole call) at a time
        self._owner: SequenceState | None = None    # the sequence whose rows the cache holds
        self.replays = 0                    # sequences rebuilt after another one used the cache

    # ---------------------------------------------------------------- compilation
    def plan_for(self, spec: BatchSpec) -> tuple[Plan, object]:
        """The compiled plan and prepared executable for a batch shape (LRU-cached: prompts of
        many lengths must not grow memory without bound)."""
        key = spec.key()
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
            return hit
        graph = build_graph(self.tensors, spec)
        plan = self.compile(graph)
        if not self._uploaded:
            self._upload_weights(plan)
        else:
            self._check_weight_layout(plan)
        ex = self.backend.prepare(plan)
        self._plans[key] = (plan, ex)
        while len(self._plans) > self.max_plans:
            _, (old_plan, _) = self._plans.popitem(last=False)
            self.backend.release(old_plan)
        return plan, ex

    def compile(self, graph) -> Plan:
        return compile_plan(graph, self.layout, self.model.hparams)

    def memory_plan(self):
        """Per-device bytes at the largest batch this engine runs (before any weight is loaded)."""
        T = min(self.n_batch, self.n_ctx)
        spec = BatchSpec(T, padded_kv(self.n_ctx, self.n_ctx), T)
        plan = self.compile(build_graph(self.tensors, spec))
        return plan_memory(plan, self._weight_bytes(), self.n_ctx, self.backend.workspace_bytes(plan),
                           kv_itemsize=self.backend.kv_itemsize)

    def _weight_bytes(self):
        """The backend's bytes per weight slice, counting once what it stores once (the codes of
        a tied embedding and lm head, or of a mirrored weight, shared by every device)."""
        counted: set = set()

        def weight_bytes(t, local_ne, plan) -> int:
            key = self.backend.storage_key(t, plan, self.tensors.source_name(t.name))
            if key is not None:
                if key in counted:
                    return 0
                counted.add(key)
            return self.backend.weight_bytes(t, local_ne, plan)
        return weight_bytes

    def _upload_weights(self, plan: Plan) -> None:
        """Every weight leaf goes to the backend once, in the form the backend chooses; every
        plan shares the split table. A GGUF tensor read by two leaves (a tied lm head and the
        embedding) is dequantized at most once."""
        leaves = [t for t in plan.graph.leaves if t.flags & Flag.WEIGHT]
        sources = [self.tensors.source_name(t.name) for t in leaves]
        cache: dict[str, np.ndarray] = {}

        def dequantize(src: str) -> np.ndarray:
            if src not in cache:
                cache[src] = self.model.dequantize(src)
            return cache[src]
        for t, src in zip(leaves, sources):
            source = WeightSource(src, self.model.weight(src).type, self.model.raw_bytes(src),
                                  functools.partial(dequantize, src))
            self.backend.store_weight(t, source, plan)
            if sources.count(src) == 1:
                cache.pop(src, None)
        persistent = [t for t in plan.graph.leaves if t.flags & (Flag.WEIGHT | Flag.KV_CACHE)]
        self._weight_states = {t: plan.of(t).state for t in persistent}
        used = set(leaves)
        self._unused_weights = [t.name for t in self.tensors.weights.values() if t not in used]
        self._uploaded = True

    def _check_weight_layout(self, plan: Plan) -> None:
        """Weights (and the KV cache) were sliced once, for the first plan; every later plan must split them the same way
        (the split table guarantees it; a difference would silently compute with wrong slices)."""
        for t in plan.graph.leaves:
            want = self._weight_states.get(t)
            if want is not None and plan.of(t).state != want:
                raise UnsupportedOpError(
                    f"weight {t.name!r} is split as {plan.of(t).state} in a {plan.graph.name} plan but was "
                    f"loaded as {want}; plans of one model must agree on weight splits")

    # ---------------------------------------------------------------- running
    def reset(self) -> None:
        """Start the anonymous sequence (forward without `seq`) from an empty cache."""
        with self.lock:
            self.n_past = 0
            self._owner = None

    def new_sequence(self) -> SequenceState:
        """A fresh sequence; pass it to `forward(seq=...)` for every step of that sequence."""
        return SequenceState()

    def forward(self, tokens: Sequence[int], all_logits: bool = False,
                seq: SequenceState | None = None) -> np.ndarray:
        """Feed `tokens` after the cached ones; logits for the last token (or every token).

        Without `seq`, continues the anonymous sequence at `self.n_past` (tools and tests drive
        the cache directly). With `seq`, continues that sequence, first rebuilding its rows if
        another sequence used the cache since its last step."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ConfigError("forward needs at least one token")
        with self.lock:
            if seq is None:
                self._owner = None
                return self._forward(tokens, all_logits)
            if seq.n_past + len(tokens) > self.n_ctx:
                raise ContextOverflowError(
                    f"{seq.n_past + len(tokens)} tokens do not fit in the context of {self.n_ctx} (n_ctx)")
            if self._owner is not seq:
                self._restore(seq)
            try:
                out = self._forward(tokens, all_logits)
            except BaseException:
                self._owner = None      # rows past seq.n_past may be half written: rebuild next time
                raise
            seq.calls.append((tuple(tokens), all_logits))
            seq.n_past = self.n_past
            return out

    def _restore(self, seq: SequenceState) -> None:
        """Rebuild `seq`'s cache rows by replaying its forward calls exactly as they ran."""
        self._owner = None
        self.n_past = 0
        if seq.calls:
            self.replays += 1
        for toks, all_logits in seq.calls:
            self._forward(list(toks), all_logits)
        if self.n_past != seq.n_past:       # cannot happen unless the call log was tampered with
            raise UnsupportedOpError(f"replaying a sequence gave {self.n_past} cached tokens, expected {seq.n_past}")
        self._owner = seq

    def _forward(self, tokens: list[int], all_logits: bool) -> np.ndarray:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + len(tokens)} tokens do not fit in the context of {self.n_ctx} (n_ctx)")
        outs = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last = start + self.n_batch >= len(tokens)
            n_out = len(chunk) if all_logits else (1 if last else 0)
            logits = self._forward_chunk(chunk, n_out)
            if logits is not None:
                outs.append(logits)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

    def _forward_chunk(self, tokens: list[int], n_outputs: int) -> np.ndarray | None:
        T = len(tokens)
        n_kv = padded_kv(self.n_past + T, self.n_ctx)
        spec = BatchSpec(T, n_kv, max(n_outputs, 1))
        plan, ex = self.plan_for(spec)
        inp = plan.graph.meta["inputs"]
        pos = np.arange(self.n_past, self.n_past + T, dtype=np.int32)
        ids = np.asarray(tokens, dtype=np.int64)
        n_vocab = self.model.hparams.n_vocab
        if ids.min() < 0 or ids.max() >= n_vocab:
            bad = int(ids[(ids < 0) | (ids >= n_vocab)][0])
            raise ConfigError(f"token id {bad} is out of range for a vocabulary of {n_vocab}")
        mask = np.full((T, n_kv), -np.inf, dtype=np.float32)
        for i in range(T):
            mask[i, : self.n_past + i + 1] = 0.0
        feed = {inp["tokens"]: ids.astype(np.int32), inp["pos"]: pos, inp["kv_idxs"]: pos, inp["kq_mask"]: mask}
        if "kq_mask_swa" in inp:
            feed[inp["kq_mask_swa"]] = sliding_window_mask(mask, pos, self.model.hparams.sliding_window)
        if "out_ids" in inp:
            feed[inp["out_ids"]] = np.arange(T - spec.n_outputs, T, dtype=np.int32)
        ex.run(feed)
        self.n_past += T
        if n_outputs == 0:
            return None
        logits = ex.read(plan.graph.meta["logits"])
        return logits.reshape(-1, logits.shape[-1])
