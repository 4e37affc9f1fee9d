"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat machinery: a request's `input`
(a string, or a list of input messages) and `instructions` become chat messages rendered by the
model's chat template; its sampling fields become the chat route's (`metatp.server.fields`), so
every value is checked by the one check each field has; the answer is a `response` object, whole
or as the typed server-sent events the official `openai` client parses (`client.responses.create`
with stream=True, `client.responses.stream`).

Like vLLM (without VLLM_ENABLE_RESPONSES_API_STORE), nothing is stored: `store: true` (OpenAI's
default) is accepted and ignored, and a `previous_response_id` is a 404 naming it, as vLLM answers
an id it does not hold.

Function tools are metatp's tool calling (metatp.tool_calls: the same checks, formats, constraints
and validation as the chat route); only the shapes differ, here at the edge: the Responses API's
flat tools `{"type": "function", "name", "parameters"}` and `{"type": "function", "name"}`
tool_choice become chat's nested ones, `function_call` / `function_call_output` input items become
an assistant's tool_calls and `tool` messages, and the answer's calls become `function_call` output
items (streamed as output_item.added, function_call_arguments.delta / .done, output_item.done).
Other tool types (web_search, file_search, mcp...) are refused by name.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from metatp import openai_api as oai
from metatp import request_fields as rf
from metatp.server.fields import BadRequest, read
from metatp.tool_answers import ReplyTokens, ToolStream, tool_answer
from metatp.tool_calls import ToolPlan

__all__ = ["ResponsesRequest", "ResponsesAnswer", "responses_request", "renamed", "sse_event"]

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")      # a message's text parts (earlier outputs too)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# the sampling fields passed on to the chat route's checks: OpenAI's, and vLLM's extras (stop, top_k...)
_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "ignore_eos", "frequency_penalty",
                    "presence_penalty")

# a chat field's name -> the Responses API's name for it, in a refusal the chat checks wrote
_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}
_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.")      # chat's tools[i].function.X is tools[i].X here


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
    (max_tokens is max_output_tokens, response_format is text.format, messages is input,
    tools[i].function.parameters is tools[i].parameters)."""
    if e.param and _CHAT_TOOL_FIELD.match(e.param):
        return BadRequest(_CHAT_TOOL_FIELD.sub(r"tools[\1].", e.message), _CHAT_TOOL_FIELD.sub(r"tools[\1].", e.param),
                          e.code, e.status, e.kind)
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


def _message(i: int, item: dict) -> dict:
    """A message item (type "message" or none) as a chat message: a role and content (a string
    or text parts)."""
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


def _strings(i: int, item: dict, names: tuple[str, ...]) -> list[str]:
    """The item's string fields `names`, each required (a 400 naming input[i].<name> otherwise)."""
    for name in names:
        if not isinstance(item.get(name), str):
            raise BadRequest(f"'input[{i}].{name}' must be a string ({item['type']} items have "
                             f"{', '.join(names)}), got {_short(item.get(name))}", "input")
    return [item[name] for name in names]


def _function_call(i: int, item: dict) -> dict:
    """A function_call item (an earlier answer's call) as chat's tool call."""
    call_id, name, arguments = _strings(i, item, ("call_id", "name", "arguments"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_output(i: int, item: dict, calls: set[str]) -> dict:
    """A function_call_output item (a call's result) as chat's `tool` message; the call it
    answers must be among the input's function_call items (as OpenAI checks)."""
    call_id = _strings(i, item, ("call_id",))[0]
    if call_id not in calls:
        raise BadRequest(f"'input[{i}].call_id': no function_call item in the input has call_id {call_id!r}: a "
                         "function_call_output answers an earlier function_call item (send it in 'input')", "input")
    output = item.get("output")
    if isinstance(output, list):
        output = "\n".join(_part_text(i, k, p) for k, p in enumerate(output))
    if not isinstance(output, str):
        raise BadRequest(f"'input[{i}].output' must be a string or a list of input_text parts, got "
                         f"{_short(output)}", "input")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _items(given: list) -> list[dict]:
    """Input items as chat messages: message items as they are; function_call items as the
    tool_calls of one assistant message (joining the assistant's message item just before them,
    as one turn); function_call_output items as `tool` messages. Other item types are refused."""
    out: list[dict] = []
    calls: set[str] = set()
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise BadRequest(f"'input[{i}]' must be an input item (an object with 'role' and 'content'), got "
                             f"{_short(item)}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            call = _function_call(i, item)
            calls.add(call["id"])
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append(_function_output(i, item, calls))
        else:
            raise BadRequest(f"'input[{i}]' has type {kind!r}; only message, function_call and function_call_output "
                             "items are supported", "input")
    return out


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
        return head + _items(given)
    raise BadRequest(f"'input' must be a string or a non-empty list of input items, got {_short(given)}", "input")


def _chat_tool(i: int, t: Any) -> dict:
    """A Responses function tool (flat: type, name, description, parameters, strict) as chat's
    nested one, which metatp.tool_calls checks; other tool types are refused by name."""
    at = f"tools[{i}]"
    if not isinstance(t, dict):
        raise BadRequest(f"'{at}' must be a function tool {{\"type\": \"function\", \"name\": ..., \"parameters\": "
                         f"...}}, got {_short(t)}", at)
    kind = t.get("type")
    if kind != "function":
        raise BadRequest(f"'{at}.type' is {_short(kind)}: only function tools (type \"function\") are supported; "
                         "this server runs no hosted tools (web_search, file_search, mcp, ...)", f"{at}.type")
    if "function" in t and "name" not in t:
        raise BadRequest(f"'{at}': a Responses API function tool is flat ({{\"type\": \"function\", \"name\", "
                         "\"parameters\"}), not chat's nested 'function'", f"{at}.name")
    if t.get("strict") is not None and not isinstance(t["strict"], bool):
        raise BadRequest(f"'{at}.strict' must be a boolean, got {_short(t['strict'])}", f"{at}.strict")
    return {"type": "function", "function": {k: t.get(k) for k in ("name", "description", "parameters")}}


def _chat_tool_choice(v: Any) -> Any:
    """tool_choice ("auto", "none", "required" or {"type": "function", "name"}) as chat's."""
    if v is None or v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": "
                     f"...}}, got {_short(v)}", "tool_choice")


def _tool_fields(body: dict) -> dict:
    """The body's tools, tool_choice and parallel_tool_calls in chat's shapes (checked there)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list of function tools, got {_short(tools)}", "tools")
    fields = {"tools": [_chat_tool(i, t) for i, t in enumerate(tools or [])],
              "tool_choice": _chat_tool_choice(body.get("tool_choice"))}
    if body.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = body["parallel_tool_calls"]
    return fields


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


def _forces_a_call(body: dict) -> bool:
    """Does tool_choice force a function call (required, or a named function)? Then the answer
    holds no text, and text.format has nothing to shape: it is checked and left out (instructor's
    RESPONSES_TOOLS mode sends the tool's schema as both, and OpenAI takes them together)."""
    return bool(body.get("tools")) and (body.get("tool_choice") == "required"
                                        or isinstance(body.get("tool_choice"), dict))


def refuse_unsupported(body: dict) -> None:
    """Fields that would change the answer and that this route does not implement, refused by
    name: max_tool_calls, background mode, and a previous response or conversation (nothing is
    stored: a previous_response_id is a 404, as vLLM answers an id it does not hold)."""
    if body.get("max_tool_calls") is not None:
        raise BadRequest("'max_tool_calls' is not supported (parallel_tool_calls false makes one call at most)",
                         "max_tool_calls")
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
    chat_body.update(_tool_fields(body))
    fmt = _text_format(body)
    if fmt is not None and not _forces_a_call(body):
        chat_body["response_format"] = fmt
    echo = {"instructions": body.get("instructions"), "max_output_tokens": max_out, "metadata": metadata or {},
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "store": False,         # never stored, whatever the request says (vLLM without its store)
            "top_logprobs": body.get("top_logprobs"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False}
    return ResponsesRequest(messages, chat_body, stream, echo, _logprobs(body))


def sse_event(event: dict) -> str:
    """One typed server-sent event (`event:` its type), as OpenAI sends the Responses stream."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponsesAnswer:
    """One response being built from its request's step outputs: the whole object, or the stream's
    events in order (created, in_progress, the message and its text part added, a delta per output,
    the text and the part and the message done, completed / incomplete), each numbered.

    With a tool plan (`tools`, metatp.tool_calls) the text is read for calls as the chat route
    reads it: the message (output_text) is there only when there is content, opened in a stream
    with its first piece of content (what cannot still turn into a call: `ToolStream`); each call
    is a function_call item after it, streamed whole at the end once it has been validated. The
    message's logprobs are then the generated tokens' (as chat's choice logprobs with tools),
    given with the text done."""

    def __init__(self, model: str, request: ResponsesRequest, n_prompt: int, piece: Callable[[int], str],
                 tools: ToolPlan | None = None) -> None:
        self.model, self.request, self.n_prompt, self.piece = model, request, n_prompt, piece
        self.tools = tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.seq = 0
        self.text = ""
        self.lps: list[dict] = []           # the text's tokens' logprobs so far (when asked for)
        self.n_gen = 0
        self.tool_stream = ToolStream(tools) if tools is not None else None
        self.outs: list = []                # with tools: the outputs, whose logprobs go out at the end
        self.opened = False                 # has the stream's message been added

    # ------------------------------------------------------------ the objects
    def _message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._part(text, self.lps)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str, logprobs: list[dict]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @staticmethod
    def _function_call(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
        """A tool call (chat's shape, metatp.tool_calls) as a function_call output item."""
        fn = call["function"]
        return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments,
                "status": status}

    def _logprobs(self, outs: list) -> list[dict]:
        """The logprobs of the tokens these outputs' text is made of (chat's entries: token, logprob,
        bytes, top_logprobs); none unless asked for."""
        return [] if self.request.logprobs is None else oai.chat_logprobs(outs, self.piece)["content"]

    def _answer_logprobs(self, outs: list) -> list[dict]:
        """The whole answer's logprobs: under a generic-format plan that may reply (tool_choice
        auto), only the tokens of the {"response": ...} string, each with the content it adds
        (`ReplyTokens`, as chat's answers list them), so they spell the message's text."""
        if self.request.logprobs is None or self.tools is None or not ToolStream(self.tools).replies:
            return self._logprobs(outs)
        reply = ReplyTokens()
        reply.add([t for o in outs for t in o.tokens])
        return oai.chat_logprobs([SimpleNamespace(tokens=reply.take(final=True))], self.piece)["content"]

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
                "model": self.model, "output": output, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None},
                "truncation": "disabled", "usage": self._usage() if done else None, "user": None,
                **self.request.echo}

    @staticmethod
    def status_of(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    def whole(self, outs: list) -> dict:
        """The whole response from its request's outputs (the last one carries finish_reason)."""
        text, finish = "".join(o.text for o in outs), outs[-1].finish_reason
        self.lps = self._answer_logprobs(outs)
        self.n_gen = sum(o.token is not None for o in outs)
        calls: list[dict] = []
        if self.tools is not None:
            content, calls, finish = tool_answer(self.tools, text, finish)
            text = content or ""
        status = self.status_of(finish)
        self.text = text
        output = [self._message(text, status)] if text or not calls else []
        return self.response(status, output + [self._function_call(c) for c in calls])

    # ------------------------------------------------------------ the stream
    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _at(self) -> dict:
        return {"item_id": self.msg_id, "output_index": 0}

    def _open(self) -> list[dict]:
        """The message and its text part added (once)."""
        if self.opened:
            return []
        self.opened = True
        return [self._event("response.output_item.added", output_index=0, item=self._message(None, "in_progress")),
                self._event("response.content_part.added", **self._at(), content_index=0, part=self._part("", []))]

    def _delta(self, text: str, lps: list[dict]) -> list[dict]:
        self.text += text
        self.lps += lps
        return self._open() + [self._event("response.output_text.delta", **self._at(), content_index=0, delta=text,
                                           logprobs=lps)]

    def head(self) -> list[dict]:
        """The stream's first events: the response created and in progress, its message and text
        part added (with tools: when its first content comes)."""
        head = [self._event("response.created", response=self.response("in_progress", [])),
                self._event("response.in_progress", response=self.response("in_progress", []))]
        return head if self.tools is not None else head + self._open()

    def chunk(self, out) -> list[dict]:
        """The events of one output: a text delta when it carries text (or tokens' logprobs); with
        tools, the content that cannot turn into a call any more."""
        self.n_gen += out.token is not None
        if self.tool_stream is not None:
            self.outs.append(out)
            piece = self.tool_stream.push(out.text)
            return self._delta(piece, []) if piece else []
        lps = self._logprobs([out])
        if not (out.text or lps):
            return []
        return self._delta(out.text, lps)

    def _calls_tail(self, finish: str | None) -> tuple[list[dict], list[dict], str | None]:
        """With tools, at the end: the rest of the content's events and the validated calls."""
        content, calls, finish = self.tool_stream.finish(finish)
        events = self._delta(content, []) if content else []
        if self.opened or not calls:
            events += self._open()
            self.lps = self._answer_logprobs(self.outs)
        return events, calls, finish

    def tail(self, finish: str | None) -> list[dict]:
        """The stream's last events: the text, part and message done (when there is a message),
        each function call's item added, its arguments, the item done; then the response completed
        (or incomplete: max_output_tokens ran out, as OpenAI ends such a stream)."""
        events, calls = [], []
        if self.tool_stream is not None:
            events, calls, finish = self._calls_tail(finish)
        status = self.status_of(finish)
        output = []
        if self.opened:
            message = self._message(self.text, status)
            output.append(message)
            events += [self._event("response.output_text.done", **self._at(), content_index=0, text=self.text,
                                   logprobs=self.lps),
                       self._event("response.content_part.done", **self._at(), content_index=0,
                                   part=self._part(self.text, self.lps)),
                       self._event("response.output_item.done", output_index=0, item=message)]
        for call in calls:
            events += self._call_events(len(output), call)
            output.append(self._function_call(call))
        return events + [self._event(f"response.{status}", response=self.response(status, output))]

    def _call_events(self, index: int, call: dict) -> list[dict]:
        """One function call's events: its item added (no arguments yet), the arguments (one delta:
        a call goes out once it is whole and valid), the arguments done, the item done."""
        item = self._function_call(call)
        at = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_item.added", output_index=index,
                            item=self._function_call(call, "in_progress", "")),
                self._event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **at, arguments=item["arguments"],
                            name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=item)]

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
