"""`metatp serve`: an OpenAI-compatible HTTP server over one LLM (FastAPI + uvicorn + SSE).

Every HTTP request becomes one scheduler request per sample (`n`); a driver thread steps the
continuous batch, and each request's outputs come back to its handler through a callback onto
the event loop. A streaming client that goes away has its requests cancelled, so their KV
cells are freed at the next step. Bad requests get OpenAI-shaped error JSON with status 400
(never a traceback); a full waiting queue answers 503.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics (Prometheus
text), /tokenize and /detokenize (llama-server's shapes).

Under MPI (`mpiexec -n N metatp serve -m MODEL -sm tensor [-ts ...]`, one process per device),
rank 0 alone runs the HTTP server, tokenizes, schedules and samples; its scheduler *leads*
(`Scheduler.lead`): before every step it posts the step's batch -- KV cells taken and freed,
each sequence's tokens and logits mode (`metatp.scheduler.StepBatch`) -- and the other ranks,
which never open a port, run the same forward pass in lock step (`metatp.scheduler.follow`),
sleeping between probes while the server idles. The server stopping (SIGINT/SIGTERM to
mpiexec, which passes them to every rank, or uvicorn exiting) posts STOP and every rank exits
0; a failing step on any rank aborts every rank with the error printed once.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import os
import signal
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator


from metatp.ir.errors import ConfigError, ContextOverflowError, MetatpError
from metatp.sampling import SamplingParams
from metatp.scheduler import QueueFullError, Request, StepOutput, follow

if TYPE_CHECKING:
    from metatp.api import LLM

try:        # module level: the handlers' string annotations (postponed evaluation) must resolve here
    from fastapi import Request as HttpRequest
except ImportError:        # metatp[serve] not installed: create_app says so
    HttpRequest = None      # type: ignore[assignment,misc]

__all__ = ["create_app", "serve", "follow_steps", "BadRequest", "refuse_mpi"]

MPI_REFUSAL = ("mpiexec started {n} processes but this LLM is not spread over them (distributed='none'?): "
               "every process would serve on one port; drop distributed='none', or run without mpiexec")

# after SIGINT/SIGTERM, how long a follower rank waits for rank 0's STOP before it gives up
FOLLOWER_GRACE_S = 20.0


def refuse_mpi(llm: "LLM | None" = None) -> None:
    """What serving under mpiexec still refuses, as a ConfigError every rank raises (rank 0
    reports it): an LLM not spread over the launcher's processes (each would serve the whole
    model on the same port). Serving an LLM whose world is the launched one is supported (rank
    0 serves, the others follow); a backend that cannot run under MPI is refused when the LLM
    is built. Without `llm` (the CLI, before the model is read) there is nothing to refuse."""
    from metatp.backends.distributed import every_rank, launched_world_size

    size = launched_world_size()
    if llm is None or size is None or size <= 1:
        return
    world = getattr(llm, "world", None)
    if world is None or world.size != size:
        raise every_rank(ConfigError(MPI_REFUSAL.format(n=size)))


def _world(llm: "LLM"):
    """`llm`'s MPI world when it spans several processes, else None (one process: as ever)."""
    refuse_mpi(llm)
    world = getattr(llm, "world", None)
    return world if world is not None and world.size > 1 else None


class BadRequest(Exception):
    """A request the server refuses: OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request field checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None,
         nullable: bool = True) -> Any:
    v = body.get(name, default)
    if v is None and nullable:
        return default
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" from {lo}" if lo is not None else ""
        rng += f" to {hi}" if hi is not None else ""
        raise BadRequest(f"'{name}' must be an integer{rng}, got {json.dumps(v)}", name)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
            or v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"'{name}' must be a number {'>' if lo_open else '>='} {lo} and <= {hi}, got {json.dumps(v)}",
                         name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return v
    raise BadRequest(f"'stop' must be a string or a list of at most 16 strings, got {json.dumps(v)[:80]}", "stop")


def _sampling(body: dict, logprobs: int | None, default_max: int | None) -> SamplingParams:
    """OpenAI's sampling fields (and llama-server's/vLLM's top_k, min_p, ignore_eos) as SamplingParams."""
    for name in ("presence_penalty", "frequency_penalty"):
        _num(body, name, 0.0, -2.0, 2.0)            # accepted as OpenAI clients send them; not applied
    max_tokens = _int(body, "max_tokens", None, 0)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _int(body, "max_completion_tokens", None, 0)
    top_k = _int(body, "top_k", -1, -1)
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0), top_p=_num(body, "top_p", 1.0, 0.0, 1.0, True),
            top_k=top_k if top_k > 0 else -1, min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.0, 10.0, True),
            seed=_int(body, "seed", None, 0, 2 ** 63 - 1), stop=_stop(body),
            ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs, n=_int(body, "n", 1, 1, 16))
    except ConfigError as e:
        raise BadRequest(str(e)) from None


# ---------------------------------------------------------------- the app
class _Server:
    """The LLM, its scheduler in driver mode, and the request handlers' shared helpers."""

    def __init__(self, llm: "LLM", model_name: str, parallel: int, max_waiting: int) -> None:
        self.llm = llm
        self.model_name = model_name
        self.names = {model_name, str(llm.model_path), os.path.basename(str(llm.model_path))}
        self.sched = llm.scheduler
        self.sched.max_num_seqs = parallel
        self.sched.max_waiting = max_waiting
        self.slot_ctx = max(1, llm.n_ctx // parallel)
        self.created = int(time.time())
        self.requests_total = 0
        self.world = _world(llm)
        if self.world is not None:
            self.sched.lead(self.world)        # rank 0 posts every step to the other ranks
            from metatp.backends.watchdog import add_fault_hook

            add_fault_hook(self.sched.abandon)  # a lost rank: requests in flight answer 500, then the job ends

    def request(self, ids: list[int], params: SamplingParams, index: int, on_event) -> Request:
        """A scheduler request. Under MPI rank 0 makes it alone (`agree=False`): the other ranks
        are in `follow` and never join a prompt broadcast; the tokens reach them in the step batches."""
        return self.llm._request(ids, params, index, max_context=self.slot_ctx, on_event=on_event,
                                 agree=self.world is None)

    def check_model(self, body: dict) -> str:
        m = body.get("model", self.model_name)
        if m is None:
            return self.model_name
        if not isinstance(m, str):
            raise BadRequest(f"'model' must be a string, got {json.dumps(m)[:60]}", "model")
        if m not in self.names:
            raise BadRequest(f"the model {m!r} does not exist; this server serves {self.model_name!r}", "model",
                             "model_not_found")
        return self.model_name

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """A completions prompt (text, token ids, or a list of either) as token id lists."""
        llm = self.llm
        if isinstance(prompt, str):
            return [llm._prompt_ids(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(_is_int(t) for t in prompt):
                return [self._ids(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [llm._prompt_ids(p) for p in prompt]
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
                return [self._ids(p) for p in prompt]
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                         "prompt")

    def _ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.llm.n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range for a vocabulary of {self.llm.n_vocab}", "prompt")
        return list(ids)

    def top_by_piece(self, top: dict[int, float] | None) -> dict[str, float]:
        """OpenAI's completions logprobs key alternatives by text: two tokens with one text (byte
        pieces of a character) keep the likelier value."""
        out: dict[str, float] = {}
        for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1]):
            out.setdefault(self.piece(t), v)
        return out

    def piece(self, tok: int) -> str:
        return self.llm.tokenizer.token_bytes(tok).decode("utf-8", errors="replace")

    async def start(self, ids_list: list[list[int]], params: SamplingParams) -> tuple[list[Request], asyncio.Queue]:
        """Submit n requests per prompt; their outputs arrive on one queue as (choice index, output)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        reqs: list[Request] = []

        def on_event(req: Request, out: StepOutput, choice: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (choice, out))
        try:
            for p, ids in enumerate(ids_list):
                if len(ids) > self.llm.n_ctx:
                    raise BadRequest(f"the prompt has {len(ids)} tokens but the context holds {self.llm.n_ctx}; "
                                     "shorten the prompt", "prompt", "context_length_exceeded")
                for i in range(params.n):
                    choice = p * params.n + i
                    req = self.request(ids, params, i, lambda r, o, c=choice: on_event(r, o, c))
                    if req.n_cells > self.llm.n_ctx:
                        raise BadRequest(f"{req.n_cells} tokens do not fit the context of {self.llm.n_ctx}",
                                         "max_tokens", "context_length_exceeded")
                    reqs.append(req)
            for req in reqs:
                self.sched.submit(req)
        except QueueFullError as e:
            self.cancel(reqs)
            raise BadRequest(str(e), None, "server_busy", 503, "server_error") from None
        except ContextOverflowError as e:
            self.cancel(reqs)
            raise BadRequest(str(e), "prompt", "context_length_exceeded") from None
        except BaseException:
            self.cancel(reqs)
            raise
        self.requests_total += 1
        return reqs, queue

    def cancel(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.done:
                self.sched.cancel(r)

    def usage(self, ids_list: list[list[int]], n: int, completion: int) -> dict:
        prompt = sum(len(ids) for ids in ids_list)          # counted once however many samples (n)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_response(e: BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def create_app(llm: "LLM", model_name: str | None = None, api_key: str | None = None, parallel: int = 4,
               max_waiting: int = 64):
    """The FastAPI app serving `llm` (its scheduler's driver thread runs while the app is up).
    Under MPI this is rank 0's app, and the other ranks must be in `follow_steps` (`serve`
    arranges both); its shutdown posts STOP to them."""
    from contextlib import asynccontextmanager

    world = _world(llm)
    if world is not None and not world.is_root:
        raise ConfigError(f"rank {world.rank} does not serve HTTP: under mpiexec rank 0 serves and the other "
                          "ranks follow its steps (metatp.server.serve does both)")

    try:
        from fastapi import FastAPI
    except ImportError:
        raise ConfigError("metatp serve needs FastAPI and uvicorn: pip install 'metatp[serve]'") from None
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    srv = _Server(llm, model_name or os.path.basename(str(llm.model_path)), parallel, max_waiting)

    @asynccontextmanager
    async def lifespan(app):
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
        return _error_response(e)

    @app.exception_handler(MetatpError)
    async def metatp_error(request: HttpRequest, e: MetatpError):
        return _error_response(BadRequest(str(e)))

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, e: Exception):   # a bug: one line, keep serving
        return JSONResponse(BadRequest(f"internal error: {type(e).__name__}: {e}", None, "internal_error", 500,
                                       "server_error").body(), status_code=500)

    async def body_of(request: HttpRequest) -> dict:
        check_auth(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

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
                                                                           "n_vocab": llm.n_vocab}}]}

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        # llama-server: add_special adds BOS (and the like) where the model asks for it
        ids = llm.tokenize(content, add_bos=None if _bool(body, "add_special", False) else False)
        if _bool(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": srv.piece(t)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        body = await body_of(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise BadRequest("'tokens' must be a list of token ids", "tokens")
        return {"content": llm.detokenize(srv._ids(tokens) if tokens else [])}

    @app.get("/metrics")
    async def metrics(request: HttpRequest):
        check_auth(request)
        return PlainTextResponse(_prometheus(srv), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest):
        body = await body_of(request)
        model = srv.check_model(body)
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", "prompt")
        lp = _int(body, "logprobs", None, 0, 20)
        params = _sampling(body, lp, 16)
        stream = _bool(body, "stream", False)
        usage_in_stream = _stream_usage(body, stream)
        echo = _bool(body, "echo", False)
        ids_list = srv.prompt_ids(body["prompt"])
        reqs, queue = await srv.start(ids_list, params)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice_lp(outs: list[StepOutput]) -> dict | None:
            if lp is None:
                return None
            toks = [o for o in outs if o.token is not None]
            offs, at = [], 0
            for o in toks:
                offs.append(at)
                at += len(o.text)
            return {"tokens": [srv.piece(o.token) for o in toks], "token_logprobs": [o.logprob for o in toks],
                    "top_logprobs": [srv.top_by_piece(o.top_logprobs) for o in toks],
                    "text_offset": offs}

        if stream:
            @_sse_errors
            async def events() -> AsyncIterator[str]:
                n_gen = 0
                async for choice, out in _outputs(request, srv, reqs, queue):
                    n_gen += out.token is not None
                    if out.text or out.finish_reason:
                        c = {"index": choice, "text": out.text, "logprobs": choice_lp([out]),
                             "finish_reason": out.finish_reason}
                        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [c], **({"usage": None} if usage_in_stream else {})})
                if usage_in_stream:
                    yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": srv.usage(ids_list, params.n, n_gen)})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        per = await _collect(request, srv, reqs, queue)
        choices = []
        for choice, outs in enumerate(per):
            prefix = llm.detokenize(ids_list[choice // params.n]) if echo else ""
            choices.append({"index": choice, "text": prefix + "".join(o.text for o in outs),
                            "logprobs": choice_lp(outs), "finish_reason": outs[-1].finish_reason})
        n_gen = sum(o.token is not None for outs in per for o in outs)
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": srv.usage(ids_list, params.n, n_gen)}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: HttpRequest):
        from metatp.api import _chat_messages

        body = await body_of(request)
        model = srv.check_model(body)
        if "messages" not in body:
            raise BadRequest("'messages' is required", "messages")
        want_lp = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, 0, 20)
        if top and not want_lp:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        params = _sampling(body, top if want_lp else None, None)
        stream = _bool(body, "stream", False)
        usage_in_stream = _stream_usage(body, stream)
        try:
            text = llm.tokenizer.apply_chat_template(_chat_messages(body["messages"]), add_generation_prompt=True)
        except ConfigError as e:
            raise BadRequest(str(e), "messages") from None
        ids = llm.tokenize(text, special=True)
        if not ids:
            raise BadRequest("the chat template rendered these messages as an empty prompt", "messages")
        reqs, queue = await srv.start([ids], params)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def lp_entry(o: StepOutput) -> dict:
            p = srv.piece(o.token)
            return {"token": p, "logprob": o.logprob, "bytes": list(p.encode()),
                    "top_logprobs": [{"token": srv.piece(t), "logprob": v, "bytes": list(srv.piece(t).encode())}
                                     for t, v in (o.top_logprobs or {}).items()]}

        def choice_lp(outs: list[StepOutput]) -> dict | None:
            return {"content": [lp_entry(o) for o in outs if o.token is not None]} if want_lp else None

        if stream:
            @_sse_errors
            async def events() -> AsyncIterator[str]:
                head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
                extra = {"usage": None} if usage_in_stream else {}
                for i in range(len(reqs)):
                    yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **extra})
                n_gen = 0
                async for choice, out in _outputs(request, srv, reqs, queue):
                    n_gen += out.token is not None
                    if out.text or out.finish_reason:
                        delta = {"content": out.text} if out.text else {}
                        yield _sse({**head, "choices": [{"index": choice, "delta": delta, "logprobs": choice_lp([out]),
                                                         "finish_reason": out.finish_reason}], **extra})
                if usage_in_stream:
                    yield _sse({**head, "choices": [], "usage": srv.usage([ids], params.n, n_gen)})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        per = await _collect(request, srv, reqs, queue)
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                    "logprobs": choice_lp(outs), "finish_reason": outs[-1].finish_reason}
                   for i, outs in enumerate(per)]
        n_gen = sum(o.token is not None for outs in per for o in outs)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": srv.usage([ids], params.n, n_gen)}

    return app


def _stream_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    return _bool(opts, "include_usage", False)


def _sse_errors(gen):
    """A stream that fails after its headers went out ends with an error event, then [DONE]."""
    async def wrapped() -> AsyncIterator[str]:
        try:
            async for chunk in gen():
                yield chunk
        except BadRequest as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
    return wrapped


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _outputs(request, srv: _Server, reqs: list[Request], queue: asyncio.Queue):
    """Each output of the requests as it comes, until every one has finished; cancels them all if
    the client goes away (or the handler is cancelled) first."""
    left = len(reqs)
    try:
        while left:
            try:
                choice, out = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if out.error is not None:
                raise BadRequest(f"generation failed: {out.error}", None, "generation_failed", 500, "server_error")
            if out.finish_reason is not None:
                left -= 1
            yield choice, out
    finally:
        srv.cancel(reqs)


async def _collect(request, srv: _Server, reqs: list[Request], queue: asyncio.Queue) -> list[list[StepOutput]]:
    per: list[list[StepOutput]] = [[] for _ in reqs]
    async for choice, out in _outputs(request, srv, reqs, queue):
        per[choice].append(out)
    if any(not outs or outs[-1].finish_reason is None for outs in per):
        raise BadRequest("the client went away", None, "cancelled", 499)
    return per


def _prometheus(srv: _Server) -> str:
    """/metrics: llama-server's and vLLM's usual quantities in Prometheus text format."""
    s, m, cells = srv.sched, srv.sched.metrics, srv.llm.engine.cells
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.extend([f"# HELP metatp_{name} {help_}", f"# TYPE metatp_{name} {kind}", f"metatp_{name} {value}"])
    metric("requests_running", "gauge", "Sequences being decoded or prefilled.", s.n_running)
    metric("requests_waiting", "gauge", "Sequences waiting for a slot or KV cells.", s.n_waiting)
    metric("requests_total", "counter", "HTTP generation requests accepted.", srv.requests_total)
    metric("sequences_accepted_total", "counter", "Sequences queued (each ends finished, cancelled or failed).",
           m.requests_accepted)
    metric("sequences_finished_total", "counter", "Sequences that finished.", m.requests_finished)
    metric("sequences_cancelled_total", "counter", "Sequences cancelled (client gone).", m.requests_cancelled)
    metric("sequences_failed_total", "counter", "Sequences that failed.", m.requests_failed)
    metric("prompt_tokens_total", "counter", "Prompt tokens processed.", m.prompt_tokens)
    metric("generation_tokens_total", "counter", "Tokens generated.", m.generated_tokens)
    metric("steps_total", "counter", "Engine steps run.", m.steps)
    metric("step_sequences_max", "gauge", "Most sequences one step carried.", m.max_step_seqs)
    metric("kv_cells_used", "gauge", "KV cells owned by sequences.", cells.n_used)
    metric("kv_cells_total", "gauge", "KV cells in the cache (n_ctx).", cells.n_cells)
    hist = dict(m.step_seqs_hist)
    lines += ["# HELP metatp_step_sequences Sequences per engine step.", "# TYPE metatp_step_sequences histogram"]
    total = 0
    for b in (1, 2, 4, 8, 16, 32, 64):
        lines.append(f'metatp_step_sequences_bucket{{le="{b}"}} {sum(v for k, v in hist.items() if k <= b)}')
    total = sum(hist.values())
    lines += [f'metatp_step_sequences_bucket{{le="+Inf"}} {total}',
              f"metatp_step_sequences_sum {sum(k * v for k, v in hist.items())}", f"metatp_step_sequences_count {total}"]
    lines += ["# HELP metatp_time_to_first_token_seconds Time from submission to the first token.",
              "# TYPE metatp_time_to_first_token_seconds histogram"]
    for b in m.TTFT_BOUNDS:
        lines.append(f'metatp_time_to_first_token_seconds_bucket{{le="{b}"}} {m.ttft_buckets.get(b, 0)}')
    lines += [f'metatp_time_to_first_token_seconds_bucket{{le="+Inf"}} {m.ttft_count}',
              f"metatp_time_to_first_token_seconds_sum {m.ttft_sum}",
              f"metatp_time_to_first_token_seconds_count {m.ttft_count}"]
    return "\n".join(lines) + "\n"


def serve(llm: "LLM", host: str = "127.0.0.1", port: int = 8080, model_name: str | None = None,
          api_key: str | None = None, parallel: int = 4, max_waiting: int = 64, log_level: str = "warning") -> None:
    """Run the server until interrupted. Under MPI every rank calls this: rank 0 serves HTTP and
    leads the steps, the other ranks follow them (`follow_steps`); an interrupt or the server
    exiting ends every rank cleanly (returns normally; SystemExit from uvicorn still propagates)."""
    world = _world(llm)
    if world is not None and not world.is_root:
        follow_steps(llm)
        return
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("metatp serve needs FastAPI and uvicorn: pip install 'metatp[serve]'") from None
    app = create_app(llm, model_name, api_key, parallel, max_waiting)
    if world is None:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
        return
    # uvicorn re-raises the SIGINT/SIGTERM it shut down on; as KeyboardInterrupt here, it ends
    # rank 0 as cleanly as the followers (which the launcher gave the same signal)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass
    finally:
        srv = app.state.server
        srv.sched.stop()
        srv.sched.stop_leading()            # once: the lifespan may have posted STOP already
        for s, h in previous.items():
            signal.signal(s, h)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def follow_steps(llm: "LLM") -> int:
    """A rank > 0 of `mpiexec ... metatp serve`: run rank 0's steps until it posts STOP (returns
    the steps run). SIGINT/SIGTERM (the launcher passes them to every rank) only start a grace
    period: rank 0 stops the server and posts STOP; if it has not within FOLLOWER_GRACE_S, a
    ConfigError ends this rank (and the job) rather than leaving it waiting."""
    world = _world(llm)
    if world is None or world.is_root:
        raise ConfigError("follow_steps runs on the ranks > 0 of an MPI world; rank 0 serves (serve)")
    signalled: list[float] = []

    def note(signum, frame) -> None:
        if not signalled:
            signalled.append(time.monotonic())

    def on_wait(waited: float) -> None:
        if signalled and time.monotonic() - signalled[0] > FOLLOWER_GRACE_S:
            raise ConfigError(f"rank {world.rank}: rank 0 did not stop the server within {FOLLOWER_GRACE_S:.0f} s "
                              "of the interrupt; ending every rank")
    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return follow(llm.engine, world, on_wait)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
