"""Tool calling (OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`), written once for the
server's /v1/chat/completions and `LLM.create_chat_completion`.

- the request: `tool_request` checks the fields where they enter (a FieldError naming
  `tools[i].function.parameters`, `tool_choice`, ...) and gives a `ToolRequest`;
- the plan (`plan_tools`): for the chat template's tool syntax (`metatp.tool_formats`), the
  tools in the prompt (`render_messages`: through the template when it takes `tools`, else in the
  system prompt, llama-server's generic format) and the output's constraint. `required` and a
  named function, and `auto` in the generic format, constrain the output to a JSON schema of tool
  calls through the structured-output engine (as vLLM does for those choices), so those answers
  always parse; they are read by the generic parser whatever the format;
- the answer is read by `metatp.tool_answers` (`tool_answer`, `ToolStream` for a stream): the
  format's parser reads the text, and every call is checked (a callable tool, arguments that
  validate against its JSON schema) before it reaches the client as a tool call; otherwise the
  text is plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from metatp.request_fields import API, HTTP, MAX_CONSTRAINT_BYTES, FieldError, Where, short, type_name
from metatp.tool_formats import ParsedCalls, ToolFormat, parse_generic

__all__ = ["Tool", "ToolRequest", "ToolPlan", "tool_request", "plan_tools", "calls_schema", "closed",
           "constrain", "render_messages", "call_arguments", "jsonschema_module"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")            # OpenAI's rule for a function's name
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict

    def openai(self) -> dict:
        """As OpenAI's request spells it (what a chat template that takes `tools` is given)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool fields. `choice`: "auto", "required" or "named" (then `forced` is
    the function's name); `parallel`: may the answer hold several calls."""

    tools: tuple[Tool, ...]
    choice: str
    forced: str | None = None
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools the answer may call: the named one, or all."""
        return tuple(t for t in self.tools if self.forced in (None, t.name))


# ---------------------------------------------------------------- the request's fields
def _say(where: Where, name: str) -> str:
    return f"'{name}'" if where == HTTP else name


def jsonschema_module() -> Any:
    """The jsonschema package (tools' schemas and arguments are checked with it), or a
    ConfigError saying how to install it."""
    try:
        import jsonschema
    except ImportError:
        from metatp.ir.errors import ConfigError

        raise ConfigError("tools: tool calling checks the arguments with jsonschema: pip install "
                          "'metatp[structured]'") from None
    return jsonschema


def _schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a JSON schema (its metaschema's verdict, within the size and depth
    budgets of any output constraint), None when it is one."""
    jsonschema = jsonschema_module()
    from metatp.request_fields import constraint_text

    if not isinstance(schema, dict):
        return f"must be a JSON schema (an object), got {type_name(schema)}"
    try:
        constraint_text("json_schema", schema)
    except FieldError as e:
        return str(e).removeprefix("json_schema").lstrip(": ")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"is not a valid JSON schema{f' at {where}' if where else ''}: {e.message[:200]}"
    if schema.get("type", "object") != "object":
        return f"must describe an object (the call's keyword arguments), got type {short(schema.get('type'))}"
    return None


def _tool(i: int, t: Any, where: Where) -> Tool:
    at = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise FieldError("tools", f"{_say(where, at)} must be {{'type': 'function', 'function': {{...}}}}, got "
                                  f"{short(t)}")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise FieldError("tools", f"{_say(where, at + '.function')} must be an object {{name, description, "
                                  f"parameters}}, got {short(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError(f"{at}.function.name", f"{_say(where, at + '.function.name')} must be 1 to 64 letters, "
                                                f"digits, '_' or '-', got {short(name)}")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise FieldError(f"{at}.function.description", f"{_say(where, at + '.function.description')} must be a "
                                                       f"string, got {short(desc)}")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    problem = _schema_problem(params)
    if problem:
        field_name = f"{at}.function.parameters"
        raise FieldError(field_name, f"{_say(where, field_name)} {problem}")
    return Tool(name, desc, params)


def tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None,
                 where: Where = API) -> ToolRequest | None:
    """The checked `tools`, `tool_choice` and `parallel_tool_calls` of a request; None when the
    answer calls no tool (no tools, or tool_choice "none"). A tool_choice that needs tools where
    there are none, or names one that is not among them, is a FieldError naming tool_choice."""
    from metatp.request_fields import PARALLEL_TOOL_CALLS

    parallel = True if parallel_tool_calls is None else PARALLEL_TOOL_CALLS.check(parallel_tool_calls, where)
    if tools is None:
        tools = []
    if not isinstance(tools, (list, tuple)):
        raise FieldError("tools", f"{_say(where, 'tools')} must be a list of tools, got {type_name(tools)} "
                                  f"{short(tools)}")
    checked = tuple(_tool(i, t, where) for i, t in enumerate(tools))
    size = sum(len(json.dumps(t.openai(), ensure_ascii=False).encode("utf-8", "surrogatepass")) for t in checked)
    if size > MAX_CONSTRAINT_BYTES:           # they all go into the prompt (or one constraint): far past any context
        raise FieldError("tools", f"{_say(where, 'tools')} are {size} bytes of JSON together, over the limit of "
                                  f"{MAX_CONSTRAINT_BYTES} bytes")
    names = [t.name for t in checked]
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            raise FieldError(f"tools[{i}].function.name", f"{_say(where, f'tools[{i}].function.name')}: two tools "
                                                          f"are named {n!r}")
        seen.add(n)
    choice, forced = _choice(tool_choice, names, where)
    if choice == "none" or (not checked and choice == "auto"):
        return None
    return ToolRequest(checked, choice, forced, parallel)


def _choice(v: Any, names: list[str], where: Where) -> tuple[str, str | None]:
    """tool_choice as ("auto" | "none" | "required" | "named", the named function)."""
    say = _say(where, "tool_choice")
    if v is None:
        return "auto", None
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise FieldError("tool_choice", f"{say} must be 'auto', 'none', 'required' or {{'type': 'function', "
                                            f"'function': {{'name': ...}}}}, got {short(v)}")
        if v == "required" and not names:
            raise FieldError("tool_choice", f"{say} is 'required' but the request has no tools")
        return v, None
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise FieldError("tool_choice", f"{say} must be 'auto', 'none', 'required' or {{'type': 'function', "
                                        f"'function': {{'name': ...}}}}, got {short(v)}")
    if name not in names:
        have = ", ".join(repr(n) for n in names) or "none"
        raise FieldError("tool_choice", f"{say} names the function {name!r}, which is not among the tools ({have})")
    return "named", name


# ---------------------------------------------------------------- the plan: prompt, constraint, parser
@dataclass(frozen=True)
class ToolPlan:
    """What tool calling does to one request: its tools in the prompt, the JSON schema its output
    is constrained to (None: free text, read by the format's parser) and the parser."""

    request: ToolRequest
    format: ToolFormat
    schema: dict | None

    @property
    def parse(self) -> Callable[[str], ParsedCalls | None]:
        return parse_generic if self.schema is not None else self.format.parse


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref")     # an object made of other schemas: its keys are theirs too


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed (additionalProperties
    false), for generating: llama.cpp's grammars do the same (a small model given an open object
    keeps inventing keys). Objects composed with allOf / anyOf / oneOf / $ref are left open (their
    keys come from the parts). The answer is still validated against the client's own schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(s) for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(s) for name, s in out[k].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = closed(out["items"])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out \
            and "patternProperties" not in out and not any(k in out for k in _COMPOSED):
        out["additionalProperties"] = False
    return out


def _moved_refs(schema: Any, prefix: str) -> Any:
    """`schema` with its local references ("#/$defs/X", "#") pointing under `prefix` (a JSON
    pointer), where it is moved to in a bigger schema."""
    if isinstance(schema, list):
        return [_moved_refs(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved_refs(v, prefix))
            for k, v in schema.items()}


def _arguments_defs(tools: tuple[Tool, ...]) -> dict:
    """Each tool's arguments schema (closed) as a definition of the combined schema, named
    "tool_<name>", its own references ($defs of a pydantic model) moved with it."""
    return {f"tool_{t.name}": _moved_refs(closed(t.parameters), f"#/$defs/tool_{t.name}") for t in tools}


def _call_schema(t: Tool) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool_{t.name}"}}}


MAX_PARALLEL_CALLS = 4     # calls one constrained answer may hold (a small model may repeat a call until cut)


def calls_schema(req: ToolRequest) -> dict:
    """The JSON schema of the generic format's tool calls: {"tool_calls": [call, ...]}, each call
    one of the callable tools with its own arguments' schema; exactly one for a named function
    (OpenAI's forced call) or without parallel calls, else at most MAX_PARALLEL_CALLS."""
    calls = [_call_schema(t) for t in req.callable_tools]
    items: dict = calls[0] if len(calls) == 1 else {"anyOf": calls}
    most = 1 if req.forced is not None or not req.parallel else MAX_PARALLEL_CALLS
    array = {"type": "array", "items": items, "minItems": 1, "maxItems": most}
    return {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
            "properties": {"tool_calls": array}, "$defs": _arguments_defs(req.callable_tools)}


RESPONSE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["response"],
                   "properties": {"response": {"type": "string"}}}


def plan_tools(req: ToolRequest | None, fmt: ToolFormat) -> ToolPlan | None:
    """The plan for `req` on a model whose template has format `fmt`: required and named calls
    are constrained to the tool-calls schema (any format); auto in the generic format to tool
    calls or a response; auto in a native format is free text, parsed."""
    if req is None:
        return None
    if req.choice in ("required", "named"):
        return ToolPlan(req, fmt, calls_schema(req))
    if not fmt.native:
        calls = calls_schema(req)
        defs = calls.pop("$defs")                 # references resolve from the root
        return ToolPlan(req, fmt, {"anyOf": [calls, RESPONSE_SCHEMA], "$defs": defs})
    return ToolPlan(req, fmt, None)


def constrain(params: Any, plan: ToolPlan | None) -> Any:
    """`params` (SamplingParams) with the plan's output schema, compiled now; a schema the
    structured-output engine refuses is a FieldError naming tools. Another constraint on the same
    request is refused by the caller (it names the field the request set)."""
    import dataclasses

    from metatp.ir.errors import ConfigError

    if plan is None or plan.schema is None:
        return params
    if params.constraint is not None:
        raise FieldError("tools", f"tool_choice {plan.request.choice!r} constrains the output to tool calls; "
                                  "it cannot be combined with another output constraint (response_format, guided_*)")
    try:
        return dataclasses.replace(params, json_schema=plan.schema)
    except ConfigError as e:
        raise FieldError("tools", f"tools: the structured-output engine refuses these tools' schemas: {e}") from None


# ---------------------------------------------------------------- the prompt
def call_arguments(v: Any) -> Any:
    """A history call's arguments as data (OpenAI sends a JSON string; templates want a dict)."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except (ValueError, RecursionError):
            return v
    return v


def _history_calls(m: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": call_arguments(c["function"].get("arguments"))}
            for c in m.get("tool_calls") or []]


def _generic_instructions(plan: ToolPlan | None) -> str | None:
    if plan is None:
        return None
    req = plan.request
    tools = json.dumps([t.openai()["function"] for t in req.callable_tools], ensure_ascii=False)
    call_form = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if req.choice in ("required", "named"):
        answer = f"Respond in JSON with the tool calls to make: {call_form}"
    else:
        answer = (f"Respond in JSON, either with the tool calls to make: {call_form}, or with your reply to the "
                  'user: {"response": "<your reply>"}')
    return f"You can call these tools (each with a JSON schema of its arguments):\n{tools}\n{answer}"


def render_messages(messages: list[dict], plan: ToolPlan | None, fmt: ToolFormat,
                    tool_role: bool = True) -> tuple[list[dict], dict]:
    """Normalised chat messages and template keywords for a request with `plan` (None: no tools)
    on a template of format `fmt`. Native: the tools go to the template (`tools=`), history
    calls' arguments as data. Generic: the tools and the answer form join the system prompt,
    history calls become the JSON the model is asked to write, and tool results are `tool`
    messages (or, where the template drops that role: `tool_role` False, user messages holding
    {"tool_response": ...})."""
    if fmt.native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": call_arguments(c["function"].get("arguments"))}}
                    for c in m["tool_calls"]]}
            out.append(m)
        return out, ({"tools": [t.openai() for t in plan.request.tools]} if plan else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = {"role": "assistant", "content": json.dumps({"tool_calls": _history_calls(m)}, ensure_ascii=False)}
        elif m["role"] == "tool" and not tool_role:
            reply = {k: m[k] for k in ("tool_call_id", "name") if m.get(k)}
            m = {"role": "user", "content": json.dumps({"tool_response": {**reply, "content": m["content"]}},
                                                       ensure_ascii=False)}
        out.append(m)
    note = _generic_instructions(plan)
    if note:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, {}
