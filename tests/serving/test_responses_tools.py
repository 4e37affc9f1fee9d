"""Function tools through /v1/responses (metatp.responses_api on metatp.tool_calls) with the
official `openai` client on the real app in-process: `required` and named calls (constrained: they
always parse, even on a random synthetic model) as function_call output items whose arguments
validate; a round trip with function_call / function_call_output input items, which reach the
prompt exactly as the chat route's assistant tool_calls and `tool` messages do; the streamed
events (the function_call item added, its arguments' deltas joining to .done's, the item done);
the 400s naming the field; and, on the default model, one real call."""

from __future__ import annotations

import json

import pytest

from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import optional_import

openai = optional_import("openai")
jsonschema = optional_import("jsonschema")
pytestmark = [requires("serve"), requires("structured")]

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=49, chat_template=TEMPLATE,
                 n_ctx_train=1024)
KEY = "sk-responses-tools"
AUTH = {"Authorization": f"Bearer {KEY}"}

# every value bounded, so a constrained call on a random model ends within a few tokens
FORECAST = {"type": "function", "name": "forecast", "description": "The forecast", "strict": True, "parameters": {
    "type": "object", "required": ["unit", "days"],
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
ALARM = {"type": "function", "name": "alarm", "parameters": {
    "type": "object", "required": ["on"], "properties": {"on": {"type": "boolean"}}}}
SCHEMAS = {"forecast": FORECAST["parameters"], "alarm": ALARM["parameters"]}
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _app_client(llm):
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    return testclient.TestClient(create_app(llm, model_name="m", api_key=KEY, max_model_len=llm.n_ctx))


def _openai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def resptools_http(path):
    """The app on the synthetic model (its template has no tool syntax: the generic format)."""
    with _app_client(LLM(path, backend="numpy", n_ctx=1024)) as http:
        yield http


@pytest.fixture(scope="module")
def resptools_client(resptools_http):
    return _openai(resptools_http)


def _function_calls(resp) -> list:
    return [item for item in resp.output if item.type == "function_call"]


def _check_call(item) -> dict:
    """A function_call item's shape (ids, status) and its arguments, validated against its tool's schema."""
    assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.status == "completed", item
    args = json.loads(item.arguments)
    jsonschema.validate(args, SCHEMAS[item.name])
    return args


# ---------------------------------------------------------------- synthetic model: constrained calls
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "alarm"}])
def test_required_and_named_calls_are_function_call_items_that_validate(resptools_client, choice):
    for seed in range(3):
        resp = resptools_client.responses.create(model="m", input="forecast please", tools=[FORECAST, ALARM],
                                                 tool_choice=choice, max_output_tokens=240, temperature=1.0,
                                                 extra_body={"seed": seed})
        calls = _function_calls(resp)
        assert resp.status == "completed" and calls, resp.output
        assert [item.type for item in resp.output] == ["function_call"] * len(calls)    # no text: no message item
        for item in calls:
            _check_call(item)
        if isinstance(choice, dict):
            assert [item.name for item in calls] == ["alarm"]                  # a named function: one call, that one
        assert resp.output_text == ""
    assert resp.tool_choice == choice if isinstance(choice, str) else resp.tool_choice.name == "alarm"
    assert [t.name for t in resp.tools] == ["forecast", "alarm"] and resp.tools[0].strict is True


def test_without_parallel_calls_there_is_one_call(resptools_client):
    for seed in range(3):
        resp = resptools_client.responses.create(model="m", input="forecast please", tools=[FORECAST, ALARM],
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_output_tokens=240, temperature=1.0, extra_body={"seed": seed})
        assert len(_function_calls(resp)) == 1 and resp.parallel_tool_calls is False


def test_tool_choice_none_answers_a_plain_message(resptools_client):
    resp = resptools_client.responses.create(model="m", input="forecast please", tools=[FORECAST],
                                             tool_choice="none", max_output_tokens=4, temperature=0)
    assert [item.type for item in resp.output] == ["message"] and resp.output_text


ROUND_TRIP = [{"role": "user", "content": "forecast please"},
              {"type": "function_call", "call_id": "call_1", "name": "forecast",
               "arguments": '{"unit": "c", "days": 2}'},
              {"type": "function_call", "call_id": "call_2", "name": "alarm", "arguments": '{"on": true}'},
              {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 18 C"},
              {"type": "function_call_output", "call_id": "call_2",
               "output": [{"type": "input_text", "text": "set"}]}]
CHAT_ROUND_TRIP = [{"role": "user", "content": "forecast please"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "forecast",
                                                                         "arguments": '{"unit": "c", "days": 2}'}},
                       {"id": "call_2", "type": "function",
                        "function": {"name": "alarm", "arguments": '{"on": true}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 18 C"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "set"}]


def _chat_tool(t: dict) -> dict:
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_function_call_items_and_outputs_are_the_chat_routes_tool_calls_and_tool_messages(resptools_client,
                                                                                           resptools_http, choice):
    resp = resptools_client.responses.create(model="m", input=ROUND_TRIP, tools=[FORECAST, ALARM], tool_choice=choice,
                                             max_output_tokens=6, temperature=0)
    chat = resptools_client.chat.completions.create(model="m", messages=CHAT_ROUND_TRIP, tool_choice=choice,
                                                    tools=[_chat_tool(FORECAST), _chat_tool(ALARM)], max_tokens=6,
                                                    temperature=0)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens          # the same prompt, rendered by one code path
    assert resp.output_text == (chat.choices[0].message.content or "")
    llm = resptools_http.app.state.server.llm
    from metatp.openai_messages import chat_prompt_ids

    prompt = llm.detokenize(chat_prompt_ids(llm.tokenizer, CHAT_ROUND_TRIP))
    assert '"name": "forecast", "arguments": {"unit": "c", "days": 2}' in prompt and "sunny, 18 C" in prompt


# ---------------------------------------------------------------- the stream
def _stream(client, **kw) -> list:
    return list(client.responses.create(model="m", stream=True, **kw))


def test_a_streamed_call_is_its_item_added_its_arguments_and_the_item_done(resptools_client):
    kw = dict(input="forecast please", tools=[FORECAST, ALARM], tool_choice="required", max_output_tokens=240,
              temperature=0)
    whole = resptools_client.responses.create(model="m", **kw)
    events = _stream(resptools_client, **kw)
    kinds = [e.type for e in events]
    n = len(_function_calls(whole))
    assert kinds == ["response.created", "response.in_progress"] + CALL_EVENTS * n + ["response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    for k in range(n):
        added, delta, done, item_done = events[2 + 4 * k: 6 + 4 * k]
        assert added.output_index == delta.output_index == done.output_index == item_done.output_index == k
        assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
        assert delta.item_id == done.item_id == added.item.id == item_done.item.id == final.output[k].id
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == added.item.id)
        assert deltas == done.arguments == item_done.item.arguments == final.output[k].arguments
        assert done.name == item_done.item.name
        _check_call(item_done.item)
    # greedy: the same calls as the whole response (fresh ids)
    assert [(c.name, c.arguments) for c in _function_calls(final)] == [(c.name, c.arguments)
                                                                        for c in _function_calls(whole)]
    with resptools_client.responses.stream(model="m", **kw) as s:
        list(s)
        helper = s.get_final_response()                # the openai client's own accumulator
    assert [(c.name, c.arguments) for c in _function_calls(helper)] == [(c.name, c.arguments)
                                                                         for c in _function_calls(whole)]


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_a_stream_under_auto_or_none_matches_the_whole_response(resptools_client, choice):
    """Whatever the random model answers (words or calls), the stream's items are the whole
    response's: a message only when there is text, its deltas spelling it."""
    kw = dict(input="forecast please", tools=[FORECAST], tool_choice=choice, max_output_tokens=40, temperature=0)
    whole = resptools_client.responses.create(model="m", **kw)
    events = _stream(resptools_client, **kw)
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output_text == whole.output_text == "".join(e.delta for e in events
                                                            if e.type == "response.output_text.delta")
    assert final.status == whole.status and [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [item.type for item in whole.output]


def _answer(fmt: str, body: dict):
    """A ResponsesAnswer for `body` under the tool format `fmt`, as the route builds it."""
    from metatp.responses_api import ResponsesAnswer, responses_request
    from metatp.server.fields import tool_plan
    from metatp.tool_formats import FORMATS

    parsed = responses_request({"input": "x", **body})
    return ResponsesAnswer("m", parsed, 3, str, tool_plan(parsed.chat_body, FORMATS[fmt]))


def _outputs(pieces: list[str]) -> list:
    from metatp.output_processor import StepOutput

    return [StepOutput(k, p, "stop" if k == len(pieces) - 1 else None) for k, p in enumerate(pieces)]


def _streamed(fmt: str, body: dict, pieces: list[str]) -> list[dict]:
    answer = _answer(fmt, body)
    return answer.head() + [e for out in _outputs(pieces) for e in answer.chunk(out)] + answer.tail("stop")


def test_a_reply_under_auto_streams_as_a_message_opened_with_its_first_words():
    """The generic format's {"response": ...}: no message until there are words, then their deltas."""
    pieces = ['{"resp', 'onse": "He', 'llo', ' there"', "}"]
    events = _streamed("generic", {"tools": [FORECAST]}, pieces)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello there"
    whole = _answer("generic", {"tools": [FORECAST]}).whole(_outputs(pieces))
    [message] = events[-1]["response"]["output"]
    assert [item["content"] for item in whole["output"]] == [message["content"]]
    assert message["content"][0]["text"] == "Hello there"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_words_then_a_native_call_are_a_message_then_a_function_call_item():
    """Hermes: the text before <tool_call> is the message (output_index 0), the call item 1."""
    pieces = ["Let me look. ", '<tool_call>{"name": "alarm", ', '"arguments": {"on": false}}</tool_call>']
    body = {"tools": [FORECAST, ALARM]}
    events = _streamed("hermes", body, pieces)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"] + CALL_EVENTS + ["response.completed"]
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]
    assert events[4]["delta"] == "Let me look. " and events[8]["output_index"] == 1
    assert (final[1]["name"], json.loads(final[1]["arguments"])) == ("alarm", {"on": False})
    whole = _answer("hermes", body).whole(_outputs(pieces))["output"]
    assert [item["type"] for item in whole] == ["message", "function_call"]
    assert whole[0]["content"][0]["text"].strip() == "Let me look." and whole[1]["arguments"] == final[1]["arguments"]


def test_a_call_whose_arguments_do_not_validate_stays_text():
    """Metatp.tool_calls' check: arguments against the tool's schema; a bad call never becomes an item."""
    pieces = ['<tool_call>{"name": "alarm", "arguments": {"on": "maybe"}}</tool_call>']
    whole = _answer("hermes", {"tools": [ALARM]}).whole(_outputs(pieces))
    assert [item["type"] for item in whole["output"]] == ["message"]
    assert whole["output"][0]["content"][0]["text"] == pieces[0]
    events = _streamed("hermes", {"tools": [ALARM]}, pieces)
    assert "response.function_call_arguments.delta" not in [e["type"] for e in events]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == pieces[0]


# ---------------------------------------------------------------- the 400s naming the field
@pytest.mark.parametrize("extra, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [FORECAST, {"type": "mcp", "server_label": "x"}]}, "tools[1].type", "mcp"),
    ({"tools": {"type": "function"}}, "tools", "list"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters",
     "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "no spaces allowed"}]}, "tools[0].name", "tools[0].name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "flat"),
    ({"tools": [FORECAST | {"strict": "yes"}]}, "tools[0].strict", "boolean"),
    ({"tools": [FORECAST], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tools": [FORECAST], "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [FORECAST], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"tools": [FORECAST], "text": {"format": {"type": "json_object"}}}, "text", "text.format"),   # auto: a conflict
    ({"tools": [FORECAST], "max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input", "call_9"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "forecast"}]}, "input", "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 5}]}, "input", "input[1].output"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(resptools_http, extra, param, says):
    r = resptools_http.post("/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2, **extra},
                            headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_text_format_beside_a_forced_call_is_left_out(resptools_client):
    """A forced call holds no text for text.format to shape (instructor sends both): the call, as without it."""
    fmt = {"type": "json_schema", "name": "alarm", "schema": ALARM["parameters"], "strict": True}
    kw = dict(model="m", input="x", tools=[FORECAST, ALARM], tool_choice={"type": "function", "name": "alarm"},
              max_output_tokens=60, temperature=0)
    resp = resptools_client.responses.create(**kw, text={"format": fmt})
    [call] = _function_calls(resp)
    assert call.arguments == _function_calls(resptools_client.responses.create(**kw))[0].arguments
    assert resp.text.format.type == "json_schema"                 # echoed as sent


def test_the_openai_client_sees_a_bad_tool_type_as_bad_request(resptools_client):
    with pytest.raises(openai.BadRequestError) as e:
        resptools_client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"


# ---------------------------------------------------------------- the default model: a real call
TIME = {"type": "function", "name": "get_time", "description": "Get the current time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def resptools_default_client(default_model):
    """The app on the default model (SmolLM2: no tool syntax, the generic format)."""
    with _app_client(LLM(str(default_model), backend="numpy", n_ctx=1024)) as http:
        yield _openai(http)


@pytest.mark.slow
def test_the_default_model_calls_the_named_function_and_reads_its_result(resptools_default_client):
    client = resptools_default_client
    question = {"role": "user", "content": "What time is it in Tokyo?"}
    resp = client.responses.create(model="m", input=[question], tools=[TIME, WEATHER], temperature=0,
                                   tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=96)
    [call] = _function_calls(resp)
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"city": "Tokyo"})
    answer = client.responses.create(
        model="m", tools=[TIME, WEATHER], tool_choice="none", temperature=0, max_output_tokens=32,
        input=[question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "It is 12:00 in Tokyo."}])
    assert answer.output_text and not _function_calls(answer)


@pytest.mark.slow
def test_responses_parse_gives_pydantic_parsed_arguments(resptools_default_client):
    """The openai client's own tool helper: pydantic_function_tool (strict), parsed_arguments."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    resp = resptools_default_client.responses.parse(model="m", input="John is 30 years old.", temperature=0,
                                                     tools=[openai.pydantic_function_tool(Person)],
                                                     tool_choice="required", max_output_tokens=64)
    [call] = _function_calls(resp)
    assert call.name == "Person" and isinstance(call.parsed_arguments, Person) and call.parsed_arguments.name


@pytest.mark.slow
def test_instructor_responses_tools_mode(resptools_default_client):
    import instructor
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    client = instructor.from_openai(resptools_default_client, mode=instructor.Mode.RESPONSES_TOOLS)
    p = client.responses.create(model="m", response_model=Person, max_retries=0, temperature=0, max_output_tokens=64,
                                input=[{"role": "user", "content": "John is 30 years old."}])
    assert isinstance(p, Person) and isinstance(p.age, int) and p.name


@pytest.mark.slow
def test_a_replys_logprobs_spell_the_output_text_whole_and_streamed(resptools_default_client):
    """Under tool_choice auto the generic format answers {"response": ...}: the output_text's
    logprobs are the reply string's tokens (not the JSON wrapper's), whole and streamed."""
    kw = dict(model="m", input="Hi! How are you?", tools=[TIME, WEATHER], temperature=0, max_output_tokens=96,
              include=["message.output_text.logprobs"], top_logprobs=1)
    resp = resptools_default_client.responses.create(**kw)
    assert not _function_calls(resp) and resp.output_text
    [part] = [c for item in resp.output if item.type == "message" for c in item.content]
    assert "".join(lp.token for lp in part.logprobs) == resp.output_text
    done = [ev for ev in resptools_default_client.responses.create(stream=True, **kw)
            if ev.type == "response.output_text.done"]
    assert [lp.token for lp in done[0].logprobs] == [lp.token for lp in part.logprobs]
