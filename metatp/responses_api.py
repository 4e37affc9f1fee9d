"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat machinery: a request's `input`
(a string, or a list of input messages) and `instructions` become chat messages rendered by the
model's chat template; its sampling fields become the chat route's (`metatp.server.fields`), so
every value is checked by the one check each field has; the answer is a `response` object, whole
or as the typed server-sent events the official `openai` client parses (`client.responses.create`
with stream=True, `client.responses.stream`).

Like vLLM (without VLLM_ENABLE_RESPONSES_API_STORE), nothing is stored: `store: true` (OpenAI's
default) is accepted and ignored, and a `previous_response_id` is a 404 naming it, as vLLM answers
an id it does not hold. Tool calling is refused by name here (`refuse_unsupported`: the hook where
`tools` would be handed to metatp's tool calling once the Responses route takes it).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from metatp import openai_api as oai
from metatp import request_fields as rf
from metatp.server.fields import BadRequest, read

__all__ = ["ResponsesRequest", "ResponsesAnswer", "responses_request", "renamed", "sse_event"]

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")      # a message's text parts (earlier outputs too)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# the sampling fields passed on to the chat route's checks: OpenAI's, and vLLM's extras (stop, top_k...)
_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "ignore_eos", "frequency_penalty",
                    "presence_penalty")

# a chat field's name -> the Responses API's name for it, in a refusal the chat checks wrote
_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


@dataclass
class ResponsesRequest:
    """A /v1/responses body read: the chat messages, a chat-shaped body for the sampling fields'
    checks (`metatp.server.fields.sampling_params`), and what the response object echoes."""

    messages: list[dict]
    chat_body: dict
    stream: bool
    echo: dict = field(default_factory=dict)
    logprobs: int | None = None         # include message.output_text.logprobs: top_logprobs alternatives each


def renamed(e: BadRequest) -> BadRequest:
    """A refusal the chat route's checks wrote, naming the Responses API's field instead
    (max_tokens is max_output_tokens, response_format is text.format, messages is input)."""
    name = _NAMES.get(e.param or "")
    if name is None:
        return e
    shown = "text.format" if name == "text" else name
    message = re.sub(rf"\b{re.escape(e.param)}\b", shown, e.message)
    return BadRequest(message, name, e.code, e.status, e.kind)


def _short(v: Any) -> str:
    return json.dumps(v)[:80]


def _part_text(i: int, k: int, part: Any) -> str:
    where = f"input[{i}].content[{k}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(f"'{where}' must be a content part like {{\"type\": \"input_text\", \"text\": ...}}, got "
                         f"{_short(part)}", "input")
    if part["type"] not in _TEXT_PARTS:
        raise BadRequest(f"'{where}' has type {part['type']!r}; this model takes text only (input_text parts)",
                         "input")
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"'{where}.text' must be a string, got {_short(part.get('text'))}", "input")
    return part["text"]


def _message(i: int, item: Any) -> dict:
    """One input item as a chat message: a message item (type "message" or none) with a role and
    content (a string or text parts); any other item type is refused by name."""
    if not isinstance(item, dict):
        raise BadRequest(f"'input[{i}]' must be an input item (an object with 'role' and 'content'), got "
                         f"{_short(item)}", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise BadRequest(f"'input[{i}]' has type {kind!r}; only message items (role and content) are supported",
                         "input")
    role = item.get("role")
    if role not in ROLES:
        raise BadRequest(f"'input[{i}].role' must be one of {', '.join(ROLES)}, got {_short(role)}", "input")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_part_text(i, k, p) for k, p in enumerate(content))
    else:
        raise BadRequest(f"'input[{i}].content' must be a string or a list of input_text parts, got "
                         f"{_short(content)}", "input")
    return {"role": ROLES[role], "content": text}


def _messages(body: dict) -> list[dict]:
    """`instructions` (a system message first) and `input` (a user message, or input items) as chat messages."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest(f"'instructions' must be a string, got {_short(instructions)}", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    given = body.get("input")
    if isinstance(given, str):
        return head + [{"role": "user", "content": given}]
    if isinstance(given, list) and given:
        return head + [_message(i, item) for i, item in enumerate(given)]
    raise BadRequest(f"'input' must be a string or a non-empty list of input items, got {_short(given)}", "input")


def _text_format(body: dict) -> dict | None:
    """`text.format` as the chat route's response_format: text, json_object, or json_schema
    {name, schema, strict} (the Responses API puts the schema's fields in the format itself)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest(f"'text' must be an object like {{\"format\": {{\"type\": \"text\"}}}}, got {_short(text)}",
                         "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'text.format' must be an object with 'type' one of text, json_object, json_schema; got "
                         f"{_short(fmt)}", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise BadRequest(f"'text.format.schema' must be a JSON schema (an object), got {_short(fmt.get('schema'))}",
                         "text")
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def refuse_unsupported(body: dict) -> None:
    """Fields that would change the answer and that this route does not implement, refused by
    name: tools (the hook for tool calling), background mode, and a previous response or
    conversation (nothing is stored: a previous_response_id is a 404, as vLLM answers an id it
    does not hold)."""
    if body.get("tools") not in (None, []):
        raise BadRequest("'tools': tool calling through /v1/responses is not supported yet; use "
                         "/v1/chat/completions", "tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise BadRequest(f"'tool_choice': tool calling through /v1/responses is not supported yet, got "
                         f"{_short(body['tool_choice'])}", "tool_choice")
    if body.get("background"):
        raise BadRequest("'background': background mode needs stored responses, and this server stores none",
                         "background")
    if body.get("previous_response_id") is not None:
        raise BadRequest(f"'previous_response_id': Response with id {_short(body['previous_response_id'])} not found: "
                         "this server stores no responses (send the conversation in 'input')",
                         "previous_response_id", "not_found", 404)
    if body.get("conversation") is not None:
        raise BadRequest("'conversation': this server stores no conversations (send the conversation in 'input')",
                         "conversation")
    if body.get("reasoning") not in (None, {}) and (body["reasoning"] or {}).get("effort") not in (None, "none"):
        raise BadRequest("'reasoning': reasoning effort is not supported by this model", "reasoning")


def _logprobs(body: dict) -> int | None:
    """The output's logprobs, when `include` asks for message.output_text.logprobs: `top_logprobs`
    (0-20) alternatives each (vLLM's reading of the two fields)."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(v, str) for v in include)):
        raise BadRequest(f"'include' must be a list of strings, got {_short(include)}", "include")
    top = read(body, rf.TOP_LOGPROBS, 0)
    return top if LOGPROBS_INCLUDE in (include or []) else None


def responses_request(body: dict) -> ResponsesRequest:
    """A /v1/responses body read and checked: a 400 (a 404 for previous_response_id) naming the field."""
    refuse_unsupported(body)
    if "input" not in body:
        raise BadRequest("'input' is required", "input")
    messages = _messages(body)
    stream = read(body, rf.STREAM, False)
    max_out = read(body, rf.MAX_TOKENS.named("max_output_tokens"))
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise BadRequest(f"'metadata' must be an object of string values, got {_short(metadata)}", "metadata")
    chat_body = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    chat_body["max_tokens"] = max_out
    fmt = _text_format(body)
    if fmt is not None:
        chat_body["response_format"] = fmt
    echo = {"instructions": body.get("instructions"), "max_output_tokens": max_out, "metadata": metadata or {},
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "store": False,         # never stored, whatever the request says (vLLM without its store)
            "top_logprobs": body.get("top_logprobs")}
    return ResponsesRequest(messages, chat_body, stream, echo, _logprobs(body))


def sse_event(event: dict) -> str:
    """One typed server-sent event (`event:` its type), as OpenAI sends the Responses stream."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponsesAnswer:
    """One response being built from its request's step outputs: the whole object, or the stream's
    events in order (created, in_progress, the message and its text part added, a delta per output,
    the text and the part and the message done, completed / incomplete), each numbered."""

    def __init__(self, model: str, request: ResponsesRequest, n_prompt: int, piece: Callable[[int], str]) -> None:
        self.model, self.request, self.n_prompt, self.piece = model, request, n_prompt, piece
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.seq = 0
        self.text = ""
        self.lps: list[dict] = []           # the text's tokens' logprobs so far (when asked for)
        self.n_gen = 0

    # ------------------------------------------------------------ the objects
    def _message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._part(text, self.lps)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str, logprobs: list[dict]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _logprobs(self, outs: list) -> list[dict]:
        """The logprobs of the tokens these outputs' text is made of (chat's entries: token, logprob,
        bytes, top_logprobs); none unless asked for."""
        return [] if self.request.logprobs is None else oai.chat_logprobs(outs, self.piece)["content"]

    def _usage(self) -> dict:
        return {"input_tokens": self.n_prompt, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.n_gen, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.n_prompt + self.n_gen}

    def response(self, status: str, output: list[dict], finish: str | None = None) -> dict:
        """The response object (`status` in_progress, completed or incomplete: max_output_tokens ran out)."""
        done = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "truncation": "disabled", "usage": self._usage() if done else None, "user": None,
                **self.request.echo}

    @staticmethod
    def status_of(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    def whole(self, outs: list) -> dict:
        """The whole response from its request's outputs (the last one carries finish_reason)."""
        self.text = "".join(o.text for o in outs)
        self.lps = self._logprobs(outs)
        self.n_gen = sum(o.token is not None for o in outs)
        status = self.status_of(outs[-1].finish_reason)
        return self.response(status, [self._message(self.text, status)])

    # ------------------------------------------------------------ the stream
    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _at(self) -> dict:
        return {"item_id": self.msg_id, "output_index": 0}

    def head(self) -> list[dict]:
        """The stream's first events: the response created and in progress, its message and text part added."""
        return [self._event("response.created", response=self.response("in_progress", [])),
                self._event("response.in_progress", response=self.response("in_progress", [])),
                self._event("response.output_item.added", output_index=0,
                            item=self._message(None, "in_progress")),
                self._event("response.content_part.added", **self._at(), content_index=0, part=self._part("", []))]

    def chunk(self, out) -> list[dict]:
        """The events of one output: a text delta when it carries text (or tokens' logprobs)."""
        self.n_gen += out.token is not None
        lps = self._logprobs([out])
        if not (out.text or lps):
            return []
        self.text += out.text
        self.lps += lps
        return [self._event("response.output_text.delta", **self._at(), content_index=0, delta=out.text,
                            logprobs=lps)]

    def tail(self, finish: str | None) -> list[dict]:
        """The stream's last events: the text, part and message done, then the response completed
        (or incomplete: max_output_tokens ran out, as OpenAI ends such a stream)."""
        status = self.status_of(finish)
        message = self._message(self.text, status)
        return [self._event("response.output_text.done", **self._at(), content_index=0, text=self.text,
                            logprobs=self.lps),
                self._event("response.content_part.done", **self._at(), content_index=0,
                            part=self._part(self.text, self.lps)),
                self._event("response.output_item.done", output_index=0, item=message),
                self._event(f"response.{status}", response=self.response(status, [message]))]

    def error(self, e: BadRequest) -> dict:
        """The event a stream that fails after its headers went out ends with."""
        return self._event("error", code=e.code, message=e.message, param=e.param)


def stream_events(answer: ResponsesAnswer, outputs: Callable) -> Any:
    """The response's events as SSE text, from `outputs` (an async iterator of (choice, output))."""
    async def events():
        for ev in answer.head():
            yield sse_event(ev)
        finish = None
        try:
            async for _, out in outputs():
                for ev in answer.chunk(out):
                    yield sse_event(ev)
                finish = out.finish_reason or finish
        except BadRequest as e:
            yield sse_event(answer.error(e))
            return
        for ev in answer.tail(finish):
            yield sse_event(ev)
    return events()
