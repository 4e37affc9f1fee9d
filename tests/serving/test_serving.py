"""`metatp serve`: the real server on 127.0.0.1, driven by the official `openai` client and raw HTTP.

A synthetic Q8_0 model keeps it fast on two cores: completions, streaming with usage,
logprobs, n=2, stop, seed reproducibility, errors and auth, /metrics, /tokenize, a load test
of 64 requests at concurrency 16 (each greedy output equal to the same request alone, one step
carrying >= 8 sequences, KV cells back to zero), a client that disconnects mid-stream, and a
full waiting queue. The default model (when cached) serves chat completions through its GGUF
chat template. Every request loop is bounded in count and time. Serving under
`mpiexec -n 2` (rank 0 serves, rank 1 follows its steps): tests/test_mpi_serving.py.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import ServeProcess, free_port, optional_import

pytestmark = requires("serve")           # fastapi, uvicorn, openai, httpx: skip, or fail under METATP_REQUIRE
openai = optional_import("openai")       # None without it (the marker then stops every test first)
httpx = optional_import("httpx")

KEY = "test-key"
SPEC = SynthSpec(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, tied=False, seed=21, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
MODEL = "synth-q8.gguf"               # the id the server lists: the model file's name


class Server(ServeProcess):
    """A `metatp serve` subprocess on a free port of 127.0.0.1 (stopped by its pid)."""

    def __init__(self, model: str, *args: str, log: Path) -> None:
        port = free_port()
        super().__init__([sys.executable, "-m", "metatp", "serve", "-m", model, "--port", str(port),
                          "--backend", "numpy", *args], log=log, port=port,
                         env={"METATP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.wait_ready(120, 0.2)

    def client(self, key: str = KEY) -> "openai.OpenAI":
        return super().client(key)

    def post(self, path: str, body: str | dict, key: str | None = KEY, timeout: float = 60) -> "httpx.Response":
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, dict):
            return httpx.post(self.base + path, json=body, headers=headers, timeout=timeout)
        return httpx.post(self.base + path, content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(metatp_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}

    def wait_cells_free(self, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while m["metatp_kv_cells_used"] and time.monotonic() < deadline:
            time.sleep(0.1)
            m = self.metrics()
        return m


@pytest.fixture(scope="module")
def served_model(path, tmp_path_factory) -> str:
    """The module's synthetic model (`path`) under the file name the server lists (`MODEL`)."""
    link = tmp_path_factory.mktemp("serve") / MODEL
    link.symlink_to(path)
    return str(link)


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    s = Server(served_model, "-c", "2048", "--parallel", "16", "--max-model-len", "2048", "--api-key", KEY,
               log=tmp_path_factory.mktemp("serve-log") / "server.log")
    yield s
    s.stop()


def complete(client, prompt: str, n: int = 12, **kw) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text


# ---------------------------------------------------------------- the openai client
def test_models_health_tokenize(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(server.base + "/health", timeout=10).json() == {"status": "ok"}
    toks = server.post("/tokenize", {"content": "hello"}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": toks}).json()["content"] == "hello"
    pieces = server.post("/tokenize", {"content": "hi", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "hi" and all(isinstance(p["id"], int) for p in pieces)


def test_completion_and_usage(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="hello there", max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    toks = server.post("/tokenize", {"content": "hello there", "add_special": True}).json()["tokens"]
    assert r.usage.prompt_tokens == len(toks) and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert complete(c, "hello there", 10) == r.choices[0].text       # greedy: the same again


def test_streaming_with_usage(server):
    c = server.client()
    want = complete(c, "stream me", 12)
    chunks = list(c.completions.create(model=MODEL, prompt="stream me", max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "stream me", "max_tokens": 3, "stream": True}, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_logprobs_n2_stop_and_seed(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(abs(max(t.values()) - v) < 1e-9 for t, v in zip(lp.top_logprobs, lp.token_logprobs))   # greedy
    sampled = dict(model=MODEL, prompt="abc", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    two = c.completions.create(n=2, seed=7, **sampled)
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 20
    again = c.completions.create(n=2, seed=7, **sampled)
    assert [ch.text for ch in again.choices] == [ch.text for ch in two.choices]             # seed: reproducible
    assert two.choices[0].text != two.choices[1].text                                       # each sample its own
    one = c.completions.create(seed=7, **sampled)
    assert one.choices[0].text == two.choices[0].text
    text = complete(c, "stop here", 12)
    stop = text[4:6]
    r = c.completions.create(model=MODEL, prompt="stop here", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


# ---------------------------------------------------------------- raw HTTP: errors and auth
@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ("[1, 2]", None),
    (json.dumps({"prompt": "x", "max_tokens": -1}), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}), "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": "hot"}), "temperature"),
    (json.dumps({"prompt": "x", "top_p": 0}), "top_p"),
    (json.dumps({"prompt": "x", "n": 0}), "n"),
    (json.dumps({"prompt": "x", "stop": 5}), "stop"),
    (json.dumps({"prompt": "x", "stream": "yes"}), "stream"),
    (json.dumps({"prompt": [1, "a"]}), "prompt"),
    (json.dumps({"prompt": [10 ** 9]}), "prompt"),
    (json.dumps({"prompt": "x" * 3000}), "prompt"),
    (json.dumps({"max_tokens": 3}), "prompt"),
    (json.dumps({"prompt": "x", "best_of": 3}), "best_of"),
    (json.dumps({"prompt": "x", "n": 2, "best_of": 3}), "best_of"),
    (json.dumps({"prompt": "x", "suffix": " the end"}), "suffix"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and "Traceback" not in r.text
    assert complete(server.client(), "still serving", 2)                     # everyone else goes on


def test_an_unknown_model_is_404_model_not_found(server):
    """OpenAI and vLLM answer 404 for a model the server does not serve (issue 47 item 4)."""
    r = server.post("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "x"}))
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert complete(server.client(), "still serving", 2)


@pytest.mark.parametrize("body,status,words", [
    ("[" * 100_000 + "]" * 100_000, 400, "nested deeper"),                           # a RecursionError before
    ('{"prompt": "x", "a": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nested deeper"),  # a reset before
    ('{"prompt": "' + "[" * 200 + '", "max_tokens": 1}', 200, None),                    # brackets in a string
    ('{"prompt": "x", "pad": "' + "a" * (17 << 20) + '"}', 413, "larger than"),
], ids=["array-1e5-deep", "5000-deep-in-object", "brackets-in-a-string", "17-MiB"])
def test_hostile_bodies_are_bounded_before_parsing(server, body, status, words):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text[:300]
    if words:
        assert words in r.json()["error"]["message"] and "Traceback" not in r.text
    assert complete(server.client(), "still serving", 2)


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"n": 2, "best_of": 2}, {"suffix": ""}, {"suffix": None},
                                   {"user": "u-1", "metadata": {"k": "v"}}])
def test_neutral_values_of_unimplemented_fields_pass(server, extra):
    """best_of equal to n, an empty suffix and OpenAI's metadata fields change nothing: served."""
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == extra.get("n", 1)


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_chat_fields_metatp_does_not_implement_are_refused_by_name(server, extra, param):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not supported" in err["message"] and "Traceback" not in r.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_choice_that_needs_tools_without_tools_is_refused_by_name(server, choice):
    """Tool calling is implemented (tests/serving/test_tool_calls.py); a choice it cannot honour is a 400."""
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "tool" in err["message"] and "Traceback" not in r.text


def test_chat_errors_without_template_and_bad_messages(server):
    r = server.post("/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_api_key(server):
    for key in (None, "wrong"):
        r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.base + "/v1/models", timeout=10,
                         headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------- load, disconnects, a full queue
def test_load_64_requests_at_concurrency_16(server):
    prompts = [f"request {i}: " + "abcdefghij"[: i % 10] for i in range(64)]
    c = server.client()
    alone = {p: complete(c, p, 24) for p in prompts}                  # one at a time first
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def worker(k: int) -> None:
        client = server.client()
        try:
            start.wait(timeout=60)
            for p in prompts[k::16]:
                got[p] = complete(client, p, 24)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert time.monotonic() - t0 < 300
    assert got == alone                                             # every one completed, each as alone
    m = server.wait_cells_free()
    assert m["metatp_step_sequences_max"] >= 8
    assert m["metatp_kv_cells_used"] == 0 and m["metatp_requests_running"] == 0
    assert m["metatp_time_to_first_token_seconds_count"] >= 128


@pytest.fixture(scope="module")
def tight(served_model, tmp_path_factory):
    """One slot and room for one waiting request."""
    s = Server(served_model, "-c", "4096", "--parallel", "1", "--max-waiting", "1",
               log=tmp_path_factory.mktemp("serve-log") / "tight.log")
    yield s
    s.stop()


def _open_stream(server: Server, max_tokens: int):
    client = httpx.Client(timeout=60)
    resp = client.send(client.build_request("POST", server.base + "/v1/completions",
                                            json={"prompt": "long", "max_tokens": max_tokens, "stream": True,
                                                  "ignore_eos": True}), stream=True)
    return client, resp


def test_disconnect_cancels_and_frees_cells(tight):
    before = tight.metrics()
    client, resp = _open_stream(tight, 1800)
    lines = resp.iter_lines()
    for _ in range(3):
        assert next(lines).startswith("data: ")
        next(lines)                                               # the blank line after each event
    assert tight.metrics()["metatp_kv_cells_used"] > 0
    resp.close()
    client.close()                                                # the client goes away mid-stream
    m = tight.wait_cells_free()
    assert m["metatp_kv_cells_used"] == 0
    assert m["metatp_sequences_cancelled_total"] == before["metatp_sequences_cancelled_total"] + 1
    assert m["metatp_generation_tokens_total"] - before["metatp_generation_tokens_total"] < 1800


def test_full_queue_answers_503(tight):
    busy = _open_stream(tight, 4000)
    lines = busy[1].iter_lines()          # (kept: a dropped iterator closes the stream, which cancels it)
    assert next(lines).startswith("data: ")                       # it holds the one slot
    waiting = threading.Thread(target=lambda: tight.post("/v1/completions", {"prompt": "w", "max_tokens": 2},
                                                         key=None, timeout=120))
    waiting.start()
    deadline = time.monotonic() + 30
    while tight.metrics()["metatp_requests_waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tight.metrics()["metatp_requests_running"] == 1       # the busy stream still holds the slot
    r = tight.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    busy[1].close()
    busy[0].close()
    waiting.join(timeout=120)
    assert not waiting.is_alive()
    assert tight.wait_cells_free()["metatp_kv_cells_used"] == 0


# ---------------------------------------------------------------- the default model: chat template
@pytest.fixture(scope="module")
def real(default_model, tmp_path_factory):
    s = Server(str(default_model), "-c", "1024", "--parallel", "4",
               log=tmp_path_factory.mktemp("serve-log") / "real.log")
    yield s
    s.stop()


def test_real_model_chat_and_parallel_requests(real):
    c = openai.OpenAI(base_url=real.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=2)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant" and text
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens <= 12
    assert "".join(e.token for e in r.choices[0].logprobs.content) == text       # the tokens spell the text
    chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "The sky is"]
    alone = [c.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, c.completions.create(
        model=model, prompt=prompts[i], max_tokens=8, temperature=0).choices[0].text)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(4)] == alone
    assert real.wait_cells_free()["metatp_kv_cells_used"] == 0
