"""OpenAI's Responses API (/v1/responses, metatp.responses_api) through the real app in-process and
the official `openai` client: `responses.create` plain (`output_text`) and streamed (the typed
events, numbered, their deltas spelling the text), `responses.stream`, instructions and input
items as the chat route's messages (greedy: the same text), max_output_tokens (incomplete),
text.format json_schema, logprobs (include), and the fields refused by name."""

from __future__ import annotations

import json

import pytest

from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import optional_import

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=48, chat_template=TEMPLATE)
N_CTX = 128
MODEL = "responses-model"
KEY = "sk-responses"
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def responses_http(path):
    """The app with an API key, through FastAPI's test client."""
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    app = create_app(LLM(path, backend="numpy", n_ctx=N_CTX), model_name=MODEL, api_key=KEY, max_model_len=N_CTX)
    with testclient.TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def responses_client(responses_http):
    """The official openai client on the in-process app."""
    openai = optional_import("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=responses_http)


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, object]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_a_string_input_answers_what_the_chat_route_answers(responses_client):
    resp = responses_client.responses.create(model=MODEL, input="Say something.", max_output_tokens=12,
                                             temperature=0)
    text, use = chat_text(responses_client, [{"role": "user", "content": "Say something."}], 12)
    assert resp.output_text == text and text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    msg = resp.output[0]
    assert (msg.type, msg.role, msg.content[0].type, msg.content[0].annotations) == ("message", "assistant",
                                                                                     "output_text", [])
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (use.prompt_tokens, use.completion_tokens)
    assert resp.usage.total_tokens == use.total_tokens


def test_instructions_and_input_items_are_the_chat_messages(responses_client):
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                          {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Again?"}]
    resp = responses_client.responses.create(model=MODEL, instructions="You are a bot.", input=items,
                                             max_output_tokens=10, temperature=0, store=True, metadata={"k": "v"})
    messages = [{"role": "system", "content": "You are a bot."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi\nthere"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"}]
    assert resp.output_text == chat_text(responses_client, messages, 10)[0]
    assert resp.instructions == "You are a bot." and resp.metadata == {"k": "v"}
    assert resp.store is False                   # accepted and not stored (vLLM without its store)


def test_max_output_tokens_running_out_is_incomplete(responses_client):
    resp = responses_client.responses.create(model=MODEL, input="Go on.", max_output_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.max_output_tokens == 3 and resp.output[0].status == "incomplete"


def test_a_stream_is_the_typed_events_in_order_spelling_the_text(responses_client):
    whole = responses_client.responses.create(model=MODEL, input="Tell me.", max_output_tokens=12, temperature=0)
    events = list(responses_client.responses.create(model=MODEL, input="Tell me.", max_output_tokens=12,
                                                    temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_ORDER and kinds[-4:] == STREAM_END + [f"response.{whole.status}"], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == \
        whole.usage.output_tokens
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1


def test_responses_stream_helper_gives_the_final_response(responses_client):
    """A stop string (vLLM's field, passed on) from the greedy text ends it: completed, the event
    the helper's final response needs."""
    greedy = responses_client.responses.create(model=MODEL, input="More.", max_output_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True}).output_text
    stop = greedy[6:8]
    kw = dict(model=MODEL, input="More.", max_output_tokens=16, temperature=0, extra_body={"stop": [stop]})
    whole = responses_client.responses.create(**kw)
    assert whole.status == "completed" and whole.output_text == greedy[:greedy.index(stop)]
    with responses_client.responses.stream(**kw) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert deltas == final.output_text == whole.output_text


def test_logprobs_included_spell_the_text_whole_and_streamed(responses_client):
    kw = dict(model=MODEL, input="Words.", max_output_tokens=10, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    part = responses_client.responses.create(**kw).output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text and part.logprobs
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert all(lp.logprob == max(t.logprob for t in lp.top_logprobs) for lp in part.logprobs)     # greedy
    events = list(responses_client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in part.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in final] == [(lp.token, lp.logprob) for lp in part.logprobs]
    plain = responses_client.responses.create(model=MODEL, input="Words.", max_output_tokens=3, temperature=0)
    assert plain.output[0].content[0].logprobs == []               # not asked for: none


@requires("structured")
def test_text_format_json_schema_constrains_the_output(responses_client):
    jsonschema = optional_import("jsonschema")
    mood = {"type": "object", "additionalProperties": False, "required": ["mood"],
            "properties": {"mood": {"enum": ["happy", "sad"]}}}
    resp = responses_client.responses.create(
        model=MODEL, input="Mood?", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "mood", "schema": mood, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), mood)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, status, param", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"previous_response_id": "resp_123"}, 404, "previous_response_id"),
    ({"background": True}, 400, "background"),
    ({"input": None}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "input"),
    ({"instructions": 7}, 400, "instructions"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ({"temperature": 9}, 400, "temperature"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"metadata": {"k": 1}}, 400, "metadata"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, 400, "top_logprobs"),
    ({"include": "message.output_text.logprobs"}, 400, "include"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_a_field_it_cannot_honour_is_refused_by_name(responses_http, extra, status, param):
    r = responses_http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2, **extra},
                            headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split("_")[0] in err["message"] or param == "input", err


@requires("structured")
def test_a_bad_schema_is_a_400_naming_text_format(responses_http):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}
    r = responses_http.post("/v1/responses", json={"input": "x", "text": {"format": fmt}}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert "text.format" in r.json()["error"]["message"]


def test_it_needs_the_key(responses_http):
    assert responses_http.post("/v1/responses", json={"input": "x"}).status_code == 401
