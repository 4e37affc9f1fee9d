"""OpenAI chat messages as the prompt's token ids, written once for `LLM.create_chat_completion`
and the server's /v1/chat/completions: the messages are checked and normalised (content as
text; an assistant's `tool_calls` and a `tool` message's `tool_call_id` checked), rendered with the
GGUF's chat template and tokenized with its special tokens. With tools, the request's `ToolPlan`
(metatp.tool_calls) puts them into the prompt: through the template when it takes `tools`, else
in the system prompt (the generic format).

Every refusal is a `FieldError` naming "messages" (a ConfigError for the Python API, a 400 with
param "messages" for the server), with the message that names the part that is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from metatp.ir.errors import ConfigError
from metatp.request_fields import FieldError, short, type_name

if TYPE_CHECKING:
    from metatp.ir.tokenizer import Tokenizer
    from metatp.tool_calls import ToolPlan
    from metatp.tool_formats import ToolFormat

__all__ = ["chat_messages", "chat_prompt_ids"]


def _content(i: int, content: Any) -> str:
    """A chat message's content as text: a string, None (no content: ""), or OpenAI content parts
    of type "text" (joined with newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or "type" not in part:
                raise FieldError("messages", f"messages[{i}]['content'][{k}] must be a content part like "
                                             f"{{'type': 'text', 'text': ...}}, got {short(part)}")
            if part["type"] != "text":
                raise FieldError("messages", f"messages[{i}]['content'][{k}] has type {part['type']!r}; this model "
                                             "takes text only (content parts of type 'text')")
            text = part.get("text")
            if not isinstance(text, str):
                raise FieldError("messages", f"messages[{i}]['content'][{k}]['text'] must be a string, got "
                                             f"{short(text)}")
            texts.append(text)
        return "\n".join(texts)
    raise FieldError("messages", f"messages[{i}]['content'] must be a string, None or a list of text content parts, "
                                 f"got {type_name(content)} {short(content)}")


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's tool_calls: [{id, type "function", function {name, arguments}}]
    (arguments a JSON string, as OpenAI sends them, or already an object)."""
    at = f"messages[{i}]['tool_calls']"
    if not isinstance(calls, (list, tuple)):
        raise FieldError("messages", f"{at} must be a list of tool calls, got {short(calls)}")
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise FieldError("messages", f"{at}[{k}] must be {{'id': ..., 'type': 'function', 'function': "
                                         f"{{'name': str, 'arguments': a JSON string}}}}, got {short(c)}")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise FieldError("messages", f"{at}[{k}]['id'] must be a string, got {short(c['id'])}")
    return list(calls)


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI-style messages, normalised for the template: content always a string; a tool
    result message carries its call's function `name` (from the assistant's call it answers)
    where the client did not give it, as templates that print it expect."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise FieldError("messages", f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                                     f"got {type_name(messages)} {short(messages)}")
    out: list[dict] = []
    names: dict[str, str] = {}          # tool call id -> its function's name
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise FieldError("messages", f"messages[{i}] must be a dict with a 'role', got {short(m)}")
        if not isinstance(m["role"], str):
            raise FieldError("messages", f"messages[{i}]['role'] must be a string, got {short(m['role'])}")
        m = {**m, "content": _content(i, m.get("content"))}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise FieldError("messages", f"messages[{i}] has tool_calls but role {m['role']!r}: only an "
                                             "assistant message calls tools")
            m["tool_calls"] = _tool_calls(i, m["tool_calls"])
            names.update({c["id"]: c["function"]["name"] for c in m["tool_calls"] if c.get("id")})
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise FieldError("messages", f"messages[{i}] (role 'tool') needs 'tool_call_id', the id of the "
                                             f"call it answers, got {short(m.get('tool_call_id'))}")
            if not m.get("name") and m["tool_call_id"] in names:
                m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


_tool_role: dict[str, bool] = {}       # chat template text -> does it print a "tool" message's content


def takes_tool_role(tokenizer: "Tokenizer") -> bool:
    """Does the chat template render a message of role "tool" (its content appears)? Probed once
    per template, as llama.cpp probes a template's capabilities; else tool results are sent as
    user messages."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if template not in _tool_role:
        probe = "metatp-tool-result-probe"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                                  {"role": "tool", "content": probe, "tool_call_id": "c"}])
        except ConfigError:
            text = ""
        _tool_role[template] = probe in text
    return _tool_role[template]


def chat_prompt_ids(tokenizer: "Tokenizer", messages: Any, tools: "ToolPlan | None" = None,
                    tool_format: "ToolFormat | None" = None) -> list[int]:
    """The token ids of `messages` rendered by the model's chat template (with the generation
    prompt), special tokens parsed, as the model expects a chat turn. `tools`: the request's tool
    plan; `tool_format`: the template's tool syntax (default: detected from the template). A
    missing template, or one that refuses these messages (raise_exception), is a FieldError
    naming "messages" too."""
    from metatp.tool_calls import render_messages
    from metatp.tool_formats import detect_format

    fmt = tool_format or detect_format(getattr(tokenizer, "chat_template", None))
    msgs = chat_messages(messages)
    try:
        tool_role = fmt.native or not any(m["role"] == "tool" for m in msgs) or takes_tool_role(tokenizer)
        msgs, extra = render_messages(msgs, tools, fmt, tool_role)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **extra)
    except FieldError:
        raise
    except ConfigError as e:
        raise FieldError("messages", str(e)) from None
    ids = tokenizer.encode(text, add_bos=None, special=True)
    if not ids:
        raise FieldError("messages", "the chat template rendered these messages as an empty prompt")
    return ids
