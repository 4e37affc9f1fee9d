"""The tokenizer routes in vLLM's shapes beside llama-server's (metatp.server.tokenization):
/tokenize with {"prompt"} or {"messages"}, /detokenize answering "prompt" too, /tokenizer_info --
what lm-evaluation-harness's remote tokenizer speaks -- in-process; and lm-evaluation-harness
itself (`local-completions`, `tokenizer_backend=remote`, no tokenizer files) scoring a small
local task's loglikelihoods against `metatp serve`, equal to the model's own log-softmax (skipped
where lm_eval is not installed: it is not a CI dependency)."""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM
from metatp.openai_messages import chat_prompt_ids
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}" \
           "assistant:{% endif %}"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=50, chat_template=TEMPLATE)
N_CTX = 128
MODEL = "tok-model"
KEY = "sk-tok"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "hi there"}]
# a small local task: (context, continuation) pairs, as a multiple-choice task asks them
TASK = [("The cat sat on the", " mat"), ("The cat sat on the", " hat"), ("One two", " three four"),
        ("a", " b c d e")]


@pytest.fixture(scope="module")
def tok_llm(path):
    return LLM(path, backend="numpy", n_ctx=N_CTX)


@pytest.fixture(scope="module")
def tok_http(tok_llm):
    """The app with an API key, through FastAPI's test client."""
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    with testclient.TestClient(create_app(tok_llm, model_name=MODEL, api_key=KEY, max_model_len=N_CTX)) as http:
        yield http


def post(http, route: str, body: dict, status: int = 200) -> dict:
    r = http.post(route, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    return r.json()


def test_vllm_tokenize_a_prompt(tok_http, tok_llm):
    tok = tok_llm.tokenizer
    text = "hello world"
    r = post(tok_http, "/tokenize", {"model": MODEL, "prompt": text})
    assert r == {"count": len(r["tokens"]), "max_model_len": N_CTX, "tokens": tok.encode(text, add_bos=None),
                 "token_strs": None}
    plain = post(tok_http, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert plain["tokens"] == tok.encode(text, add_bos=False)
    assert plain["token_strs"] == [tok.token_text(t) for t in plain["tokens"]]
    eos = tok.tokens[tok.eos_id]                    # special-token text is the token (how lm-eval finds eos's id)
    assert post(tok_http, "/tokenize", {"prompt": eos, "add_special_tokens": False})["tokens"] == [tok.eos_id]


def test_vllm_tokenize_messages_is_the_chat_prompt(tok_http, tok_llm):
    r = post(tok_http, "/tokenize", {"model": MODEL, "messages": MSGS, "add_special_tokens": True})
    assert r["tokens"] == chat_prompt_ids(tok_llm.tokenizer, MSGS) and r["count"] == len(r["tokens"])
    bare = post(tok_http, "/tokenize", {"messages": MSGS, "add_generation_prompt": False})["tokens"]
    text = tok_llm.tokenizer.apply_chat_template(MSGS, add_generation_prompt=False)
    assert bare == tok_llm.tokenizer.encode(text, add_bos=False) and len(bare) < r["count"]


def test_detokenize_answers_both_shapes(tok_http, tok_llm):
    ids = tok_llm.tokenize("hello world", add_bos=False)
    assert post(tok_http, "/detokenize", {"tokens": ids}) == {"content": "hello world", "prompt": "hello world"}
    assert post(tok_http, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"] == "hello world"


def test_llama_servers_forms_keep_their_answers(tok_http, tok_llm):
    assert post(tok_http, "/tokenize", {"content": "hello"}) == {"tokens": tok_llm.tokenize("hello", add_bos=False)}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
])
def test_bad_vllm_bodies_are_refused_by_name(tok_http, route, body, status, param):
    assert post(tok_http, route, body, status)["error"]["param"] == param


def test_messages_without_a_chat_template_are_refused_naming_messages(path, tmp_path):
    from metatp.server import create_app
    from metatp.testing.synth import write_synthetic_gguf

    testclient = optional_import("fastapi.testclient")
    bare = tmp_path / "bare.gguf"
    write_synthetic_gguf(bare, SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=50))
    with testclient.TestClient(create_app(LLM(str(bare), backend="numpy", n_ctx=N_CTX))) as http:
        r = http.post("/tokenize", json={"messages": MSGS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "chat template" in r.json()["error"]["message"]
        assert "chat_template" not in http.get("/tokenizer_info").json()


def test_tokenizer_info_is_what_the_remote_tokenizer_reads(tok_http, tok_llm):
    tok = tok_llm.tokenizer
    info = tok_http.get("/tokenizer_info", headers=AUTH).json()
    assert (info["eos_token"], info["bos_token"]) == (tok.tokens[tok.eos_id], tok.tokens[tok.bos_id])
    assert info["chat_template"] == TEMPLATE and info["model_max_length"] == N_CTX
    assert info["tokenizer_class"] and info["vocab_size"] == tok_llm.n_vocab
    assert tok_http.get("/tokenizer_info").status_code == 401


def test_the_remote_tokenizer_protocol(tok_http, tok_llm):
    """lm-evaluation-harness's RemoteTokenizer (lm_eval/utils.py), call for call: GET /tokenizer_info,
    POST /tokenize {"prompt", "add_special_tokens": false} reading "tokens", the eos/bos ids as the
    first token of their text's encoding, POST /detokenize {"tokens"} reading "prompt"."""
    info = tok_http.get("/tokenizer_info", headers=AUTH).json()

    def encode(text: str) -> list[int]:
        return post(tok_http, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert encode(info["eos_token"])[0] == tok_llm.tokenizer.eos_id
    assert encode(info["bos_token"])[0] == tok_llm.tokenizer.bos_id
    ids = encode("The cat sat")
    assert post(tok_http, "/detokenize", {"tokens": ids})["prompt"] == "The cat sat"


# ---------------------------------------------------------------- lm-evaluation-harness itself
@pytest.fixture(scope="module")
def tok_server(path, tmp_path_factory):
    s = MetatpServe(path, "-c", str(N_CTX), log=tmp_path_factory.mktemp("tok") / "serve.log")
    yield s
    s.stop()


@requires("serve")
@requires("lm_eval")
def test_lm_eval_local_completions_scores_a_task_with_the_remote_tokenizer(tok_server, tok_llm):
    """`local-completions` with tokenizer_backend=remote, no tokenizer files: each (context,
    continuation)'s loglikelihood is the sum of the model's log-softmax over the continuation."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=tok_server.base + "/v1/completions", model="m", tokenizer_backend="remote",
                             max_length=N_CTX, max_retries=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(TASK)],
                           disable_tqdm=True)
    tok = tok_llm.tokenizer
    for (context, continuation), (ll, greedy) in zip(TASK, got):
        ctx, cont = tok.encode(context, add_bos=False), tok.encode(continuation, add_bos=False)
        logits = tok_llm.score(ctx + cont).astype(np.float64)
        rows = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits.max(1, keepdims=True)
        want = sum(rows[len(ctx) + i - 1, t] for i, t in enumerate(cont))
        assert ll == pytest.approx(want, rel=1e-4, abs=1e-4), (context, continuation)
        assert greedy == all(rows[len(ctx) + i - 1].argmax() == t for i, t in enumerate(cont))
