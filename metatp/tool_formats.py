"""Tool-call syntaxes: how each format's model writes its calls, and how a chat template shows
which one it uses. One small parser a format, in one table (`FORMATS`): Hermes/Qwen's
`<tool_call>{json}</tool_call>`, Llama 3.x JSON (`{"name", "parameters"}`, `<|python_tag|>`),
Mistral's `[TOOL_CALLS][...]` (and `name[ARGS]{...}`), and the generic JSON format llama-server
uses for templates with no tool syntax. A parser reads what the model wrote (`ParsedCalls`);
checking the calls against the request's tools is `metatp.tool_calls`' job.

The format is detected from markers in the template's text (`detect_format`: `<tool_call>`,
`[TOOL_CALLS]`, `<|python_tag|>` or a Llama 3 header beside `tools`; otherwise generic), or named
with `--tool-call-parser` (`format_named`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ParsedCalls", "ToolFormat", "FORMATS", "ALIASES", "PARSER_NAMES", "format_named", "detect_format",
           "parse_hermes", "parse_llama3_json", "parse_mistral", "parse_generic"]


@dataclass
class ParsedCalls:
    """A parser's reading of a text: the content beside the calls (None: none), and the calls
    as (name, arguments) with arguments as the model wrote them (not yet checked)."""

    content: str | None
    calls: list[tuple[Any, Any]] = field(default_factory=list)


def _decode_all(text: str) -> list[Any] | None:
    """JSON values one after another (whitespace, ';' or ',' between them), None if it is not that."""
    dec, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            v, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        out.append(v)
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    return out


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[Any, Any] | None:
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    key = next((k for k in args_keys if k in obj), None)
    return obj["name"], obj[key] if key else {}


def _content(text: str) -> str | None:
    """The text beside the calls as written (so a stream that sent it already agrees); None if blank."""
    return text if text.strip() else None


def _before(marker: str) -> Callable[[str], str]:
    """What of a text can be content for sure: all before `marker`, holding back an end that
    may be the start of it."""
    def visible(text: str) -> str:
        i = text.find(marker)
        if i >= 0:
            return text[:i]
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return text[:-k]
        return text
    return visible


def _llama3_visible(text: str) -> str:
    """Llama 3's calls are the whole answer: nothing is content while it may still become one."""
    s = text.lstrip()
    if not s or s.startswith("{") or s.startswith("<|python_tag|>") or "<|python_tag|>".startswith(s):
        return ""
    return text


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> ParsedCalls | None:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call,
    after any content."""
    if "<tool_call>" not in text:
        return ParsedCalls(_content(text))
    calls = []
    for block in _HERMES.findall(text):
        vals = _decode_all(block)
        call = _call(vals[0]) if vals and len(vals) == 1 else None
        if call is None:
            return None
        calls.append(call)
    return ParsedCalls(_content(text[:text.index("<tool_call>")]), calls)


def parse_llama3_json(text: str) -> ParsedCalls | None:
    """Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}` (several separated by
    ';'), optionally after `<|python_tag|>`."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None if tagged else ParsedCalls(_content(text))
    vals = _decode_all(body)
    calls = [_call(v, ("parameters", "arguments")) for v in vals or []]
    if not calls or None in calls:
        return None if tagged else ParsedCalls(_content(text))
    return ParsedCalls(None, calls)


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\[ARGS\]")


def parse_mistral(text: str) -> ParsedCalls | None:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}` a call."""
    if "[TOOL_CALLS]" not in text:
        return ParsedCalls(_content(text))
    head, _, rest = text.partition("[TOOL_CALLS]")
    calls: list = []
    if rest.lstrip().startswith("["):
        vals = _decode_all(rest)
        if not vals or not isinstance(vals[0], list) or len(vals) != 1:
            return None
        calls = [_call(v) for v in vals[0]]
    else:
        for piece in rest.split("[TOOL_CALLS]"):
            m = _MISTRAL_NAMED.match(piece)
            vals = _decode_all(piece[m.end():]) if m else None
            if not vals or len(vals) != 1:
                return None
            calls.append((m.group(1), vals[0]))
    if not calls or None in calls:
        return None
    return ParsedCalls(_content(head), calls)


def parse_generic(text: str) -> ParsedCalls | None:
    """The generic format (llama-server's, for templates with no tool syntax): one JSON object,
    `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (or one `"tool_call"`) or
    `{"response": "..."}`."""
    vals = _decode_all(text)
    if not vals or len(vals) != 1 or not isinstance(vals[0], dict):
        return ParsedCalls(_content(text))
    obj = vals[0]
    if isinstance(obj.get("response"), str) and len(obj) == 1:
        return ParsedCalls(obj["response"])
    calls = obj.get("tool_calls", [obj["tool_call"]] if "tool_call" in obj else None)
    if not isinstance(calls, list) or not calls:
        return ParsedCalls(_content(text))
    parsed = [_call(c) for c in calls]
    return None if None in parsed else ParsedCalls(None, parsed)


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax: how to tell a template uses it, and its parser. `native`: the
    template renders `tools` itself (else the generic system prompt carries them)."""

    name: str
    parse: Callable[[str], ParsedCalls | None]
    native: bool
    detect: Callable[[str], bool]
    visible: Callable[[str], str]        # the part of a text so far that is content whatever follows


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", parse_hermes, True, lambda t: "<tool_call>" in t, _before("<tool_call>")),
    ToolFormat("mistral", parse_mistral, True, lambda t: "[TOOL_CALLS]" in t, _before("[TOOL_CALLS]")),
    ToolFormat("llama3_json", parse_llama3_json, True,
               lambda t: "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t), _llama3_visible),
    ToolFormat("generic", parse_generic, False, lambda t: True, lambda t: ""),
)}
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "llama3": "llama3_json", "llama": "llama3_json"}
PARSER_NAMES = (*FORMATS, *ALIASES)


def format_named(name: str) -> ToolFormat:
    """The format `--tool-call-parser NAME` names (vLLM's names and a few aliases)."""
    from metatp.ir.errors import ConfigError

    f = FORMATS.get(ALIASES.get(name, name))
    if f is None:
        raise ConfigError(f"--tool-call-parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    return f


def detect_format(chat_template: str | None) -> ToolFormat:
    """The tool syntax of a chat template, from the markers in its text (the first that matches
    in FORMATS' order); none: the generic format."""
    text = chat_template or ""
    return next(f for f in FORMATS.values() if f.detect(text))
