"""Tool calling through the real app (metatp.server.create_app, in-process through FastAPI's test
client) with the clients people use: the official `openai` client (tool_choice auto, required,
named, parallel, streamed; tool results sent back), langchain-openai (`bind_tools`,
`with_structured_output(method="function_calling")`) and instructor (`Mode.TOOLS`), on the default
model (SmolLM2: no tool syntax, so the generic format). On a synthetic model: the 400s naming the
field, calls that always parse under required / named (the output is constrained), and the tools
reaching a template that takes them."""

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
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=47, chat_template=TEMPLATE,
                 n_ctx_train=1024)
KEY = "sk-tools"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
# for a random synthetic model: every value bounded, so a constrained call ends within a few tokens
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "required": ["unit", "days"],
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


def _app_client(llm, **options):
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    return testclient.TestClient(create_app(llm, model_name="m", api_key=KEY, max_model_len=llm.n_ctx, **options))


def _openai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ---------------------------------------------------------------- synthetic model: fields and constrained calls
@pytest.fixture(scope="module")
def tools_synthetic_client(path):
    """The app on the synthetic model (generic format: its template has no tool syntax)."""
    with _app_client(LLM(path, backend="numpy", n_ctx=1024)) as http:
        yield _openai(http)


USER = [{"role": "user", "content": "forecast please"}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [FORECAST], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "forecast"}}}, "tool_choice"),
    ({"tools": [FORECAST], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [FORECAST], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [FORECAST["function"]]}, "functions"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),           # a tool result needs tool_call_id
])
def test_bad_tool_fields_are_a_400_naming_the_field(tools_synthetic_client, extra, param):
    body = {"messages": USER, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        tools_synthetic_client.chat.completions.create(model="m", **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert param.split(".")[0].split("[")[0] in e.value.body["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_required_and_named_calls_always_parse_even_on_a_random_model(tools_synthetic_client, choice):
    for seed in range(3):
        r = tools_synthetic_client.chat.completions.create(model="m", messages=USER, tools=[FORECAST], seed=seed,
                                                           tool_choice=choice, max_tokens=240, temperature=1.0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert c.message.tool_calls and all(t.id.startswith("call_") for t in c.message.tool_calls)
        for name, args in _calls(c.message):
            assert name == "forecast"
            jsonschema.validate(args, FORECAST["function"]["parameters"])
        if not isinstance(choice, str):
            assert len(c.message.tool_calls) == 1                 # a named function: one call


def test_tool_choice_none_and_no_tools_answer_plain_content(tools_synthetic_client):
    for extra in ({"tools": [FORECAST], "tool_choice": "none"}, {"tool_choice": "auto"}, {}):
        r = tools_synthetic_client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0,
                                                           **extra)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_template_that_takes_tools_renders_them_and_the_tool_messages(synth_factory):
    from metatp.openai_messages import chat_prompt_ids
    from metatp.tool_calls import plan_tools, tool_request
    from metatp.tool_formats import FORMATS

    hermes = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
              "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
              "{% endfor %}assistant:")
    llm = LLM(str(synth_factory(SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False,
                                          seed=48, chat_template=hermes))[0]), backend="numpy", n_ctx=512)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]
    fmt = FORMATS["hermes"]
    text = llm.detokenize(chat_prompt_ids(llm.tokenizer, msgs, plan_tools(tool_request(TOOLS), fmt), fmt))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "tool: 18 C" in text and "You can call these tools" not in text       # no generic prompt
    with _app_client(llm) as http:                  # the served format is detected the same way
        r = _openai(http).chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=2)
        assert r.usage.prompt_tokens == len(chat_prompt_ids(llm.tokenizer, msgs, plan_tools(tool_request(TOOLS),
                                                                                             fmt), fmt))


# ---------------------------------------------------------------- the default model: the clients
@pytest.fixture(scope="module")
def tools_http(default_model):
    """The app on the default model (n_ctx 1024), through FastAPI's test client."""
    with _app_client(LLM(str(default_model), backend="numpy", n_ctx=1024)) as http:
        yield http


@pytest.fixture(scope="module")
def tools_client(tools_http):
    return _openai(tools_http)


def _ask(client, question: str, **kw):
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                          temperature=0, **kw).choices[0]


@pytest.mark.slow
def test_named_tool_choice_calls_that_function(tools_client):
    c = _ask(tools_client, "What time is it in Tokyo?", tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert _calls(c.message) == [("get_time", {"city": "Tokyo"})]


@pytest.mark.slow
def test_required_without_parallel_calls_makes_one_call(tools_client):
    c = _ask(tools_client, "What is the weather like in Paris?", tool_choice="required", parallel_tool_calls=False)
    assert c.finish_reason == "tool_calls"
    assert _calls(c.message) == [("get_weather", {"city": "Paris"})]


@pytest.mark.slow
def test_parallel_calls_are_several_distinct_valid_calls(tools_client):
    c = _ask(tools_client, "What is the weather like in Paris?", tool_choice="required")
    calls = _calls(c.message)
    assert c.finish_reason == "tool_calls" and len(calls) >= 2, c
    assert len({json.dumps(x) for x in calls}) == len(calls) and len({t.id for t in c.message.tool_calls}) == len(calls)
    assert ("get_weather", {"city": "Paris"}) in calls
    for name, args in calls:
        jsonschema.validate(args, {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])


@pytest.mark.slow
def test_auto_answers_in_words_or_with_a_call(tools_client):
    chat = _ask(tools_client, "Hi! How are you?", tool_choice="auto")
    assert chat.finish_reason == "stop" and chat.message.tool_calls is None
    assert chat.message.content and not chat.message.content.lstrip().startswith("{")      # the reply, unwrapped
    call = _ask(tools_client, "Use the tools. What is the weather like in Paris right now?")      # auto: the default
    assert call.finish_reason == "tool_calls" and ("get_weather", {"city": "Paris"}) in _calls(call.message)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(tools_client, choice):
    question = "What time is it in Tokyo?"
    whole = _ask(tools_client, question, tool_choice=choice)
    stream = tools_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0, max_tokens=96,
        tool_choice=choice, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                if d.id:
                    assert slot["id"] is None and d.function.name, "the name comes in a call's first delta"
                    slot["id"] = d.id
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == _calls(whole.message)
    with tools_client.chat.completions.stream(model="m", messages=[{"role": "user", "content": question}],
                                              tools=TOOLS, temperature=0, max_tokens=96, tool_choice=choice) as s:
        final = s.get_final_completion()                       # the openai client's own accumulator
    assert _calls(final.choices[0].message) == _calls(whole.message)


@pytest.mark.slow
def test_a_streamed_reply_under_auto_comes_in_pieces_as_plain_content(tools_client):
    question = "Hi! How are you?"
    whole = _ask(tools_client, question)
    pieces, finish = [], None
    for chunk in tools_client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                                      tools=TOOLS, temperature=0, max_tokens=96, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.tool_calls
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.message.content and len(pieces) > 2      # the reply unwrapped, as it came
    assert finish == whole.finish_reason == "stop"


def test_reply_logprobs_list_the_tokens_of_the_reply_string():
    """A generic-format reply's logprobs: the tokens overlapping its JSON string, each with the
    content it adds (a quote-straddling token trimmed, escapes decoded where they end), so they
    spell the content; a tool-call answer lists every token; a stream takes what a whole answer does."""
    from types import SimpleNamespace

    from metatp.tool_answers import ReplyTokens

    def tokens(*texts):
        return [SimpleNamespace(text=t, logprob=-0.5, top_logprobs=None) for t in texts]

    def whole(toks):
        r = ReplyTokens()
        r.add(toks)
        return [t.text for t in r.take(final=True)]

    def streamed(toks):
        r, taken = ReplyTokens(), []
        for t in toks:
            r.add([t])
            taken += [x.text for x in r.take()]
        return taken + [x.text for x in r.take(final=True)]

    cases = [
        (tokens('{"', "response", '":', ' "', "Hello", " there", '"', "}", ""), ["Hello", " there"]),
        (tokens('{"', "response", '":', ' "', "Hi", '."}'), ["Hi", "."]),                 # straddles the quote
        (tokens('{"response": "I', "'m", ' \\"ok', '\\"', "\\n", '"}'), ["I", "'m", ' "ok', '"', "\n"]),
        (tokens('{"', "response", '":', ' "', "a", "\\", '"b', "\\u00", "e9", "\\ud83d\\ude00", '!"}'),
         ["a", "", '"b', "", "\u00e9", "\U0001f600", "!"]),                      # escapes cut across tokens
    ]
    for toks, want in cases:
        assert whole(toks) == want and streamed(toks) == want
        text = "".join(t.text for t in toks)
        assert "".join(want) == json.loads(text[:text.rindex("}") + 1])["response"]
    calls = tokens('{"', "tool_calls", '":', " [", "]}")
    assert whole(calls) == streamed(calls) == [t.text for t in calls]
    cut = tokens('{"', "response", '":', ' "', "Hel", "lo\\")        # max_tokens: an escape cut in half
    assert whole(cut) == ["Hel", "lo"]


@pytest.mark.slow
def test_a_replys_logprobs_spell_its_content_whole_and_streamed(tools_client):
    question = "Hi! How are you?"
    whole = _ask(tools_client, question, logprobs=True, top_logprobs=1)
    content, listed = whole.message.content, [e.token for e in whole.logprobs.content]
    assert whole.message.tool_calls is None and "".join(listed) == content
    streamed = []
    for chunk in tools_client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                                      tools=TOOLS, temperature=0, max_tokens=96, stream=True,
                                                      logprobs=True, top_logprobs=1):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed += [e.token for e in ch.logprobs.content]
    assert streamed == listed


@pytest.mark.slow
def test_tool_results_round_trip(tools_client, tools_http):
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = _ask(tools_client, question[0]["content"], tool_choice="required", parallel_tool_calls=False)
    call = first.message.tool_calls[0]
    history = [*question, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = tools_client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=32)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # the result reached the prompt: the model's own prompt holds it, as a "tool" message
    from metatp.openai_messages import chat_prompt_ids

    llm = tools_http.app.state.server.llm
    assert "tool\n18 degrees and sunny" in llm.detokenize(chat_prompt_ids(llm.tokenizer, history))
    assert r.usage.prompt_tokens == len(chat_prompt_ids(llm.tokenizer, history))


@pytest.mark.slow
def test_create_chat_completion_takes_tools_as_llama_cpp_python_does(tools_http):
    llm = tools_http.app.state.server.llm
    r = llm.create_chat_completion([{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                   temperature=0, max_tokens=96)
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    [call] = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"city": "Tokyo"})
    chunks = list(llm.create_chat_completion([{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}},
                                             temperature=0, max_tokens=96, stream=True))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_time"
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Tokyo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    from metatp.ir.errors import ConfigError

    with pytest.raises(ConfigError, match="tool_choice"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.slow
def test_langchain_bind_tools_and_structured_output(tools_http):
    import langchain_openai
    from pydantic import BaseModel, Field

    def get_time(city: str) -> str:
        """Get the current time in a city."""
        return "12:00"

    llm = langchain_openai.ChatOpenAI(model="m", base_url="http://testserver/v1", api_key=KEY, temperature=0,
                                      max_tokens=96, http_client=tools_http, max_retries=0)
    msg = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it in Tokyo?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_time", {"city": "Tokyo"})]

    class City(BaseModel):
        """A city and the country it is in."""
        name: str = Field(description="the city's name")
        country: str = Field(description="the country the city is in")

    got = llm.with_structured_output(City, method="function_calling").invoke("Paris is a city in France.")
    assert isinstance(got, City) and got.name and got.country


@pytest.mark.slow
def test_instructor_tools_mode(tools_client):
    import instructor
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    client = instructor.from_openai(tools_client, mode=instructor.Mode.TOOLS)
    p = client.chat.completions.create(model="m", response_model=Person, max_retries=0, temperature=0, max_tokens=64,
                                       messages=[{"role": "user", "content": "John is 30 years old."}])
    assert isinstance(p, Person) and isinstance(p.age, int) and p.name


def test_the_tool_call_parser_flag_overrides_the_detected_format(path):
    from metatp.cli import _build_parser
    from metatp.ir.errors import ConfigError
    from metatp.server import create_app

    args = _build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--tool-call-parser", "nonsense"])
    llm = LLM(path, backend="numpy", n_ctx=1024)
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        create_app(llm, tool_call_parser="nonsense")
    body = {"model": "m", "messages": USER, "tools": [FORECAST], "max_tokens": 1}
    with _app_client(llm) as generic, _app_client(llm, tool_call_parser="hermes") as hermes:
        n_generic = _openai(generic).chat.completions.create(**body).usage.prompt_tokens
        n_hermes = _openai(hermes).chat.completions.create(**body).usage.prompt_tokens
    # hermes: the tools go to the template, which (this one) does not print them; generic: the system prompt
    plain = _openai_plain_prompt_tokens(llm)
    assert n_hermes == plain < n_generic


def _openai_plain_prompt_tokens(llm) -> int:
    from metatp.openai_messages import chat_prompt_ids

    return len(chat_prompt_ids(llm.tokenizer, USER))
