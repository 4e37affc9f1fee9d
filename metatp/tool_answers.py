"""Tool calling's answer side (the request side, plan and prompt are `metatp.tool_calls`): what
the model wrote under a `ToolPlan`, read back into OpenAI's answer.

- `tool_answer`: the format's parser reads the whole text, and every call is checked (a callable
  tool, arguments that validate against its JSON schema, a client's `pattern` matched within a
  time budget) before it reaches the client as a tool call; otherwise the text is plain content;
- `ToolStream`: the same for a stream, sending the content that cannot still turn into a call
  as it comes;
- `ReplyTokens`: which generated tokens a chat answer's logprobs list under a plan that may reply
  (the generic format's {"response": "..."}).
"""

from __future__ import annotations

import json
import re
import uuid
from types import SimpleNamespace
from typing import Any, Sequence

from metatp.request_fields import short
from metatp.tool_calls import ToolPlan, ToolRequest, call_arguments, jsonschema_module

__all__ = ["ToolStream", "ReplyTokens", "tool_answer", "call_id"]


def call_id() -> str:
    """A fresh tool call id, as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


REGEX_BUDGET_S = 0.1     # one `pattern` matched against one value: a client's regex may backtrack forever


def _search(pattern: str, text: str) -> bool:
    """Does the client's `pattern` match in `text`, decided within REGEX_BUDGET_S? Python's `re`
    cannot be stopped (and holds the GIL: `(a+)+$` on 40 characters would stall the server), so
    the `regex` module's timeout decides; too slow or not a regex: no match (the call is refused)."""
    try:
        import regex
    except ImportError:
        from metatp.ir.errors import ConfigError

        raise ConfigError("tools: a schema's 'pattern' is checked with the regex package: pip install "
                          "'metatp[structured]'") from None
    try:
        return regex.search(pattern, text, timeout=REGEX_BUDGET_S) is not None
    except (TimeoutError, regex.error):
        return False


def _validator(schema: dict) -> Any:
    """jsonschema's validator of `schema`, its regex keywords (pattern, patternProperties) matched
    within a time budget (`_search`)."""
    jsonschema = jsonschema_module()

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not _search(patrn, instance):
            yield jsonschema.ValidationError(f"{short(instance)} does not match {short(patrn)}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for patrn, subschema in patterns.items():
                for k, v in instance.items():
                    if _search(patrn, k):
                        yield from validator.descend(v, subschema, path=k, schema_path=patrn)

    base = jsonschema.validators.validator_for(schema)
    return jsonschema.validators.extend(base, {"pattern": pattern, "patternProperties": pattern_properties})(schema)


def _valid(req: ToolRequest, name: Any, args: Any) -> dict | None:
    """The OpenAI tool call of (name, arguments) when the name is a callable tool and the
    arguments validate against its schema; None otherwise (it never reaches the client)."""
    tool = req.tool(name) if isinstance(name, str) else None
    if tool is None or tool not in req.callable_tools:
        return None
    args = call_arguments(args)
    if args is None:
        args = {}
    try:
        if not _validator(tool.parameters).is_valid(args):
            return None
    except RecursionError:                      # arguments nested past Python's recursion: not a call
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


_RESPONSE_HEAD = re.compile(r'^\s*\{\s*"response"\s*:\s*"')


def _partial_response(text: str) -> str | None:
    """The reply's text so far in the generic format's {"response": "...": the JSON string decoded
    up to its last whole character (an escape cut in half, the closing quote and brace left out);
    None when the text is not a response."""
    m = _RESPONSE_HEAD.match(text)
    if not m:
        return None
    body = text[m.end():]
    for end in range(len(body), max(len(body) - 12, -1), -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return None


def _cut_response(text: str) -> str:
    """The generic format's {"response": "..."} cut short (max_tokens): the reply's text so far;
    any other text as it is."""
    reply = _partial_response(text)
    return text if reply is None else reply


class ToolStream:
    """One choice's answer under a tool plan, as a stream sends it: the content the model writes
    goes out as it comes wherever it cannot still turn into a call (before a `<tool_call>` or
    `[TOOL_CALLS]`, an answer that does not open with Llama 3's JSON, the generic format's
    `{"response": "...`); the rest is held until the end, when the whole text is read
    (`tool_answer`) and what is left of the content, the calls and the finish reason go out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", ""
        self.replies = plan.schema is not None and plan.request.choice == "auto"   # {"response"} is possible

    def _visible(self) -> str:
        if self.plan.schema is None:
            return self.plan.format.visible(self.text)
        return (_partial_response(self.text) or "") if self.replies else ""

    def push(self, piece: str) -> str:
        """Add a piece of generated text; the content that may go out now ("" when none)."""
        self.text += piece
        visible = self._visible()
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        new, self.sent = visible[len(self.sent):], visible
        return new

    def finish(self, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """The end: (the content not sent yet, or None; the tool calls; the finish reason)."""
        content, calls, finish = tool_answer(self.plan, self.text, finish_reason)
        rest = content[len(self.sent):] if content and content.startswith(self.sent) else ""
        return rest or None, calls, finish


def _reply_body(text: str) -> tuple[int, int | None] | None:
    """Where the generic format's {"response": "..."} string lies in `text`: (the offset after its
    opening quote, the offset of its closing quote or None while it is open); None when `text`
    is not a response."""
    m = _RESPONSE_HEAD.match(text)
    if not m:
        return None
    i = m.end()
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return m.end(), i
        else:
            i += 1
    return m.end(), None


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _decoded_units(text: str, start: int, end: int) -> list[tuple[int, str]]:
    """The JSON string body text[start:end] as (offset just past a unit, the text it decodes to):
    a character, or a whole escape (a surrogate pair of \\u escapes is one unit). An escape
    not whole by `end` (a stream's text so far) ends the list."""
    units, i = [], start
    while i < end:
        if text[i] != "\\":
            units.append((i + 1, text[i]))
            i += 1
            continue
        if i + 1 >= end:
            break
        if text[i + 1] != "u":
            units.append((i + 2, _ESCAPES.get(text[i + 1], text[i + 1])))
            i += 2
            continue
        if i + 6 > end:
            break
        code = int(text[i + 2:i + 6], 16)
        if 0xD800 <= code < 0xDC00:                  # a high surrogate: the pair is one character
            if i + 12 > end:
                break
            if text[i + 6:i + 8] == "\\u" and 0xDC00 <= int(text[i + 8:i + 12], 16) < 0xE000:
                low = int(text[i + 8:i + 12], 16)
                units.append((i + 12, chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))))
                i += 12
                continue
        units.append((i + 6, chr(code)))
        i += 6
    return units


class ReplyTokens:
    """Which generated tokens a chat answer's logprobs list, and the text each adds, under a
    generic-format plan that may reply (`tool_choice` auto). For a {"response": "..."} reply:
    the tokens that overlap its JSON string, each with the content it adds (the decoded
    characters and escapes that end inside it: a token of the wrapper left out, one straddling
    a quote trimmed, one holding half an escape ""), so their texts spell the returned content;
    for tool calls, every token as it is. A stream `take`s the new ones as its content goes
    out; a whole answer takes them all at once: both list the same entries."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: list[tuple[int, int, Any]] = []      # (start, end, token entry) in the text
        self.n_sent = 0

    def add(self, tokens: Sequence[Any]) -> None:
        """Generated token entries (each with the `.text` it adds, `.logprob`, `.top_logprobs`)."""
        for t in tokens:
            start = len(self.text)
            self.text += t.text
            self.spans.append((start, len(self.text), t))

    def take(self, final: bool = False) -> list:
        """The token entries to list now that were not listed yet: the reply's tokens so far
        (their text the content each adds); at the end (`final`) of an answer that is no reply,
        every token."""
        body = _reply_body(self.text)
        if body is None:
            kept = [t for _, _, t in self.spans] if final else []
        else:
            start, end = body[0], len(self.text) if body[1] is None else body[1]
            units = _decoded_units(self.text, start, end)
            kept = [_with_text(t, "".join(u for at, u in units if s < at <= e))
                    for s, e, t in self.spans if e > start and s < end]
            if body[1] is None and not final:
                kept = kept[:-1] if kept and self.spans[-1][1] > (units[-1][0] if units else start) else kept
        new, self.n_sent = kept[self.n_sent:], max(self.n_sent, len(kept))
        return new


def _with_text(token: Any, text: str) -> Any:
    return SimpleNamespace(text=text, logprob=token.logprob, top_logprobs=token.top_logprobs)


def tool_answer(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """The assistant's (content, tool calls, finish_reason) from the generated `text`: calls
    that all name a callable tool with valid arguments are the answer's tool_calls (finish_reason
    "tool_calls"; content whatever the model wrote beside them, None if nothing; exact repeats
    dropped); anything else is `text` as plain content, with the generation's own finish_reason
    (a `required` answer cut short by max_tokens too). Without parallel tool calls only the first
    call is kept."""
    if finish_reason not in ("stop", None):            # cut short (length, abort): what it wrote, unread
        return (_cut_response(text) if plan.schema is not None else text), [], finish_reason
    parsed = plan.parse(text)
    if parsed is None or not parsed.calls:
        return (text if parsed is None or plan.schema is None else parsed.content or ""), [], finish_reason
    calls = [_valid(plan.request, n, a) for n, a in parsed.calls]
    if None in calls:
        return text, [], finish_reason
    if not plan.request.parallel:
        calls = calls[:1]
    return parsed.content, _distinct(calls), "tool_calls"


def _distinct(calls: list[dict]) -> list[dict]:
    """The calls without exact repeats (same function, same arguments): a small model loops on a
    call it just wrote; a repeat would only run the same function again."""
    seen, out = set(), []
    for c in calls:
        key = (c["function"]["name"], c["function"]["arguments"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out
