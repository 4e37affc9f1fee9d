"""Server-sent events and output collection: a request's outputs as they come (a client that
goes away cancels its requests), errors inside a stream as an error event."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from metatp.requests import RequestHandle
from metatp.output_processor import StepOutput
from metatp.server.fields import BadRequest, bool_field
from metatp.server.frontend import Frontend, request_failure


def stream_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    return bool_field(opts, "include_usage", False)


def sse_errors(gen):
    """A stream that fails after its headers went out ends with an error event, then [DONE]."""
    async def wrapped() -> AsyncIterator[str]:
        try:
            async for chunk in gen():
                yield chunk
        except BadRequest as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"
    return wrapped


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def outputs(request, srv: Frontend, reqs: list[RequestHandle], queue: asyncio.Queue):
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
                raise request_failure(out.error)
            if out.finish_reason is not None:
                left -= 1
            yield choice, out
    finally:
        srv.cancel(reqs)


async def collect(request, srv: Frontend, reqs: list[RequestHandle], queue: asyncio.Queue) -> list[list[StepOutput]]:
    per: list[list[StepOutput]] = [[] for _ in reqs]
    async for choice, out in outputs(request, srv, reqs, queue):
        per[choice].append(out)
    if any(not outs or outs[-1].finish_reason is None for outs in per):
        raise BadRequest("the client went away", None, "cancelled", 499)
    return per
