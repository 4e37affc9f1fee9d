"""The FastAPI app: routes, auth and error handlers; the OpenAI response shapes per route."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import metatp
from metatp import request_fields as rf
from metatp import responses_api
from metatp.ir.errors import ConfigError, MetatpError
from metatp.logprobs import prompt_logprobs
from metatp.sampling import SamplingParams
from metatp.openai_answers import ChatAnswer, TextAnswer
from metatp.openai_messages import chat_prompt_ids
from metatp.request_fields import HTTP, FieldError
from metatp.server.body import parse_object, read_body
from metatp.server.chat_page import add_chat_page
from metatp.server.embeddings_route import embeddings_answer
from metatp.server.fields import (BadRequest, as_bad_request, check_constraint, read, tool_plan,
                                  refuse_unimplemented_chat, refuse_unimplemented_completion, sampling_params)
from metatp.server.frontend import DeviceUnavailable, Frontend
from metatp.server.metrics import prometheus_text
from metatp.server.offload import Offload
from metatp.server.ranks import served_world
from metatp.server import tokenization
from metatp.server.sse import collect, outputs, sse, sse_errors, stream_usage
from metatp.server.tenants import AuthError, Tenants, bind_request_tenant, tenants_of
from metatp.structured import prepare as prepare_constraints
from metatp.tool_calls import ToolPlan
from metatp.tool_calls import constrain as constrain_to_tools
from metatp.tool_formats import detect_format, format_named

if TYPE_CHECKING:
    from metatp.api import LLM

try:        # module level: the handlers' string annotations (postponed evaluation) must resolve here
    from fastapi import Request as HttpRequest
except ImportError:        # metatp[serve] not installed: create_app says so
    HttpRequest = None      # type: ignore[assignment,misc]


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}    # routing's refusals' error codes


def error_response(e: BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def allow_cors(app, origins: Sequence[str]) -> None:
    """Answer browsers from `origins` (CORS). A preflight (OPTIONS) is answered by the middleware
    before any route, so it needs no API key (a browser sends none with it); the actual request
    still does. The headers are what llama.cpp's server tests expect."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"], allow_credentials=True)


def create_app(llm: "LLM", model_name: str | None = None, api_key: "str | Sequence[str] | Tenants | None" = None,
               max_model_len: int | None = None, allowed_origins: Sequence[str] = (), webui: bool = True,
               tool_call_parser: str | None = None):
    """The FastAPI app serving `llm` (its scheduler's driver thread runs while the app is up),
    with `api_key`: one key, several or `Tenants` (each key a tenant: `metatp.server.tenants`;
    None: no key, one anonymous tenant),
    with the LLM's own limits (`LLM(max_num_seqs=, max_waiting=)`: the server changes none).
    Under MPI this is rank 0's app, and the other ranks must be in `follow_steps` (`serve`
    arranges both); its shutdown posts STOP to them. `max_model_len`: one request's cap (prompt +
    completion); default the LLM's, else n_ctx // max_num_seqs (llama-server's slot).
    `allowed_origins`: the browser origins ("*": any) that may call it (CORS); none: no CORS headers.
    `webui`: serve the chat page at / and /chat (`metatp.server.chat_page`; off: `--no-webui`).
    `tool_call_parser`: the tool-call format (metatp.tool_calls.FORMATS; vLLM's --tool-call-parser);
    default: detected from the model's chat template."""
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
    from starlette.exceptions import HTTPException as StarletteHTTPException

    tool_format = format_named(tool_call_parser) if tool_call_parser else detect_format(llm.tokenizer.chat_template)
    srv = Frontend(llm, model_name or os.path.basename(str(llm.model_path)), max_model_len)
    offload = Offload()         # what grows with a request's size runs there: the event loop only routes

    @asynccontextmanager
    async def lifespan(app):
        prepare_constraints(llm.tokenizer)       # before serving: it holds the GIL a while
        srv.sched.start()
        try:
            yield
        finally:
            offload.close()
            srv.sched.stop()
            srv.sched.stop_leading()
            if srv.world is not None:
                from metatp.backends.watchdog import remove_fault_hook

                remove_fault_hook(srv.sched.abandon)

    app = FastAPI(title="metatp", lifespan=lifespan)
    app.state.server = srv
    if allowed_origins:
        allow_cors(app, allowed_origins)
    app.state.offload = offload
    if webui:
        add_chat_page(app)

    tenants = tenants_of(api_key)

    def check_auth(request: HttpRequest) -> None:
        """The request's API key names its tenant, whose requests this handler then makes
        (`bind_request_tenant`); a 401 naming nothing secret otherwise."""
        try:
            bind_request_tenant(tenants.authenticate(request.headers.get("authorization", "")))
        except AuthError as e:
            raise BadRequest(str(e), None, "invalid_api_key", 401, "authentication_error") from None

    @app.exception_handler(BadRequest)
    async def bad_request(request: HttpRequest, e: BadRequest):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException):
        """Routing's own refusals (an unknown path: 404, a wrong method: 405) as OpenAI's error
        object, the shape every other refusal has, instead of FastAPI's {"detail"}."""
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(BadRequest(f"{e.detail}: {request.method} {request.url.path}", None, _HTTP_CODES.get(
            e.status_code), e.status_code, kind).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(DeviceUnavailable)
    async def device_unavailable(request: HttpRequest, e: DeviceUnavailable):   # 503, Retry-After when it may pass
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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
        """The request's body, read here (it streams in) and parsed on the offload pool."""
        check_auth(request)
        return await offload(parse_object, await read_body(request.stream()))

    def json_answer(answer: dict) -> JSONResponse:
        """An answer rendered as the response body (on the offload pool: it grows with the request)."""
        return JSONResponse(answer)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        """ok; 503 naming the device and its error once a device has failed (it runs nothing more)."""
        fault = llm.backend.fault
        if fault is None:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "device": fault.device, "error": str(fault)}, status_code=503)

    def model_object() -> dict:
        """The served model as OpenAI's model object (what /v1/models lists and /v1/models/{id} answers)."""
        return {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "metatp",
                "meta": {"n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab}, "max_model_len": srv.max_model_len}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: HttpRequest):
        check_auth(request)
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    @app.get("/models/{model_id:path}")
    async def model(request: HttpRequest, model_id: str):
        """client.models.retrieve: the served model by its name or alias; 404 model_not_found otherwise."""
        check_auth(request)
        srv.check_model({"model": model_id})
        return model_object()

    @app.get("/version")
    async def version():
        """vLLM's /version: the package's version."""
        return {"version": metatp.__version__}

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        """llama-server's and vLLM's bodies (metatp.server.tokenization)."""
        return await offload(tokenization.tokenize_answer, srv, await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        return JSONResponse(await offload(tokenization.detokenize_answer, srv, await body_of(request)))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HttpRequest):
        """vLLM's: what lm-evaluation-harness's remote tokenizer reads (eos/bos tokens, chat template)."""
        check_auth(request)
        return tokenization.tokenizer_info(srv)

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

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: HttpRequest):
        """OpenAI's embeddings: pooled final hidden states, one request per input (metatp.server.embeddings_route)."""
        body = await body_of(request)
        model = srv.check_model(body)
        answer = await embeddings_answer(request, srv, body, model, offload)
        return await offload(json_answer, answer)

    @app.get("/metrics")
    async def metrics(request: HttpRequest):
        check_auth(request)
        return PlainTextResponse(prometheus_text(srv), media_type="text/plain; version=0.0.4")

    def completion_request(body: dict) -> tuple[SamplingParams, list[list[int]], int | None, bool, int | None]:
        """A completion body's fields checked, its SamplingParams built (a constraint checked) and
        its prompts tokenized: (params, prompt ids, logprobs, echo, prompt_logprobs)."""
        refuse_unimplemented_completion(body)
        lp = read(body, rf.LOGPROBS)
        params = sampling_params(body, lp, 16)
        echo = read(body, rf.ECHO, False)
        n_prompt_lp = read(body, rf.PROMPT_LOGPROBS)          # vLLM's field
        ids_list = srv.prompt_ids(body["prompt"])
        srv.check_max_tokens(body, ids_list)                   # a max_tokens past the context: 400
        return params, ids_list, lp, echo, n_prompt_lp

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest):
        body, model, stream, usage_in_stream = await generation_body(request, "prompt")
        params, ids_list, lp, echo, n_prompt_lp = await offload(completion_request, body)
        scored = None                           # per prompt: its tokens' logprobs (echo + logprobs)
        if (echo and lp is not None) or n_prompt_lp is not None:
            scored = await prompt_entries(request, ids_list, max(lp or 0, n_prompt_lp or 0), params.cache_salt)
        reqs, queue = await srv.start(ids_list, params, streamed=stream, run=offload)
        answer = await offload(TextAnswer, model, ids_list, params.n, srv.piece, llm.detokenize, usage_in_stream,
                               echo, lp, n_prompt_lp, scored)      # an echo detokenizes the prompts
        return await respond(request, answer, reqs, queue, stream)

    async def prompt_entries(request: HttpRequest, ids_list: list[list[int]], k: int,
                             cache_salt: str | None) -> list[list]:
        """Each prompt's per-token logprobs, top `k` and ranks, from one scoring pass each (its
        blocks cached under the request's salt)."""
        handles, queue = await srv.start(ids_list, SamplingParams(max_tokens=0, cache_salt=cache_salt), kind="score",
                                         streamed=False, run=offload)
        per = await collect(request, srv, handles, queue)
        return await offload(lambda: [prompt_logprobs(outs[-1].logits, ids, k) for ids, outs in zip(ids_list, per)])

    def chat_request(body: dict) -> tuple[SamplingParams, list[int], bool, ToolPlan | None]:
        """A chat body's fields checked, its SamplingParams built (a constraint checked) and its
        messages rendered by the chat template and tokenized: (params, prompt ids, logprobs,
        the tool plan)."""
        refuse_unimplemented_chat(body)
        tools = tool_plan(body, tool_format)                      # a 400 naming the tool field
        want_lp = read(body, rf.CHAT_LOGPROBS, False)
        params = sampling_params(body, rf.chat_logprobs(want_lp, read(body, rf.TOP_LOGPROBS, 0), HTTP), None)
        params = constrain_to_tools(params, tools)               # a schema llguidance refuses: 400 naming tools
        srv.check_chat_chars(body["messages"])                   # megabytes of text are refused unrendered
        ids = chat_prompt_ids(llm.tokenizer, body["messages"], tools, tool_format)   # a FieldError names "messages"
        srv.check_max_tokens(body, [ids])                         # a max_tokens past the context: 400
        return params, ids, want_lp, tools

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: HttpRequest):
        body, model, stream, usage_in_stream = await generation_body(request, "messages")
        params, ids, want_lp, tools = await offload(chat_request, body)
        reqs, queue = await srv.start([ids], params, streamed=stream, run=offload)
        return await respond(request, ChatAnswer(model, ids, params.n, srv.piece, usage_in_stream, want_lp, tools),
                             reqs, queue, stream)

    def responses_prompt(parsed: responses_api.ResponsesRequest) -> tuple[SamplingParams, list[int], ToolPlan | None]:
        """A /v1/responses request's SamplingParams, prompt ids (its messages rendered by the chat
        template) and tool plan, checked by the chat route's checks; a refusal names the Responses field."""
        try:
            tools = tool_plan(parsed.chat_body, tool_format)
            params = sampling_params(parsed.chat_body, parsed.logprobs, None)
            params = constrain_to_tools(params, tools)
            srv.check_chat_chars(parsed.messages)
            ids = chat_prompt_ids(llm.tokenizer, parsed.messages, tools, tool_format)
            srv.check_max_tokens(parsed.chat_body, [ids])
        except FieldError as e:
            raise responses_api.renamed(as_bad_request(e)) from None
        except BadRequest as e:
            raise responses_api.renamed(e) from None
        return params, ids, tools

    @app.post("/v1/responses")
    async def responses(request: HttpRequest):
        """OpenAI's Responses API (metatp.responses_api): a response object, or its typed events."""
        body = await body_of(request)
        model = srv.check_model(body)
        parsed = await offload(responses_api.responses_request, body)
        try:
            await check_constraint(parsed.chat_body, llm.tokenizer)
        except BadRequest as e:
            raise responses_api.renamed(e) from None
        params, ids, tools = await offload(responses_prompt, parsed)
        reqs, queue = await srv.start([ids], params, streamed=parsed.stream, run=offload)
        answer = responses_api.ResponsesAnswer(model, parsed, len(ids), srv.piece, tools)
        if not parsed.stream:
            per = await collect(request, srv, reqs, queue)
            return await offload(lambda: json_answer(answer.whole(per[0])))
        return StreamingResponse(responses_api.stream_events(answer, lambda: outputs(request, srv, reqs, queue)),
                                 media_type="text/event-stream")

    async def respond(request: HttpRequest, answer, reqs, queue, stream: bool):
        """The answer as server-sent events, or whole once every choice has finished (built and
        rendered on the offload pool: an echo or logprobs grow with the request)."""
        if not stream:
            per = await collect(request, srv, reqs, queue)
            return await offload(lambda: json_answer(answer.whole(per)))

        @sse_errors
        async def events() -> AsyncIterator[str]:
            for c in answer.head():
                yield sse(c)
            async for choice, out in outputs(request, srv, reqs, queue):
                for c in answer.chunks(choice, out):
                    yield sse(c)
            for c in answer.tail():
                yield sse(c)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app
