"""The endpoints and shapes a client reaches for (issue 47 item 4): /v1/models/{id}
(client.models.retrieve), /version, OpenAI's error object on routing's own 404 and 405, 404
model_not_found for a model the server does not serve, 400 for a max_tokens past the context,
and CORS for --allowed-origins -- through the real app (metatp.server.create_app) in-process."""

from __future__ import annotations

import pytest

import metatp
from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import optional_import

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=47, chat_template=TEMPLATE)
N_CTX = 128
MODEL = "endpoints-model"
KEY = "sk-endpoints"
ORIGIN = "https://ui.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _client(path, **app_options):
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    app = create_app(LLM(path, backend="numpy", n_ctx=N_CTX), model_name=MODEL, api_key=KEY, max_model_len=N_CTX,
                     **app_options)
    return testclient.TestClient(app)


@pytest.fixture(scope="module")
def endpoints_client(path):
    """The app with an API key and no CORS origins, through FastAPI's test client."""
    with _client(path) as client:
        yield client


def assert_openai_error(r, status: int, code: str | None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "detail" not in r.json(), r.text
    assert (err["code"], err["param"]) == (code, param), r.text
    return err


# ---------------------------------------------------------------- /v1/models/{id}
def test_a_model_is_retrieved_by_its_name_and_is_what_the_list_holds(endpoints_client, path):
    listed = endpoints_client.get("/v1/models", headers=AUTH).json()["data"][0]
    for name in (MODEL, path):                         # the served name, and the model's path (an alias)
        r = endpoints_client.get(f"/v1/models/{name}", headers=AUTH)
        assert r.status_code == 200 and r.json() == listed, r.text
    assert endpoints_client.get(f"/models/{MODEL}", headers=AUTH).json() == listed


def test_retrieving_another_model_is_404_model_not_found(endpoints_client):
    err = assert_openai_error(endpoints_client.get("/v1/models/gpt-4o", headers=AUTH), 404, "model_not_found", "model")
    assert "gpt-4o" in err["message"] and MODEL in err["message"]
    assert endpoints_client.get(f"/v1/models/{MODEL}").status_code == 401       # it needs the key as /v1/models does


def test_the_openai_client_retrieves_the_model(endpoints_client):
    openai = optional_import("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=endpoints_client)
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "metatp")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                   "max_tokens": 1})])
def test_a_generation_naming_another_model_is_404_model_not_found(endpoints_client, route, body):
    assert_openai_error(endpoints_client.post(route, json={**body, "model": "gpt-4o"}, headers=AUTH), 404,
                        "model_not_found", "model")
    assert endpoints_client.post(route, json={**body, "model": MODEL}, headers=AUTH).status_code == 200


# ---------------------------------------------------------------- routing's own refusals, /version
def test_an_unknown_route_is_404_with_openais_error_object(endpoints_client):
    err = assert_openai_error(endpoints_client.get("/v1/no-such-route", headers=AUTH), 404, "not_found")
    assert err["type"] == "not_found_error" and "GET /v1/no-such-route" in err["message"]


def test_a_wrong_method_is_405_with_openais_error_object(endpoints_client):
    r = endpoints_client.get("/v1/completions", headers=AUTH)
    err = assert_openai_error(r, 405, "method_not_allowed")
    assert err["type"] == "invalid_request_error" and "GET /v1/completions" in err["message"]
    assert r.headers["allow"] == "POST"                     # the methods the route takes, as before


def test_version_is_the_packages_version(endpoints_client):
    r = endpoints_client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": metatp.__version__}


# ---------------------------------------------------------------- max_tokens past the context
PROMPT = [5, 6, 7, 8]


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("route, body, field", [("/v1/completions", {"prompt": PROMPT}, "max_tokens"),
                                                ("/v1/chat/completions", CHAT, "max_tokens"),
                                                ("/v1/chat/completions", CHAT, "max_completion_tokens")])
def test_a_max_tokens_past_the_context_is_a_400_naming_it_and_the_numbers(endpoints_client, route, body, field):
    ok = endpoints_client.post(route, json={**body, field: 2, "temperature": 0}, headers=AUTH)
    n_prompt = ok.json()["usage"]["prompt_tokens"]
    room = N_CTX - n_prompt
    r = endpoints_client.post(route, json={**body, field: room + 1}, headers=AUTH)
    err = assert_openai_error(r, 400, "context_length_exceeded", field)
    assert f"{room + 1}" in err["message"] and f"prompt has {n_prompt}" in err["message"]
    assert f"at most {N_CTX} tokens (max_model_len" in err["message"], err["message"]
    at = endpoints_client.post(route, json={**body, field: room, "temperature": 0, "ignore_eos": True}, headers=AUTH)
    assert at.status_code == 200 and at.json()["usage"]["completion_tokens"] == room, at.text   # exactly the room


def test_without_max_tokens_a_generation_still_ends_at_the_context(endpoints_client):
    """Only an asked-for max_tokens is refused: a chat without one runs to the end of the context."""
    r = endpoints_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "ignore_eos": True}, headers=AUTH).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == N_CTX


def test_a_prompt_past_the_context_is_still_refused_naming_the_prompt(endpoints_client):
    r = endpoints_client.post("/v1/completions", json={"prompt": [7] * (N_CTX + 1), "max_tokens": 5}, headers=AUTH)
    assert_openai_error(r, 400, "context_length_exceeded", "prompt")


# ---------------------------------------------------------------- CORS (--allowed-origins)
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization, Content-Type"}


@pytest.fixture(scope="module")
def cors_client(path):
    """The app with an API key and one allowed origin."""
    with _client(path, allowed_origins=[ORIGIN]) as client:
        yield client


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(cors_client):
    r = cors_client.options("/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].split(", ")) >= {"GET", "POST"}
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 r.headers["access-control-allow-headers"].split(",")}


def test_an_allowed_origins_request_gets_cors_headers_and_still_needs_the_key(cors_client):
    r = cors_client.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert cors_client.get("/v1/models", headers={"Origin": ORIGIN}).status_code == 401


def test_another_origin_gets_no_cors_headers(cors_client):
    other = "https://elsewhere.example"
    r = cors_client.options("/v1/chat/completions", headers={"Origin": other, **PREFLIGHT})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = cors_client.get("/v1/models", headers={"Origin": other, **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_without_allowed_origins_there_are_no_cors_headers(endpoints_client):
    r = endpoints_client.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    r = endpoints_client.options("/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_any_origin_with_a_star(path):
    with _client(path, allowed_origins=["*"]) as client:
        r = client.options("/v1/completions", headers={"Origin": "https://any.example", **PREFLIGHT})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://any.example")


def test_serve_takes_allowed_origins_repeated():
    from metatp.cli import _build_parser

    args = _build_parser().parse_args(["serve", "-m", "x.gguf", "--allowed-origins", ORIGIN,
                                       "--allowed-origins", "*"])
    assert args.allowed_origins == [ORIGIN, "*"]
    assert _build_parser().parse_args(["serve", "-m", "x.gguf"]).allowed_origins is None


# ---------------------------------------------------------------- llama-server's json_object + schema
MOOD = {"type": "object", "additionalProperties": False, "required": ["mood"],
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}}}


def test_json_object_with_a_schema_constrains_to_the_schema():
    from metatp.server.fields import BadRequest, sampling_params

    params = sampling_params({"response_format": {"type": "json_object", "schema": MOOD}}, None, 16)
    assert params.json_schema == MOOD and not params.json_object          # the schema, not any object
    assert sampling_params({"response_format": {"type": "json_object"}}, None, 16).json_object is True
    with pytest.raises(BadRequest) as e:
        sampling_params({"response_format": {"type": "json_object", "schema": 7}}, None, 16)
    assert e.value.param == "response_format" and "schema" in e.value.message


@requires("structured")
@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                         ("/v1/completions", {"prompt": "x"})])
def test_the_server_applies_a_json_object_schema(endpoints_client, route, body):
    import json

    jsonschema = optional_import("jsonschema")
    rf = {"type": "json_object", "schema": MOOD}
    r = endpoints_client.post(route, json={**body, "max_tokens": 40, "temperature": 0, "response_format": rf},
                              headers=AUTH)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert choice["finish_reason"] == "stop", text
    jsonschema.validate(json.loads(text), MOOD)
    bad = {"type": "json_object", "schema": {"type": "foo"}}              # a schema the engine refuses: 400 naming it
    assert_openai_error(endpoints_client.post(route, json={**body, "max_tokens": 4, "response_format": bad},
                                              headers=AUTH), 400, None, "response_format")
