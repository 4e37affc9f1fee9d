"""A draft model for speculative decoding (llama.cpp's `-md`, vLLM's draft-model speculator).

A small model with the target's vocabulary proposes k tokens greedily (a point-mass proposal:
`metatp.speculative.accept_sampled` keeps the target's distribution for it). It is an `Engine`
of its own with its own KV cells, on one device of the target's backend kind: under -sm tensor
or -sm layer the target is split and the draft, small by choice, runs whole on one device.

Each request has a sequence in the draft's cache and the tokens it holds. A proposal keeps the
longest prefix of those tokens that the request's context still starts with (the target may have
rejected some drafted tokens: the draft's positions past it are rewound, `KVCells.rewind`),
feeds the rest, then decodes k tokens, so the draft's KV stays in step with accepted tokens.
Where the draft's cache is full a request drafts nothing that step (the target goes on alone).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

import numpy as np

from metatp.engine import Engine, StepItem
from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.kv_cells import SeqCells

if TYPE_CHECKING:
    from metatp.api import LLM
    from metatp.passes.memory import MemoryPlan

__all__ = ["DraftModel", "check_vocab"]


def check_vocab(draft_tokens: Sequence[str], target_tokens: Sequence[str], draft_name: str, target_name: str) -> None:
    """A draft must propose the target's token ids: the same vocabulary, token by token, else a
    ConfigError naming both models."""
    if list(draft_tokens) == list(target_tokens):
        return
    n_d, n_t = len(draft_tokens), len(target_tokens)
    first = next((i for i in range(min(n_d, n_t)) if draft_tokens[i] != target_tokens[i]), min(n_d, n_t))
    raise ConfigError(f"the draft model {draft_name} ({n_d} tokens) and the target model {target_name} ({n_t} "
                      f"tokens) have different vocabularies (first difference at token id {first}); a draft "
                      "model must share the target's tokenizer")


class DraftModel:
    """Greedy proposals of a small model, one cached sequence per request (see the module doc)."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._seqs: dict[int, tuple[SeqCells, list[int]]] = {}   # request id -> its sequence, tokens in it

    @classmethod
    def load(cls, model: str | os.PathLike, target: "LLM", verbose: bool = False) -> "DraftModel":
        """The draft `model` (a GGUF path or a known name) for `target`: its vocabulary checked
        against the target's, on one device of the target's backend kind, with the target's n_ctx."""
        from metatp.backends import create_backend
        from metatp.ir.loader import load_model
        from metatp.models import resolve_model
        from metatp.passes.plan import DeviceLayout

        path = resolve_model(str(model), quiet=not verbose)
        loaded = load_model(path)
        check_vocab(loaded.tokenizer.tokens, target.tokenizer.tokens, str(model), str(target.model_path))
        layout = DeviceLayout(1, "none")
        backend = create_backend(target.backend.name, layout)
        n_ctx = min(target.n_ctx, loaded.hparams.n_ctx_train)
        return cls(Engine(loaded, n_ctx, layout, backend, n_batch=target.engine.n_batch), str(model))

    def memory_plan(self, target_n_ctx: int) -> "MemoryPlan":
        """The draft's bytes (one device) with the cache it keeps beside a target of
        `target_n_ctx` cells: the target's LLM counts them in its memory check."""
        return self.engine.memory_plan(self._n_ctx_for(target_n_ctx))

    def fit_context(self, target_n_ctx: int) -> None:
        """The target's context was shrunk to fit the memory budget: the draft's cache follows
        (before any sequence holds cells in it)."""
        n_ctx = self._n_ctx_for(target_n_ctx)
        if n_ctx != self.engine.n_ctx:
            e = self.engine
            self.engine = Engine(e.model, n_ctx, e.layout, e.backend, n_batch=e.n_batch)

    def _n_ctx_for(self, target_n_ctx: int) -> int:
        return min(target_n_ctx, self.engine.model.hparams.n_ctx_train)

    def propose(self, request_id: int, context_ids: Sequence[int], k: int) -> list[int]:
        """k greedy tokens after `context_ids` ([] where the draft's cache or context is full)."""
        return self.propose_many([(request_id, context_ids, k)])[0]

    def propose_many(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Per (request id, context, k): k greedy tokens after the context, every request's
        draft decoded in the same passes (a step of the draft engine per drafted position).
        [] for a request whose context or cells the draft's cache cannot hold now."""
        out: list[list[int]] = [[] for _ in asks]
        live = []                                   # [index, request id, seq, context, tokens to feed, k]
        for i, (request_id, context_ids, k) in enumerate(asks):
            context = [int(t) for t in context_ids]
            if len(context) + k > self.engine.n_ctx:
                self.forget(request_id)             # past the draft's context: its cells go now
            if k <= 0 or not context or len(context) + k > self.engine.n_ctx:
                continue
            seq = self._sequence(request_id, context, k)
            if seq is not None:
                live.append([i, request_id, seq, context, context[seq.n_past:], k])
        done = list(live)
        try:
            while live:
                outs = self.engine.run([StepItem(seq, feed, "argmax") for _, _, seq, _, feed, _ in live])
                for entry, got in zip(live, outs):
                    tok = int(got) if isinstance(got, (int, np.integer)) else int(np.argmax(got))
                    out[entry[0]].append(tok)
                    entry[4] = [tok]
                live = [e for e in live if len(out[e[0]]) < e[5]]
        finally:                # what each sequence holds (a failed pass committed nothing)
            for i, request_id, seq, context, _, _ in done:
                self._seqs[request_id] = (seq, (context + out[i][:-1])[:seq.n_past])
        return out

    def _sequence(self, request_id: int, context: list[int], k: int) -> SeqCells | None:
        """The request's draft sequence, rewound to the longest prefix of `context` it holds (the
        last token is always fed again), with cells for k more positions; None (its cells
        given back) where the draft's cache cannot hold them now."""
        seq, held = self._seqs.pop(request_id, (None, []))
        try:
            if seq is None:
                seq = self.engine.new_sequence(0)
            same = 0
            for a, b in zip(held, context[:-1]):
                if a != b:
                    break
                same += 1
            self.engine.cells.rewind(seq, min(same, seq.n_past))
            self.engine.cells.grow(seq, len(context) + k - 1)
        except ContextOverflowError:        # the draft's cache is full: no proposal this step
            if seq is not None:
                self.engine.free(seq)
            return None
        return seq

    def forget(self, request_id: int) -> None:
        """The request has ended: its draft sequence's cells go back."""
        got = self._seqs.pop(request_id, None)
        if got is not None:
            self.engine.free(got[0])

    def __repr__(self) -> str:
        return f"DraftModel({self.name!r}, {len(self._seqs)} sequences)"
