"""The forward-pass engine: graphs and plans per batch shape, weights on the backend, a unified KV cache.

Graphs are built and compiled once per (n_tokens, padded KV length, n_outputs) and reused,
so decoding a token costs one pass over prepared closures, not a rebuild.

The KV cache is one block of `n_ctx` cells shared by every sequence (llama.cpp's unified
cache): `metatp.kv_cells` says which sequence owns each cell. One engine step (`run`) takes
rows of many sequences -- the decode token of each running one, chunks of new prompts --
and computes them in one or a few forward passes (`metatp.step.Pass`, which `metatp.pipeline`
drives); the attention mask keeps every row inside its own sequence, and logits are read only
at the rows that are sampled.

Batch invariance (a sequence's logits do not depend on what shares its step): rows are
grouped into passes the same way whatever their neighbours are. A pass of at most
`backend.step_rows()` rows takes the backend's few-token path (on numpy the compiled kernels,
whose per-row sums do not depend on the other rows or on where a sequence's cells are, see
`run`); longer prompt chunks run in passes of their own. Every sequence's cells start on a multiple of
`backend.kv_page()` where possible, so attention meets its window at the same phase as alone (see
tests/test_batching.py for where bit-identity holds and where not). Pass lengths are rounded up
to a few buckets with padding rows, so that a handful of plans serve every batch size.
A step that fails commits nothing: a sequence's positions advance only after every pass of
its step succeeded, so a half-written row is rewritten, never read.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np

from metatp.backends.base import Backend, WeightSource
from metatp.ir.errors import ConfigError, ContextOverflowError, UnsupportedOpError
from metatp.ir.loader import Model
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.ir.models.common import KV_PAD, cache_type
from metatp.ir.tensor import Flag
from metatp.kv_cells import KVCells, SeqCells
from metatp import pipeline
from metatp.pipeline import Pipelining
from metatp.passes.compile import compile_plan
from metatp.passes.memory import plan_memory
from metatp.passes.plan import DeviceLayout, Plan
from metatp.sampling import CandidateSpec
from metatp.step import Pass, Row, StepItem, bucket_rows

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["Engine", "StepItem", "SeqCells", "padded_kv", "bucket_rows"]


def padded_kv(n_used: int, n_ctx: int) -> int:
    """Attended KV length: the used length rounded up to KV_PAD, capped at the context size."""
    return min(-(-n_used // KV_PAD) * KV_PAD, n_ctx)


class Engine:
    """Runs forward passes of one model on a backend; sequences share one KV cache of `n_ctx` cells."""

    def __init__(self, model: Model, n_ctx: int, layout: DeviceLayout, backend: Backend, n_batch: int = 512,
                 world: World | None = None, cache_type_k: str = "f32", cache_type_v: str | None = None) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.layout = layout
        self.backend = backend
        self.n_batch = n_batch
        # one process per device (metatp.backends.distributed): every rank runs the same steps
        # (rank 0 leads them, metatp.lockstep); nothing here exchanges tokens between ranks
        self.world = world
        kt = cache_type(cache_type_k, "k")
        vt = kt if cache_type_v is None else cache_type(cache_type_v, "v")
        self.cache_types = (kt, vt)
        self.tensors = ModelTensors(model, n_ctx, kt, vt)     # ConfigError if a head is not whole blocks
        # rows per pass on the backend's few-token path, and the cell alignment that keeps a
        # sequence's attention at the phase it has alone (both from the backend: batch invariance)
        self.small_rows = backend.step_rows()
        self.row_buckets = tuple(backend.row_buckets())     # the sizes few-token passes pad to
        self.cells = KVCells(n_ctx, page=backend.kv_page())
        self._plans: OrderedDict[tuple[int, int, int], tuple[Plan, object]] = OrderedDict()
        self.max_plans = 32
        self._weight_states: dict = {}
        self.lock = threading.RLock()       # one step at a time (steps come from any thread)
        self._anon: SeqCells | None = None  # the sequence `forward` without `seq` continues
        self.passes = 0                     # forward passes run (statistics)
        # passes of a step in flight at once under -sm layer across processes (metatp.pipeline);
        # None: the default there, 1: one pass after another
        self.micro_batches: int | None = pipeline.env_micro_batches()
        self.logits_bytes = 0               # logits bytes gathered to this process (statistics)
        self.candidate_rows = 0             # rows sampled from their candidates, not gathered (statistics)

    # ---------------------------------------------------------------- compilation
    def plan_for(self, spec: BatchSpec, slot: int = 0) -> tuple[Plan, object]:
        """The compiled plan and prepared executable for a batch shape (LRU-cached: prompts of
        many lengths must not grow memory without bound); `slot` > 0: another executable of the
        same shape, with buffers of its own (passes in flight together, `metatp.pipeline`)."""
        key = spec.key() if not slot else (*spec.key(), slot)
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
            return hit
        graph = build_graph(self.tensors, spec)
        plan = self.compile(graph)
        self._check_weight_layout(plan)     # what earlier plans stored is split as this one splits it,
        self._upload_weights(plan)          # and what none of them read (the lm head, after an embedding plan) goes up now
        ex = self.backend.prepare(plan)
        self._plans[key] = (plan, ex)
        while len(self._plans) > self.max_plans:
            _, (old_plan, _) = self._plans.popitem(last=False)
            self.backend.release(old_plan)
        return plan, ex

    def kv_span(self, n_used: int, n_rows: int) -> int:
        """Cache cells a pass of `n_rows` rows attends over when its rows see cells below
        `n_used`: n_used rounded up to KV_PAD, at least the backend's floor (`kv_span_floor`),
        at most n_ctx. One plan per span."""
        return max(padded_kv(n_used, self.n_ctx), min(self.backend.kv_span_floor(n_rows), self.n_ctx))

    def warm_up(self, max_seqs: int) -> int:
        """Compile now the plans a server of `max_seqs` parallel sequences meets first, as
        llama-server's warm-up and vLLM's start-up capture do: decode steps of 1..max_seqs
        sequences, and few-token passes of 16 rows up to `small_rows` (one short prompt, or
        the prompts of several requests arriving together) with the logits of 1..max_seqs of
        their rows. A burst of requests then compiles few plans (each ~40-170 ms on the CPU; 16
        requests of 15-token prompts arriving at once met three more, ~0.13 s of their 1.4-1.7
        s, before the passes of 16-48 rows were warmed too). Where the backend's span floor
        covers the cache (`kv_span_floor`) these are the plans of every depth. Returns the
        number of plans compiled."""
        cap = min(self.small_rows, self.n_batch)
        rows = functools.partial(bucket_rows, cap=cap, small=self.small_rows, buckets=self.row_buckets)
        buckets = sorted({rows(n) for n in range(1, min(max_seqs, cap) + 1)})
        passes = sorted({rows(n) for n in range(16, cap + 1)})
        shapes = [(T, T) for T in buckets] + [(T, n) for T in passes for n in buckets if n < T]
        self.max_plans = max(self.max_plans, len(shapes) + 8)    # warmed plans must not evict each other
        made = 0
        for T, n_out in shapes:
            spec = BatchSpec(T, self.kv_span(1, T), n_out)
            if spec.key() not in self._plans:
                self.plan_for(spec)
                made += 1
        return made

    def compile(self, graph) -> Plan:
        return compile_plan(graph, self.layout, self.model.hparams)

    def memory_plan(self, n_ctx: int | None = None):
        """Per-device bytes at the largest batch this engine runs (before any weight is loaded);
        `n_ctx`: those of an engine like this one with a cache of `n_ctx` cells (fitting the
        context tries several without building an Engine for each)."""
        n_ctx = self.n_ctx if n_ctx is None else n_ctx
        # ConfigError, as Engine(n_ctx) raises it, if a head is not whole blocks
        tensors = self.tensors if n_ctx == self.n_ctx else ModelTensors(self.model, n_ctx, *self.cache_types)
        T = min(self.n_batch, n_ctx)
        spec = BatchSpec(T, padded_kv(n_ctx, n_ctx), T)
        plan = self.compile(build_graph(tensors, spec))
        return plan_memory(plan, self._weight_bytes(tensors), n_ctx, self.backend.workspace_bytes(plan),
                           kv_itemsize=self.backend.kv_itemsize, host=self._host_bytes(plan, spec, n_ctx))

    def _host_bytes(self, plan: Plan, spec: BatchSpec, n_ctx: int) -> int:
        """Host bytes that grow with n_ctx: the cell table (and its searches) and a pass's float32
        masks (`step.Pass.issue` builds one per mask input, T x n_kv, before the backend copies it in)."""
        inputs = plan.graph.meta["inputs"]
        n_masks = sum(m is not None for m in (inputs.kq_mask, inputs.kq_mask_swa))
        return KVCells.planned_bytes(n_ctx) + n_masks * spec.n_tokens * spec.n_kv * 4

    def _weight_bytes(self, tensors: ModelTensors):
        """The backend's bytes per weight slice, counting once what it stores once (the codes of
        a tied embedding and lm head, or of a mirrored weight, shared by every device)."""
        counted: set = set()

        def weight_bytes(t, local_ne, plan) -> int:
            key = self.backend.storage_key(t, plan, tensors.source_name(t.name))
            if key is not None:
                if key in counted:
                    return 0
                counted.add(key)
            return self.backend.weight_bytes(t, local_ne, plan)
        return weight_bytes

    def _upload_weights(self, plan: Plan) -> None:
        """Every weight leaf goes to the backend once, in the form the backend chooses, with the
        first plan that reads it; every plan shares the split table. A GGUF tensor read by two
        leaves (a tied lm head and the embedding) is dequantized at most once."""
        leaves = [t for t in plan.graph.leaves if t.flags & Flag.WEIGHT and t not in self._weight_states]
        if not leaves:
            return
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
        self._weight_states.update((t, plan.of(t).state) for t in persistent if t not in self._weight_states)
        used = set(self._weight_states)
        self._unused_weights = [t.name for t in self.tensors.weights.values() if t not in used]

    def _check_weight_layout(self, plan: Plan) -> None:
        """Weights (and the KV cache) were sliced once, for the first plan; every later plan must split them the same way
        (the split table guarantees it; a difference would silently compute with wrong slices)."""
        for t in plan.graph.leaves:
            want = self._weight_states.get(t)
            if want is not None and plan.of(t).state != want:
                raise UnsupportedOpError(
                    f"weight {t.name!r} is split as {plan.of(t).state} in a {plan.graph.name} plan but was "
                    f"loaded as {want}; plans of one model must agree on weight splits")

    # ---------------------------------------------------------------- sequences
    def new_sequence(self, n_cells: int = 0) -> SeqCells:
        """A fresh sequence owning `n_cells` cells now (it grows on demand past them)."""
        return self.cells.reserve(n_cells)

    def free(self, seq: SeqCells) -> None:
        """The sequence ended (finished, failed or cancelled): its cells go back to the pool."""
        self.cells.free(seq)
        if seq is self._anon:
            self._anon = None

    @property
    def n_past(self) -> int:
        """Tokens in the anonymous sequence (the one `forward` without `seq` continues)."""
        return self._anon.n_past if self._anon is not None else 0

    def reset(self) -> None:
        """Start the anonymous sequence over (its cells are freed)."""
        with self.lock:
            if self._anon is not None:
                self.free(self._anon)

    # ---------------------------------------------------------------- running
    def pipelining(self) -> Pipelining:
        """What `metatp.pipeline` needs to know to run this engine's passes: the micro-batch
        setting, the layout's stages, whether they are processes, and the point-to-point links
        whose sends can be deferred (the backend collective's `send_recv`, where it declares
        `defers_sends`)."""
        collective = self.backend.collective
        link = collective.send_recv if collective is not None else None
        links = (link,) if link is not None and link.defers_sends else ()
        return Pipelining(self.micro_batches, self.layout.pp, self.world is not None, links)

    def forward(self, tokens: Sequence[int], all_logits: bool = False,
                seq: SeqCells | None = None) -> np.ndarray:
        """Feed `tokens` after the cached ones of one sequence; logits for the last token (or every token).

        Without `seq`, continues the anonymous sequence (tools and tests drive the cache directly).
        Under MPI every rank must make the same call with the same tokens (`metatp bench` draws
        them from one seed and feeds the argmax of logits every rank reads alike); nothing is
        exchanged here. `LLM`'s calls never come here: rank 0 leads their steps (metatp.lockstep)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ConfigError("forward needs at least one token")
        with self.lock:
            if seq is None:
                if self._anon is None:
                    self._anon = self.cells.reserve(0)
                seq = self._anon
            return self.run([StepItem(seq, tokens, "all" if all_logits else "last")])[0]

    def run(self, items: Sequence[StepItem]) -> list[np.ndarray | None]:
        """One engine step: every item's tokens at its sequence's next positions, each sequence at
        most once. Returns per item its logits: [n_vocab] ("last"), [len(tokens), n_vocab] ("all"),
        the greedy token as an int ("argmax"; its logits where one is not finite), `RowCandidates`
        (a CandidateSpec that covers; else its row), its final hidden states [len(tokens), n_embd]
        ("hidden": embeddings) or None. Rows are split into passes (decode
        tokens and short chunks in passes of at most `small_rows` rows, longer chunks in passes of
        up to n_batch rows); positions are
        committed only when every pass succeeded. Under MPI every rank makes this call with the
        same items on the same cells (a server's followers replay rank 0's `StepBatch`es,
        `metatp.lockstep.follow`): passes, padding and masks depend on nothing else."""
        items = list(items)
        if len({id(it.seq) for it in items}) != len(items):
            raise ConfigError("a step may carry each sequence only once")
        n_vocab = self.model.hparams.n_vocab
        small: list[Row] = []
        large: list[Row] = []
        hidden_small: list[Row] = []            # embedding rows: passes of their own (their graphs end before the lm head)
        hidden_large: list[Row] = []
        for k, it in enumerate(items):
            if not it.tokens:
                raise ConfigError("forward needs at least one token")
            spec = it.logits if isinstance(it.logits, CandidateSpec) else None
            if spec is None and it.logits not in ("last", "all", "none", "argmax", "hidden"):
                raise ConfigError(f"logits must be 'last', 'all', 'none', 'argmax' or 'hidden', got {it.logits!r}")
            ids = np.asarray(it.tokens, dtype=np.int64)
            if ids.min() < 0 or ids.max() >= n_vocab:
                bad = int(ids[(ids < 0) | (ids >= n_vocab)][0])
                raise ConfigError(f"token id {bad} is out of range for a vocabulary of {n_vocab}")
            end = it.seq.n_past + len(it.tokens)
            if end > self.n_ctx:
                raise ContextOverflowError(f"{end} tokens do not fit in the context of {self.n_ctx} (n_ctx)")
            if it.seq.freed:
                raise ConfigError(f"sequence {it.seq.id} has ended; start a new one")
            self.cells.grow(it.seq, end)
            n = len(it.tokens)
            last = spec is not None or it.logits in ("last", "argmax")
            every = it.logits in ("all", "hidden")
            rows = [Row(k, it.seq.n_past + i, t, every or (last and i == n - 1), it.logits == "argmax",
                         spec) for i, t in enumerate(it.tokens)]
            if it.logits == "hidden":
                (hidden_small if n <= self.small_rows else hidden_large).extend(rows)
            else:
                (small if n <= self.small_rows else large).extend(rows)
        keep = {it.seq.id: it.seq.n_past + len(it.tokens) for it in items}
        got: dict[int, list[np.ndarray]] = {}
        with self.lock:
            step_small = min(self.small_rows, self.n_batch)
            how = self.pipelining()
            groups = []
            for few, many in ((small, large), (hidden_small, hidden_large)):
                groups += pipeline.split_small(how, few, step_small) if few else []
                groups += [many[i:i + self.n_batch] for i in range(0, len(many), self.n_batch)]
            passes = [Pass(self, items, rows, keep) for rows in groups]
            for p, outs in zip(passes, pipeline.run_passes(how, passes, len(items))):
                for row, logits in zip([r for r in p.rows if r.out], outs):
                    got.setdefault(row.item, []).append(logits)
            for it in items:          # every pass succeeded: the rows are the sequences' own now
                it.seq.n_past += len(it.tokens)
        out: list[np.ndarray | None] = []
        for k, it in enumerate(items):
            rows = got.get(k)
            out.append(None if rows is None else np.stack(rows) if it.logits in ("all", "hidden") else rows[-1])
        return out
