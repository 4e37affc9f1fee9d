"""/v1/embeddings (issue 47 item 2) through the real app in-process: the official openai client's
`embeddings.create` (floats, and base64, which the client asks for and decodes by default), the
answer's shape and usage, and the 400s naming the field."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.serving import optional_import

SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=300, seed=48)
N_CTX = 64
MODEL = "embed-model"
KEY = "sk-embeddings"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["hello world", "a second, longer input to embed", "x"]


@pytest.fixture(scope="module")
def embeddings_client(path):
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    app = create_app(LLM(path, backend="numpy", n_ctx=N_CTX), model_name=MODEL, api_key=KEY, max_model_len=32)
    with testclient.TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def embeddings_want(embeddings_client):
    """What LLM.embed gives for TEXTS on the served LLM."""
    return np.array(embeddings_client.app.state.server.llm.embed(TEXTS))


def _post(client, body: dict, route: str = "/v1/embeddings"):
    return client.post(route, json=body, headers=AUTH)


def _error(r, status: int, code: str | None, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), r.text
    return err["message"]


def test_the_openai_client_gets_floats_and_base64(embeddings_client, embeddings_want):
    openai = optional_import("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=embeddings_client)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), embeddings_want, rtol=1e-6, atol=1e-7)
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)     # the client asks for base64 and decodes it
    np.testing.assert_allclose(np.array([d.embedding for d in decoded.data]), embeddings_want, rtol=1e-6, atol=1e-7)
    n = sum(len(embeddings_client.app.state.server.llm.tokenize(t)) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (n, n)
    one = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, embeddings_want[0], atol=1e-7)


def test_the_answer_shape_and_base64_bytes(embeddings_client, embeddings_want):
    r = _post(embeddings_client, {"input": TEXTS, "model": MODEL, "encoding_format": "base64", "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL and set(body["usage"]) == {"prompt_tokens",
                                                                                          "total_tokens"}
    for i, d in enumerate(body["data"]):
        assert (d["object"], d["index"]) == ("embedding", i)
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")       # little-endian float32
        assert vec.shape == (SPEC.n_embd,)
        np.testing.assert_allclose(vec, embeddings_want[i], rtol=1e-6, atol=1e-7)
    plain = _post(embeddings_client, {"input": TEXTS}, "/embeddings").json()      # no model: the served one
    np.testing.assert_allclose([d["embedding"] for d in plain["data"]], embeddings_want, rtol=1e-6, atol=1e-7)
    assert abs(np.linalg.norm(plain["data"][0]["embedding"]) - 1) < 1e-6


def test_token_id_inputs(embeddings_client, embeddings_want):
    llm = embeddings_client.app.state.server.llm
    ids = [llm.tokenize(t) for t in TEXTS]
    one = _post(embeddings_client, {"input": ids[0], "encoding_format": "float"}).json()
    assert len(one["data"]) == 1 and np.allclose(one["data"][0]["embedding"], embeddings_want[0], atol=1e-7)
    many = _post(embeddings_client, {"input": ids}).json()
    np.testing.assert_allclose([d["embedding"] for d in many["data"]], embeddings_want, rtol=1e-6, atol=1e-7)
    assert _post(embeddings_client, {"input": "x", "dimensions": SPEC.n_embd}).status_code == 200   # its own size


@pytest.mark.parametrize("body, status, code, param, words", [
    ({}, 400, None, "input", "'input' is required"),
    ({"input": ""}, 400, None, "input", "empty string"),
    ({"input": []}, 400, None, "input", "empty list"),
    ({"input": [[]]}, 400, None, "input", "empty list"),
    ({"input": 5}, 400, None, "input", "must be a string"),
    ({"input": ["a", {"x": 1}]}, 400, None, "input", "[1] must be a string or a list of token ids"),
    ({"input": [1, 300]}, 400, None, "input", "token id 300, out of range"),
    ({"input": list(range(40))}, 400, "context_length_exceeded", "input", "has 40 tokens but a request may hold"),
    ({"input": "x", "encoding_format": "int8"}, 400, None, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": 8}, 400, None, "dimensions", "does not shorten"),
    ({"input": "x", "dimensions": "8"}, 400, None, "dimensions", "positive integer"),
    ({"input": "x", "user": 7}, 400, None, "user", "'user' must be a string"),
    ({"input": "x", "model": "text-embedding-3-small"}, 404, "model_not_found", "model", "does not exist"),
])
def test_bad_bodies_are_refused_naming_the_field(embeddings_client, body, status, code, param, words):
    assert words in _error(_post(embeddings_client, body), status, code, param)


def test_it_needs_the_api_key(embeddings_client):
    assert embeddings_client.post("/v1/embeddings", json={"input": "x"}).status_code == 401
