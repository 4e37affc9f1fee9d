"""One check per request field (metatp.request_fields): SamplingParams, LLM.create_completion /
create_chat_completion and the HTTP routes refuse the same bad value through the same check --
the Python API with one message, the server with the 400 that names the field in OpenAI's
wording -- and chat messages become token ids one way for the API and the server."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metatp.server
from metatp import LLM, SamplingParams
from metatp import request_fields as rf
from metatp.ir.errors import ConfigError
from metatp.openai_messages import chat_prompt_ids
from metatp.request_fields import API, HTTP, FieldError
from metatp.testing.synth import SynthSpec
from support.require import requires

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=45, chat_template=TEMPLATE)
LLM_OPTIONS = {"n_ctx": 256}          # the `llm` fixture (tests/conftest.py)
MESSAGES = [{"role": "user", "content": "hi"}]

def stop_token_ids(v, where):
    return rf.token_ids("stop_token_ids", v, where)


def min_tokens(v, where):
    """min_tokens' own check (the Python API's also holds it to max_tokens, here None)."""
    return rf.min_tokens(v, None) if where == API else rf.MIN_TOKENS.check(v, where)


# (field, bad value, its check, the llama-cpp-python keyword that sets it: None where create_* has none)
SHARED = [
    ("temperature", -0.5, rf.TEMPERATURE.check, "temperature"),
    ("temperature", "hot", rf.TEMPERATURE.check, "temperature"),
    ("top_p", 0, rf.TOP_P.check, "top_p"),
    ("min_p", 1.5, rf.MIN_P.check, "min_p"),
    ("repetition_penalty", 0, rf.REPETITION_PENALTY.check, "repeat_penalty"),
    ("frequency_penalty", 2.5, rf.FREQUENCY_PENALTY.check, "frequency_penalty"),
    ("presence_penalty", -3, rf.PRESENCE_PENALTY.check, "presence_penalty"),
    ("seed", -2, rf.SEED.check, "seed"),
    ("seed", 1.5, rf.SEED.check, "seed"),
    ("max_tokens", -1, rf.MAX_TOKENS.check, "max_tokens"),
    ("stop", 5, rf.stop, "stop"),
    ("stop_token_ids", [-1], stop_token_ids, "stop_token_ids"),
    ("min_tokens", -1, min_tokens, "min_tokens"),
    ("n", 0, rf.N.check, None),
    ("top_k", 2.5, rf.TOP_K.check, None),         # llama-cpp-python's top_k is its own rule (any integer)
    ("ignore_eos", "yes", rf.IGNORE_EOS.check, None),
]
IDS = [f"{f}={v!r}" for f, v, *_ in SHARED]


def refusal(check, value, where) -> FieldError:
    with pytest.raises(FieldError) as e:
        check(value, where)
    return e.value


@pytest.fixture(scope="module")
def http(path):
    """The real app (metatp.server.create_app) over its own LLM, through FastAPI's test client."""
    from metatp.server import create_app
    from support.serving import optional_import

    testclient = optional_import("fastapi.testclient")
    app = create_app(LLM(path, backend="numpy", **LLM_OPTIONS), max_model_len=LLM_OPTIONS["n_ctx"])
    with testclient.TestClient(app) as client:
        yield client


@pytest.mark.parametrize("field, value, check, keyword", SHARED, ids=IDS)
def test_sampling_params_and_the_completions_refuse_with_the_fields_one_message(llm, field, value, check, keyword):
    want = refusal(check, value, API)
    assert want.field == field and str(want).startswith(field), str(want)
    with pytest.raises(FieldError) as got:
        SamplingParams(**{field: value})
    assert (got.value.field, str(got.value)) == (field, str(want))
    if keyword is None:
        return
    for call in (lambda: llm.create_completion("hi", **{keyword: value}),
                 lambda: llm.create_chat_completion(MESSAGES, **{keyword: value})):
        with pytest.raises(ConfigError) as got:
            call()
        assert str(got.value) == str(want)


@requires("serve")
@pytest.mark.parametrize("field, value, check, keyword", SHARED, ids=IDS)
def test_the_routes_refuse_with_a_400_naming_the_field_from_the_same_check(http, field, value, check, keyword):
    want = refusal(check, value, HTTP)
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = http.post(route, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["message"], err["type"]) == (field, str(want), "invalid_request_error")


def test_each_door_keeps_its_wording_of_one_verdict():
    """The Python API speaks Python, the server OpenAI's JSON (and OpenAI's tighter bounds)."""
    assert str(refusal(rf.TEMPERATURE.check, -0.5, API)) == "temperature must be >= 0.0, got -0.5"
    assert str(refusal(rf.TEMPERATURE.check, -0.5, HTTP)) == \
        "'temperature' must be a number >= 0.0 and <= 2.0, got -0.5"
    assert str(refusal(rf.TEMPERATURE.check, math.nan, API)) == "temperature must be a finite number, got nan (float)"
    assert str(refusal(rf.N.check, True, API)) == "n must be an integer from 1 to 1024 (samples per prompt), got True"
    assert str(refusal(rf.N.check, True, HTTP)) == "'n' must be an integer from 1 to 16, got true"
    assert str(refusal(rf.STREAM.check, "yes", API)) == "stream must be True or False, got 'yes' (str)"
    assert str(refusal(rf.IGNORE_EOS.check, "yes", API)) == "ignore_eos must be True or False, got 'yes'"
    assert str(refusal(rf.STREAM.check, "yes", HTTP)) == "'stream' must be true or false, got \"yes\""
    assert str(refusal(rf.stop, ["a"] * 17, HTTP)).startswith("'stop' must be a string or a list of at most 16")
    assert rf.stop(["a"] * 17) == ["a"] * 17
    assert rf.TEMPERATURE.check(3.0) == 3.0 and rf.N.check(17) == 17 and rf.SEED.check(2 ** 63) == 2 ** 63
    for check, value in ((rf.TEMPERATURE.check, 3.0), (rf.N.check, 17), (rf.SEED.check, 2 ** 63),
                         (rf.REPETITION_PENALTY.check, 10.5)):
        refusal(check, value, HTTP)


JSON_SCALARS = st.one_of(st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
                        st.text(max_size=4))
JSON_VALUES = st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=4))
# the fields whose bounds the two doors share (the server's tighter ones: test_each_door_keeps_its_wording...)
SAME_BOUNDS = [rf.TOP_P, rf.MIN_P, rf.FREQUENCY_PENALTY, rf.PRESENCE_PENALTY, rf.TOP_K, rf.MAX_TOKENS, rf.LOGPROBS,
               rf.PROMPT_LOGPROBS, rf.TOP_LOGPROBS, rf.MIN_TOKENS, rf.IGNORE_EOS, rf.STREAM]


def verdict(check, value, where):
    try:
        return check(value, where)
    except FieldError as e:
        return FieldError, e.field


@settings(max_examples=300, deadline=None)
@given(spec=st.sampled_from(SAME_BOUNDS), value=JSON_VALUES)
def test_both_doors_give_one_verdict_on_any_json_value(spec, value):
    assert verdict(spec.check, value, API) == verdict(spec.check, value, HTTP)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES)
def test_both_doors_give_one_verdict_on_stop_and_stop_token_ids(value):
    assert verdict(rf.stop, value, API) == verdict(rf.stop, value, HTTP)
    assert verdict(stop_token_ids, value, API) == verdict(stop_token_ids, value, HTTP)


def test_logit_bias_is_one_check_over_both_key_spellings():
    assert rf.logit_bias({5: -100, 7: 2}) == rf.logit_bias({"5": -100, "7": 2}, HTTP) == {5: -100.0, 7: 2.0}
    for bias in (101, math.inf, True, "1"):
        api, http = refusal(rf.logit_bias, {5: bias}, API), refusal(rf.logit_bias, {"5": bias}, HTTP)
        assert api.field == http.field == "logit_bias"
        assert str(api).startswith("logit_bias: the bias of token 5 must be a number from -100 to 100")
        assert str(http).startswith("'logit_bias' values must be numbers from -100 to 100")
    assert "token ids must be integers >= 0" in str(refusal(rf.logit_bias, {-1: 1.0}, API))
    assert "keys must be token ids" in str(refusal(rf.logit_bias, {"-1": 1.0}, HTTP))


@requires("serve")
def test_logit_bias_and_logprobs_refusals_match_across_the_doors(llm, http):
    with pytest.raises(FieldError) as api:
        llm.create_completion("hi", logit_bias={5: 101})
    r = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"5": 101}})
    assert r.status_code == 400 and r.json()["error"]["param"] == api.value.field == "logit_bias"
    assert r.json()["error"]["message"] == str(refusal(rf.logit_bias, {"5": 101}, HTTP))
    with pytest.raises(FieldError) as api:
        llm.create_completion("hi", logprobs=21)
    assert str(api.value) == str(refusal(rf.LOGPROBS.check, 21, API))
    r = http.post("/v1/completions", json={"prompt": "hi", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"] == {"message": str(refusal(rf.LOGPROBS.check, 21, HTTP)),
                                                          "type": "invalid_request_error", "param": "logprobs",
                                                          "code": None}


@requires("serve")
def test_top_logprobs_needs_logprobs_in_both_doors(llm, http):
    with pytest.raises(FieldError, match=r"^top_logprobs needs logprobs=True$") as api:
        llm.create_chat_completion(MESSAGES, top_logprobs=2)
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == api.value.field == "top_logprobs"
    assert r.json()["error"]["message"] == "'top_logprobs' needs 'logprobs': true"
    assert rf.chat_logprobs(True, 3) == 3 and rf.chat_logprobs(True, None) == 0 and rf.chat_logprobs(False, 0) is None


# ---------------------------------------------------------------- chat messages -> token ids, once
BAD_MESSAGES = ["hello", {"role": "user"}, [{"content": "x"}], [{"role": 1, "content": "x"}],
                [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "user", "content": [{"type": "text", "text": 3}]}]]


@requires("serve")
@pytest.mark.parametrize("messages", BAD_MESSAGES, ids=repr)
def test_bad_messages_are_refused_alike(llm, http, messages):
    with pytest.raises(FieldError) as api:
        llm.create_chat_completion(messages, max_tokens=1)
    assert api.value.field == "messages" and str(api.value).startswith("messages")
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == ("messages", str(api.value))


@requires("serve")
def test_chat_prompts_are_the_same_ids_for_the_api_and_the_server(llm, http):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}]
    ids = chat_prompt_ids(llm.tokenizer, msgs)
    assert ids == llm.tokenize(llm.tokenizer.apply_chat_template(
        [msgs[0], {"role": "user", "content": "a\nb"}], add_generation_prompt=True), special=True)
    mine = llm.create_chat_completion(msgs, max_tokens=3, temperature=0.0)
    served = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0}).json()
    assert mine["usage"]["prompt_tokens"] == served["usage"]["prompt_tokens"] == len(ids)
    assert mine["choices"][0]["message"] == served["choices"][0]["message"]


class _NoTemplate:
    def apply_chat_template(self, messages, **kwargs):
        raise ConfigError("this model has no chat template (tokenizer.chat_template)")


def test_a_template_that_refuses_the_messages_is_a_field_error_naming_them():
    with pytest.raises(FieldError, match="no chat template") as e:
        chat_prompt_ids(_NoTemplate(), MESSAGES)
    assert e.value.field == "messages"


# ---------------------------------------------------------------- token ids a route names
@requires("serve")
def test_detokenize_refuses_ids_outside_the_vocabulary_naming_tokens(llm, http):
    r = http.post("/detokenize", json={"tokens": [1, llm.n_vocab]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tokens"
    assert r.json()["error"]["message"] == f"token id {llm.n_vocab} is out of range for a vocabulary of {llm.n_vocab}"
    with pytest.raises(FieldError, match=f"^ids: token id {llm.n_vocab} is out of range"):
        llm.detokenize([1, llm.n_vocab])
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": "", "prompt": ""}


def test_the_routes_call_no_private_name_of_the_frontend():
    """The routes use the Frontend (`srv`) through its public names only."""
    found = []
    for path in sorted(Path(metatp.server.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and ast.unparse(node.value) == "srv"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_field_wordings_are_written_once():
    """The wording of a field's refusal lives in metatp/request_fields.py alone: none of the
    modules a request passes through on its way in words a bound of its own."""
    root = Path(metatp.server.__file__).parent.parent
    modules = [root / "api.py", root / "llama_completions.py", root / "embedding_methods.py", root / "sampling.py",
               root / "openai_api.py", root / "openai_answers.py", root / "openai_messages.py",
               *sorted((root / "server").glob("*.py"))]
    phrases = ("must be a finite number", "must be a number", "must be an integer from", "or an integer from 0 to 20",
               "must be a string or a list of", "(integers >= 0)", "from -100 to 100")
    found = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{path.name}:{node.lineno}: {p}" for p in phrases if p in node.value]
    assert not found, found


def test_a_field_error_pickles_whole():
    """Under MPI an error raised on rank 0 reaches the other ranks pickled (metatp.mpi_calls): it
    must arrive as the same type with the same field, not as a generic error."""
    import pickle

    from metatp.request_fields import FieldError

    e = FieldError("prompt", "token id 7 is out of range")
    e.every_rank = True
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.field, str(back), back.every_rank) == (FieldError, "prompt", str(e), True)
