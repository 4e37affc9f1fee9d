"""The FastAPI app: routes, auth and error handlers; the OpenAI response shapes per route."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, AsyncIterator

from metatp import request_fields as rf
from metatp.ir.errors import ConfigError, MetatpError
from metatp.logprobs import prompt_logprobs
from metatp.sampling import SamplingParams
from metatp.openai_answers import ChatAnswer, TextAnswer
from metatp.openai_messages import chat_prompt_ids
from metatp.request_fields import HTTP, FieldError
from metatp.server.body import parse_object, read_body
from metatp.server.fields import (BadRequest, as_bad_request, bool_field, is_int, read, refuse_unimplemented_chat,
                                  refuse_unimplemented_completion, sampling_params)
from metatp.server.fields import check_constraint
from metatp.structured import prepare as prepare_constraints
from metatp.server.frontend import Frontend
from metatp.server.metrics import prometheus_text
from metatp.server.ranks import served_world
from metatp.server.sse import collect, outputs, sse, sse_errors, stream_usage

if TYPE_CHECKING:
    from metatp.api import LLM

try:        # module level: the handlers' string annotations (postponed evaluation) must resolve here
    from fastapi import Request as HttpRequest
except ImportError:        # metatp[serve] not installed: create_app says so
    HttpRequest = None      # type: ignore[assignment,misc]


def error_response(e: BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def create_app(llm: "LLM", model_name: str | None = None, api_key: str | None = None,
               max_model_len: int | None = None):
    """The FastAPI app serving `llm` (its scheduler's driver thread runs while the app is up),
    with the LLM's own limits (`LLM(max_num_seqs=, max_waiting=)`: the server changes none).
    Under MPI this is rank 0's app, and the other ranks must be in `follow_steps` (`serve`
    arranges both); its shutdown posts STOP to them. `max_model_len`: one request's cap (prompt +
    completion); default the LLM's, else n_ctx // max_num_seqs (llama-server's slot)."""
    from contextlib import asynccontextmanager

    world = served_world(llm)
    if world is not None and not world.is_root:
        raise ConfigError(f"rank {world.rank} does not serve HTTP: under mpiexec rank 0 serves and the other "
                          "ranks follow its steps (metatp.server.serve does both)")

    try:
        from fastapi import FastAPI
    except ImportError:
        raise ConfigError("metatp serve needs FastAPI and uvicorn: pip install 'metatp[serve]'") from None
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    srv = Frontend(llm, model_name or os.path.basename(str(llm.model_path)), max_model_len)

    @asynccontextmanager
    async def lifespan(app):
        prepare_constraints(llm.tokenizer)       # before serving: it holds the GIL a while
        srv.sched.start()
        try:
            yield
        finally:
            srv.sched.stop()
            srv.sched.stop_leading()
            if srv.world is not None:
                from metatp.backends.watchdog import remove_fault_hook

                remove_fault_hook(srv.sched.abandon)

    app = FastAPI(title="metatp", lifespan=lifespan)
    app.state.server = srv

    def check_auth(request: HttpRequest) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise BadRequest("invalid or missing API key (Authorization: Bearer <key>)", None, "invalid_api_key",
                             401, "authentication_error")

    @app.exception_handler(BadRequest)
    async def bad_request(request: HttpRequest, e: BadRequest):
        return error_response(e)

    @app.exception_handler(FieldError)
    async def field_error(request: HttpRequest, e: FieldError):       # a request field's check: 400 naming it
        return error_response(as_bad_request(e))

    @app.exception_handler(MetatpError)
    async def metatp_error(request: HttpRequest, e: MetatpError):
        return error_response(BadRequest(str(e)))

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, e: Exception):   # a bug: one line, keep serving
        return JSONResponse(BadRequest(f"internal error: {type(e).__name__}: {e}", None, "internal_error", 500,
                                       "server_error").body(), status_code=500)

    async def body_of(request: HttpRequest) -> dict:
        check_auth(request)
        return parse_object(await read_body(request.stream()))

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: HttpRequest):
        check_auth(request)
        return {"object": "list", "data": [{"id": srv.model_name, "object": "model", "created": srv.created,
                                            "owned_by": "metatp", "meta": {"n_ctx": llm.n_ctx,
                                                                           "n_vocab": llm.n_vocab},
                                            "max_model_len": srv.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        # llama-server: add_special adds BOS (and the like) where the model asks for it
        ids = llm.tokenize(content, add_bos=None if bool_field(body, "add_special", False) else False)
        if bool_field(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": srv.piece(t)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        body = await body_of(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise BadRequest("'tokens' must be a list of token ids", "tokens")
        return {"content": llm.detokenize(rf.vocabulary_ids("tokens", tokens, llm.n_vocab, HTTP))}

    async def generation_body(request: HttpRequest, required: str) -> tuple[dict, str, bool, bool]:
        """A generation route's body, the model it names, whether it streams and whether the
        stream ends with usage; a BadRequest when `required` ('prompt' / 'messages') is missing."""
        body = await body_of(request)
        model = srv.check_model(body)
        if required not in body:
            raise BadRequest(f"'{required}' is required", required)
        stream = read(body, rf.STREAM, False)
        await check_constraint(body, llm.tokenizer)      # off the event loop; a 400 naming the field
        return body, model, stream, stream_usage(body, stream)

    @app.get("/metrics")
    async def metrics(request: HttpRequest):
        check_auth(request)
        return PlainTextResponse(prometheus_text(srv), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest):
        body, model, stream, usage_in_stream = await generation_body(request, "prompt")
        refuse_unimplemented_completion(body)
        lp = read(body, rf.LOGPROBS)
        params = sampling_params(body, lp, 16)
        echo = read(body, rf.ECHO, False)
        n_prompt_lp = read(body, rf.PROMPT_LOGPROBS)          # vLLM's field
        ids_list = srv.prompt_ids(body["prompt"])
        scored = None                           # per prompt: its tokens' logprobs (echo + logprobs)
        if (echo and lp is not None) or n_prompt_lp is not None:
            scored = await prompt_entries(request, ids_list, max(lp or 0, n_prompt_lp or 0))
        reqs, queue = await srv.start(ids_list, params, streamed=stream)
        answer = TextAnswer(model, ids_list, params.n, srv.piece, llm.detokenize, usage_in_stream, echo, lp,
                            n_prompt_lp, scored)
        return await respond(request, answer, reqs, queue, stream)

    async def prompt_entries(request: HttpRequest, ids_list: list[list[int]], k: int) -> list[list]:
        """Each prompt's per-token logprobs, top `k` and ranks, from one scoring pass each."""
        handles, queue = await srv.start(ids_list, SamplingParams(max_tokens=0), kind="score", streamed=False)
        per = await collect(request, srv, handles, queue)
        return [prompt_logprobs(outs[-1].logits, ids, k) for ids, outs in zip(ids_list, per)]

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: HttpRequest):
        body, model, stream, usage_in_stream = await generation_body(request, "messages")
        refuse_unimplemented_chat(body)
        want_lp = read(body, rf.CHAT_LOGPROBS, False)
        params = sampling_params(body, rf.chat_logprobs(want_lp, read(body, rf.TOP_LOGPROBS, 0), HTTP), None)
        ids = chat_prompt_ids(llm.tokenizer, body["messages"])      # a FieldError: a 400 naming "messages"
        reqs, queue = await srv.start([ids], params, streamed=stream)
        return await respond(request, ChatAnswer(model, ids, params.n, srv.piece, usage_in_stream, want_lp),
                             reqs, queue, stream)

    async def respond(request: HttpRequest, answer, reqs, queue, stream: bool):
        """The answer as server-sent events, or whole once every choice has finished."""
        if not stream:
            return answer.whole(await collect(request, srv, reqs, queue))

        @sse_errors
        async def events() -> AsyncIterator[str]:
            for c in answer.head():
                yield sse(c)
            async for choice, out in outputs(request, srv, reqs, queue):
                c = answer.chunk(choice, out)
                if c is not None:
                    yield sse(c)
            for c in answer.tail():
                yield sse(c)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app
