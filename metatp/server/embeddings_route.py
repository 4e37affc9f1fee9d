"""/v1/embeddings: OpenAI's embeddings route over the continuous batch (`metatp.embeddings`).

Each input is one "embed" request: they share steps with whatever else runs, and each frees its
cells when it ends. Tokenizing, the checks that grow with the input and the answer's rendering
run on the offload pool, as the other routes' do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metatp.embeddings import check_lengths, embedding_answer, embedding_inputs, embedding_options, pooled
from metatp.ir.errors import ContextOverflowError
from metatp.sampling import SamplingParams
from metatp.server.fields import BadRequest
from metatp.server.sse import collect

if TYPE_CHECKING:
    from metatp.server.frontend import Frontend
    from metatp.server.offload import Offload

__all__ = ["embeddings_answer"]


def _inputs(srv: "Frontend", body: dict) -> tuple[list[list[int]], Any]:
    """The body's inputs as token id lists (a 400 naming `input` for a bad or too long one) and
    its answer options (a 400 naming `encoding_format`, `dimensions` or `user`)."""
    llm = srv.llm
    if "input" not in body:
        raise BadRequest("'input' is required", "input")
    options = embedding_options(body, llm.model.hparams.n_embd)
    value = body["input"]
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for text in [t for t in texts if isinstance(t, str)]:                      # megabytes of text are refused untokenized
        srv.check_prompt_chars(len(text), "input")
    ids_list, _ = embedding_inputs(value, llm.tokenize, llm.n_vocab)
    try:
        check_lengths(ids_list, llm.n_ctx, srv.max_model_len)
    except ContextOverflowError as e:
        raise BadRequest(str(e), "input", "context_length_exceeded") from None
    return ids_list, options


async def embeddings_answer(request: Any, srv: "Frontend", body: dict, model: str, offload: "Offload") -> dict:
    """The answer to a /v1/embeddings body (its `model` already checked)."""
    ids_list, options = await offload(_inputs, srv, body)
    how = srv.llm.pooling                   # a model whose pooling metatp does not do: 400 before any work
    handles, queue = await srv.start(ids_list, SamplingParams(max_tokens=0), kind="embed", streamed=False,
                                     run=offload)
    per = await collect(request, srv, handles, queue)

    def answer() -> dict:
        vectors = pooled([outs[-1].hidden for outs in per], how)
        return embedding_answer(vectors, model, sum(len(ids) for ids in ids_list), options.encoding_format)
    return await offload(answer)
