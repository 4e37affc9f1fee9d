"""`LLM`'s embedding methods (`embed_ids`, llama-cpp-python's `embed` and `create_embedding`):
each input one "embed" request of the continuous batch, its final hidden states pooled on the
host (`metatp.embeddings`, which also holds the pooling and the OpenAI shapes the server shares).

`LLM` inherits them from `EmbeddingMethods`, which reads the LLM's `submit`, `tokenize`,
`n_vocab`, `n_ctx`, `max_model_len`, `model`, `model_path` and `_pooling` (the `pooling` it was
given; None: the model's).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from metatp.embeddings import check_lengths, embedding_answer, embedding_inputs, model_pooling, pooled
from metatp.ir.errors import ConfigError
from metatp.mpi_calls import mirrored
from metatp.request_fields import Flag, short, type_name
from metatp.requests import RequestHandle
from metatp.sampling import SamplingParams

__all__ = ["EmbeddingMethods"]


class EmbeddingMethods:
    """The embedding half of `LLM` (see the module doc); a mixin, not used on its own."""

    @property
    def pooling(self) -> str:
        """How embeddings pool a prompt's hidden states: the `pooling` given, else the model's."""
        return self._pooling or model_pooling(self.model.metadata, self.model.hparams.arch)

    def embed_ids(self, ids_list: Sequence[Sequence[int]], normalize: bool = True,
                  max_model_len: int | None = None) -> list[np.ndarray]:
        """The embedding (float64 [n_embd]) of each token id list: one "embed" request each, all
        in one continuous batch, pooled by `pooling`, L2-normalized unless `normalize` is False.
        An input past a request's length is a ContextOverflowError naming it."""
        how = self.pooling
        check_lengths(ids_list, self.n_ctx, self.max_model_len if max_model_len is None else max_model_len)
        handles: list[RequestHandle] = []
        try:
            for ids in ids_list:               # every input queued before any step runs: they share steps
                handles.append(self.submit(list(ids), SamplingParams(max_tokens=0), kind="embed",
                                           max_model_len=max_model_len))
            hidden = [h.hidden_states() for h in handles]
        finally:
            for h in handles:
                if not h.done:
                    h.cancel()
        return pooled(hidden, how, normalize)

    @mirrored
    def embed(self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], normalize: bool = True,
              truncate: bool = False, return_count: bool = False) -> Any:
        """Embeddings of text or token ids (llama-cpp-python's `embed`): one input (a string or
        one list of ids) gives one vector (list[float]), a list of inputs a list of vectors.
        Pooled final hidden states (`pooling`), L2-normalized unless `normalize` is False.
        `truncate`: cut inputs past a request's length (else a ContextOverflowError naming the
        input); `return_count`: also return the number of tokens embedded."""
        normalize, truncate = Flag("normalize").check(normalize), Flag("truncate").check(truncate)
        return_count = Flag("return_count").check(return_count)
        ids_list, single = embedding_inputs(input, self.tokenize, self.n_vocab)
        if truncate:
            limit = self.n_ctx if self.max_model_len is None else min(self.n_ctx, self.max_model_len)
            ids_list = [ids[:limit] for ids in ids_list]
        vectors = [v.tolist() for v in self.embed_ids(ids_list, normalize)]
        result = vectors[0] if single else vectors
        return (result, sum(len(ids) for ids in ids_list)) if return_count else result

    @mirrored
    def create_embedding(self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                         model: str | None = None) -> dict:
        """OpenAI's embeddings answer for `input` (llama-cpp-python's `create_embedding`): one
        L2-normalized vector per input, with the tokens counted in `usage`."""
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"model must be a string or None, got {type_name(model)} {short(model)}")
        ids_list, _ = embedding_inputs(input, self.tokenize, self.n_vocab)
        vectors = [v.tolist() for v in self.embed_ids(ids_list)]
        return embedding_answer(vectors, model or str(self.model_path), sum(len(ids) for ids in ids_list))
