"""metatp.tool_calls and metatp.tool_formats without a model: each format's parser on hand-written model texts, the
request fields' checks (the FieldError names the field), format detection from chat templates,
the constraint schemas, the answer's validation (a call whose arguments do not validate never
becomes a tool call), the prompt rendering of tools and tool messages, and the streamed answer's
chunk shape (its deltas reassemble to the whole answer's calls)."""

from __future__ import annotations

import json

import pytest

from metatp.output_processor import StepOutput
from metatp.request_fields import HTTP, FieldError
from metatp.tool_answers import tool_answer
from metatp.tool_calls import calls_schema, closed, plan_tools, render_messages, tool_request
from metatp.tool_formats import (FORMATS, ParsedCalls, detect_format, format_named, parse_generic, parse_hermes,
                                 parse_llama3_json, parse_mistral)
from support.require import requires

pytestmark = requires("structured")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]


# ---------------------------------------------------------------- the parsers, on hand-written texts
def test_hermes_reads_each_tool_call_block_and_the_content_before_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert parse_hermes(text) == ParsedCalls("Let me look.\n", [("get_weather", {"city": "Paris"}),
                                                               ("get_time", {"city": "Rome"})])
    assert parse_hermes("no calls here") == ParsedCalls("no calls here", [])
    assert parse_hermes('<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}') == \
        ParsedCalls(None, [("get_time", {"city": "Oslo"})])              # the end of the text closes the last block
    assert parse_hermes("<tool_call>{not json}</tool_call>") is None       # tool syntax that does not parse


def test_llama3_json_reads_name_and_parameters_with_or_without_the_python_tag():
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_llama3_json(call) == ParsedCalls(None, [("get_weather", {"city": "Paris"})])
    assert parse_llama3_json("<|python_tag|>" + call + "; " + call.replace("Paris", "Lima")).calls == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lima"})]
    assert parse_llama3_json("The weather is fine.") == ParsedCalls("The weather is fine.", [])
    assert parse_llama3_json('{"answer": 42}') == ParsedCalls('{"answer": 42}', [])    # JSON, but not a call
    assert parse_llama3_json("<|python_tag|>{broken") is None


def test_mistral_reads_the_array_and_the_newer_name_args_form():
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
           '{"name": "get_time", "arguments": {"city": "Paris"}}]'
    assert parse_mistral(text) == ParsedCalls("Sure. ", [("get_weather", {"city": "Paris"}),
                                                        ("get_time", {"city": "Paris"})])
    assert parse_mistral('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}'
                         ).calls == [("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Oslo"})]
    assert parse_mistral("plain answer") == ParsedCalls("plain answer", [])
    assert parse_mistral("[TOOL_CALLS][{oops") is None


def test_generic_reads_tool_calls_a_single_tool_call_or_a_response():
    assert parse_generic('{"tool_calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}').calls == \
        [("get_time", {"city": "Oslo"})]
    assert parse_generic('{"tool_call": {"name": "get_time", "arguments": {}}}').calls == [("get_time", {})]
    assert parse_generic('{"response": "Hello!"}') == ParsedCalls("Hello!", [])
    assert parse_generic("Hello there") == ParsedCalls("Hello there", [])
    assert parse_generic('{"tool_calls": [{"arguments": {}}]}') is None       # a call without a name


# ---------------------------------------------------------------- the answer: only valid calls reach the client
def _plan(choice="auto", fmt="hermes", parallel=None, tools=TOOLS):
    return plan_tools(tool_request(tools, choice, parallel), FORMATS[fmt])


def test_valid_calls_become_openai_tool_calls():
    content, calls, finish = tool_answer(_plan(), '<tool_call>{"name": "get_weather", "arguments": '
                                                  '{"city": "Paris", "unit": "c"}}</tool_call>', "stop")
    assert (content, finish) == (None, "tool_calls") and len(calls) == 1
    c = calls[0]
    assert c["id"].startswith("call_") and c["type"] == "function"
    assert c["function"]["name"] == "get_weather"
    assert json.loads(c["function"]["arguments"]) == {"city": "Paris", "unit": "c"}   # a JSON string, as OpenAI's


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"unit": "c"}}</tool_call>',                 # required city missing
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}</tool_call>',  # not in enum
    '<tool_call>{"name": "get_weather", "arguments": {"city": 7}}</tool_call>',                   # wrong type
    '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',                              # no such tool
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>',                        # one bad of two
])
def test_invalid_calls_never_reach_the_client_the_text_is_plain_content(text):
    assert tool_answer(_plan(), text, "stop") == (text, [], "stop")


def test_a_backtracking_pattern_is_judged_within_its_budget():
    """A client's `pattern` that backtracks exponentially ((a+)+$ on 40 a's and a '!' is 2^40 steps
    for Python's re, which cannot be stopped) is cut off and the call refused, in well under a second."""
    import time

    evil = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}}}
    keyed = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}}}}
    plan = plan_tools(tool_request([evil, keyed]), FORMATS["hermes"])
    t = time.perf_counter()
    bad = '<tool_call>{"name": "f", "arguments": {"s": "' + "a" * 40 + '!"}}</tool_call>'
    assert tool_answer(plan, bad, "stop") == (bad, [], "stop")
    assert time.perf_counter() - t < 2
    good = '<tool_call>{"name": "f", "arguments": {"s": "aaaa"}}</tool_call>'
    assert tool_answer(plan, good, "stop")[2] == "tool_calls"
    typed = '<tool_call>{"name": "g", "arguments": {"aaa": "not an integer"}}</tool_call>'
    assert tool_answer(plan, typed, "stop") == (typed, [], "stop")              # patternProperties still apply
    assert tool_answer(plan, typed.replace('"not an integer"', "3"), "stop")[2] == "tool_calls"


def test_a_named_choice_only_accepts_the_named_function():
    plan = _plan({"type": "function", "function": {"name": "get_time"}}, fmt="generic")
    ok = '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}'
    other = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert tool_answer(plan, ok, "stop")[2] == "tool_calls"
    assert tool_answer(plan, other, "stop") == (other, [], "stop")


def test_without_parallel_calls_one_call_is_kept_and_repeats_are_dropped():
    text = ('<tool_call>{"name": "get_time", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"city": "B"}}</tool_call>')
    assert [json.loads(c["function"]["arguments"])["city"] for c in tool_answer(_plan(), text, "stop")[1]] == ["A", "B"]
    assert len(tool_answer(_plan(parallel=False), text, "stop")[1]) == 1
    twice = text.replace('"B"', '"A"')
    assert len(tool_answer(_plan(), twice, "stop")[1]) == 1


def test_an_answer_cut_short_is_content_and_the_generic_response_is_unwrapped():
    plan = _plan(fmt="generic")
    assert tool_answer(plan, '{"response": "Hello', "length") == ("Hello", [], "length")
    assert tool_answer(plan, '{"response": "Hi"}', "stop") == ("Hi", [], "stop")
    cut = '{"tool_calls": [{"name": "get_time", "argu'
    assert tool_answer(_plan("required", fmt="generic"), cut, "length") == (cut, [], "length")


# ---------------------------------------------------------------- the request's fields
@pytest.mark.parametrize("tools, choice, field, words", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}}],
     None, "tools[0].function.parameters", "not a valid JSON schema"),
    ([WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"type": "strnig"}}}],
     None, "tools[1].function.parameters", "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters", "must describe an object"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name", "letters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name", "two tools"),
    ([{"type": "retrieval"}], None, "tools", "'type': 'function'"),
    ("get_weather", None, "tools", "must be a list"),
    (TOOLS, {"type": "function", "function": {"name": "send_email"}}, "tool_choice", "send_email"),
    (TOOLS, "sometimes", "tool_choice", "'auto', 'none', 'required'"),
    (None, "required", "tool_choice", "no tools"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice", "not among the tools"),
])
def test_bad_tool_fields_are_field_errors_naming_the_field(tools, choice, field, words):
    with pytest.raises(FieldError) as e:
        tool_request(tools, choice, None, HTTP)
    assert e.value.field == field and words in str(e.value), str(e.value)
    assert field.split(".")[0].split("[")[0] in str(e.value)


def test_tools_together_are_bounded_in_size():
    many = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 1000}} for i in range(300)]
    with pytest.raises(FieldError, match="over the limit") as e:
        tool_request(many, "auto", None, HTTP)
    assert e.value.field == "tools"
    assert len(tool_request(many[:100]).tools) == 100


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(FieldError) as e:
        tool_request(TOOLS, "auto", "yes", HTTP)
    assert e.value.field == "parallel_tool_calls"
    assert tool_request(TOOLS, "auto", False).parallel is False


def test_no_tools_or_choice_none_means_no_tool_calling():
    assert tool_request(None) is None and tool_request([], "auto") is None and tool_request(TOOLS, "none") is None
    r = tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert (r.choice, r.forced, [t.name for t in r.callable_tools]) == ("named", "get_time", ["get_time"])


# ---------------------------------------------------------------- formats and the constraint
@pytest.mark.parametrize("template, name", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", "hermes"),          # Qwen 2.5 / Hermes
    ("{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>system<|end_header_id|>{% if tools %}{{ tools | tojson }}{% endif %}", "llama3_json"),
    ("<|python_tag|>", "llama3_json"),
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}", "generic"),           # SmolLM2: no syntax
    (None, "generic"),
])
def test_the_format_is_detected_from_the_chat_template(template, name):
    assert detect_format(template).name == name


def test_the_parser_flag_names_a_format_or_an_alias():
    assert format_named("qwen").name == "hermes" and format_named("llama3_json").name == "llama3_json"
    with pytest.raises(Exception, match="--tool-call-parser"):
        format_named("pythonic")


def test_the_constraint_schemas_per_choice():
    import jsonschema

    assert _plan("auto", "hermes").schema is None                         # native auto: free text, parsed
    auto = _plan("auto", "generic").schema
    jsonschema.validate({"response": "hi"}, auto)
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"city": "x"}}]}, auto)
    req = _plan("required", "hermes").schema                               # required: constrained in any format
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hi"}, req)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"city": "x", "extra": 1}}]}, req)
    one = calls_schema(tool_request(TOOLS, "required", False))
    two = {"tool_calls": [{"name": "get_time", "arguments": {"city": "x"}}] * 2}
    jsonschema.validate(two, req)
    with pytest.raises(jsonschema.ValidationError):                        # not parallel: exactly one call
        jsonschema.validate(two, one)


def test_closed_closes_objects_that_do_not_say_otherwise():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                          "b": {"type": "array", "items": {"properties": {"c": {}}}},
                                          "d": {"type": "object", "additionalProperties": True}}}
    c = closed(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["b"]["items"]["additionalProperties"] is False
    assert c["properties"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in s                                  # the client's schema is left as it was


# ---------------------------------------------------------------- the prompt
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"}]


def test_generic_rendering_puts_tools_in_the_system_prompt_and_history_calls_as_json():
    plan = _plan("auto", "generic")
    msgs, extra = render_messages(HISTORY, plan, FORMATS["generic"])
    assert extra == {} and msgs[0]["role"] == "system"
    assert "get_weather" in msgs[0]["content"] and '"response"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert msgs[3] == HISTORY[2]
    msgs, _ = render_messages([{"role": "system", "content": "Be brief."}, *HISTORY], plan, FORMATS["generic"],
                              tool_role=False)
    assert msgs[0]["content"].startswith("Be brief.\n\nYou can call these tools") and len(msgs) == 4
    assert msgs[3]["role"] == "user"
    assert json.loads(msgs[3]["content"])["tool_response"]["content"] == "18 C, sunny"


def test_native_rendering_gives_the_template_tools_and_arguments_as_data():
    plan = _plan("auto", "hermes")
    msgs, extra = render_messages(HISTORY, plan, FORMATS["hermes"])
    assert extra["tools"] == TOOLS
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'     # not changed in place


# ---------------------------------------------------------------- the answer's shape, whole and streamed
def _outputs(text: str, finish: str = "stop") -> list[StepOutput]:
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    return [StepOutput(k, p, finish if k == len(pieces) - 1 else None) for k, p in enumerate(pieces)]


def _reassemble(chunks: list[dict]) -> tuple[str, dict[int, dict], str | None]:
    """The content, tool calls and finish reason a client's accumulator makes of the chunks."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            for t in d.get("tool_calls") or []:
                slot = calls.setdefault(t["index"], {"id": None, "name": "", "arguments": ""})
                if "id" in t:
                    assert slot["id"] is None and t["type"] == "function" and "name" in t["function"]
                    slot["id"] = t["id"]
                slot["name"] += t["function"].get("name", "")
                slot["arguments"] += t["function"].get("arguments", "")
            finish = c["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("fmt, text, expect_calls", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>', 2),
    ("hermes", 'Checking both. <tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>', 1),
    ("hermes", "It is sunny.", 0),
    ("hermes", 'Almost <tool_call>{"name": "get_time", "arguments": {"city": 5}}</tool_call>', 0),    # invalid
    ("llama3_json", '{"name": "get_time", "parameters": {"city": "Oslo"}}', 1),
    ("mistral", 'On it.[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Oslo"}}]', 1),
    ("generic", '{"response": "Fine, \\"thanks\\" \\u00e9t\\u00e9!"}', 0),
    ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}', 1),
])
def test_streamed_tool_calls_reassemble_to_the_whole_answers(fmt, text, expect_calls):
    from metatp.openai_answers import ChatAnswer

    plan = _plan(fmt=fmt)
    whole = ChatAnswer("m", [1, 2], 1, str, tools=plan).whole([_outputs(text)])["choices"][0]
    answer = ChatAnswer("m", [1, 2], 1, str, tools=plan)
    chunks = answer.head() + [c for o in _outputs(text) for c in answer.chunks(0, o)]
    content, calls, finish = _reassemble(chunks)
    assert finish == whole["finish_reason"] == ("tool_calls" if expect_calls else "stop")
    assert chunks[-1]["choices"][0]["finish_reason"] == finish and chunks[-1]["choices"][0]["delta"] == {}
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"].get("tool_calls", [])]
    assert got == want and len(got) == expect_calls
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert (content or None) == whole["message"]["content"]
    assert ("tool_calls" in whole["message"]) == bool(expect_calls)


@pytest.mark.parametrize("fmt, text, early", [
    ("hermes", "It is sunny in Paris today, with a light breeze.", "It is sunny in Paris today"),
    ("hermes", 'Let me check that for you. <tool_call>{"name": "get_time", "arguments": {"city": "A"}}</tool_call>',
     "Let me check that for you"),
    ("generic", '{"response": "It is sunny in Paris today, with a light breeze."}', "It is sunny in Paris today"),
    ("llama3_json", "It is sunny in Paris today, with a light breeze.", "It is sunny in Paris today"),
])
def test_content_that_cannot_become_a_call_streams_as_it_comes(fmt, text, early):
    """Content goes out before the answer ends where it cannot turn into a call."""
    from metatp.openai_answers import ChatAnswer

    answer = ChatAnswer("m", [1], 1, str, tools=_plan(fmt=fmt))
    outs = _outputs(text)
    before_end = "".join(c["choices"][0]["delta"].get("content") or ""
                         for o in outs[:-1] for c in answer.chunks(0, o))
    assert before_end.startswith(early), before_end


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "I will call <tool_ca"), ("llama3_json", '  {"name": "get_ti'), ("llama3_json", "<|python_"),
    ("generic", '{"tool_calls": [{"name": "get_ti'), ("mistral", "[TOOL_CA"),
])
def test_what_may_still_become_a_call_is_held_back(fmt, text):
    from metatp.tool_answers import ToolStream

    s = ToolStream(_plan(fmt=fmt))
    sent = "".join(s.push(text[i:i + 3]) for i in range(0, len(text), 3))
    assert not any(m in sent for m in ("<tool", "{", "<|", "[TOOL")), sent


def test_a_pydantic_models_refs_resolve_in_the_combined_schema_and_it_compiles():
    """Nested models come as $defs + $ref (pydantic, instructor, langchain); inside the combined
    schema they must still resolve, and the structured-output engine must take it."""
    import jsonschema
    from pydantic import BaseModel

    from metatp.sampling import SamplingParams
    from metatp.tool_calls import constrain

    class Address(BaseModel):
        city: str
        zip: int

    class Person(BaseModel):
        name: str
        home: Address
        friends: list["Person"] = []

    tool = {"type": "function", "function": {"name": "save_person", "parameters": Person.model_json_schema()}}
    assert "$defs" in tool["function"]["parameters"]
    good = {"name": "Ann", "home": {"city": "Oslo", "zip": 150},
            "friends": [{"name": "Bo", "home": {"city": "Rome", "zip": 1}}]}
    bad = {"name": "Ann", "home": {"city": "Oslo", "zip": "x"}}
    for choice, fmt in (("required", "hermes"), ("auto", "generic")):
        plan = plan_tools(tool_request([tool, TIME], choice), FORMATS[fmt])
        jsonschema.validate({"tool_calls": [{"name": "save_person", "arguments": good}]}, plan.schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"tool_calls": [{"name": "save_person", "arguments": bad}]}, plan.schema)
        assert constrain(SamplingParams(max_tokens=8), plan).constraint is not None
