"""Structured output (metatp.structured, llguidance): the mask on a synthetic model (banned tokens
never sampled, greedy or not; choices and regexes matched whole; a request without a constraint
does no work), and on the default model through `LLM.generate` and through `metatp serve` with the
official `openai` client: json_object output parses, json_schema output validates (jsonschema),
guided_choice gives one choice, guided_regex output fullmatches, bad constraints are a
ConfigError / a 400 naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import numpy as np
import pytest

from metatp.ir.errors import ConfigError
from metatp.sampling import Sampler, SamplingParams
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

openai = optional_import("openai")
jsonschema = optional_import("jsonschema")     # the "structured" prerequisite (pytestmark) requires it
pytestmark = requires("structured")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=5)     # the `path` fixture
LLM_OPTIONS = {"n_ctx": 512}                                                       # the `llm` fixture

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}}
COLORS = {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}
MOOD = {"type": "object", "additionalProperties": False, "required": ["mood"],
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}}}
SCHEMAS = [("Describe a person and where they live.", PERSON), ("List some colors.", COLORS),
           ("How do you feel today?", MOOD)]
# prompts whose greedy JSON objects end within 64 tokens on the default model
JSON_PROMPTS = ["What is the capital of France?", "Name a fruit.", "What is 2+2?", "Give me a city and its country.",
                "What is the boiling point of water?", "Name a planet.", "What is the capital of Japan?",
                "Name an animal.", "What language is spoken in Spain?", "Who painted the Mona Lisa?"]
JSON_SYSTEM = "Answer in JSON with one short key."
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}"


def _chat(llm, question: str, system: str | None = None) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return llm.tokenizer.apply_chat_template(msgs)


# ---------------------------------------------------------------- the mask, on the synthetic model
def test_sampler_never_picks_a_masked_token():
    logits = np.array([5.0, 1.0, 4.0, 3.0], dtype=np.float32)
    allowed = np.array([False, True, False, True])
    rng = np.random.default_rng(0)
    assert Sampler(SamplingParams(temperature=0.0), rng)(logits, allowed=allowed) == 3               # greedy: the best allowed
    hot = Sampler(SamplingParams(temperature=5.0, seed=1), rng)
    assert {hot(logits, allowed=allowed) for _ in range(200)} == {1, 3}
    assert Sampler(SamplingParams(temperature=0.0), rng)(logits) == 0                                # no mask: untouched
    padded = np.append(logits, np.float32(9.0))                                      # an id past the mask
    assert Sampler(SamplingParams(temperature=0.0), rng)(padded, allowed=allowed) == 3
    bans = SamplingParams(temperature=0.0, logit_bias={1: -100, 3: -100})                             # bans meet the mask
    assert Sampler(bans, rng)(logits, allowed=allowed) in (1, 3)


def test_no_constraint_means_no_guide(llm):
    from metatp.runner import SamplingState

    assert SamplingParams().constraint is None
    rng = np.random.default_rng(0)
    assert SamplingState(SamplingParams(), rng, (), llm.tokenizer).guide is None
    assert SamplingState(SamplingParams(guided_regex="a+"), rng, (), llm.tokenizer).guide is not None


def test_every_allowed_token_fits_and_banned_ones_do_not(llm):
    from metatp.structured import Guide

    g = SamplingParams(guided_regex=r"ab+c").constraint
    guide = Guide(g, llm.tokenizer)
    allowed = guide.allowed()
    assert allowed.shape == (llm.n_vocab,) and 0 < allowed.sum() < llm.n_vocab
    for t in range(llm.n_vocab):
        piece = llm.tokenizer.token_bytes(t)
        fits = bool(piece) and not llm.tokenizer.is_special(t) and re.fullmatch(rb"a(b+c?)?", piece) is not None
        assert allowed[t] == fits, (t, piece)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_synthetic_model_follows_choice_and_regex(llm, temperature):
    for seed in range(3):
        sp = dict(temperature=temperature, seed=seed, max_tokens=32)
        out = llm.generate("hello", SamplingParams(guided_choice=["alpha", "beta", "gamma"], **sp))[0].outputs[0]
        assert out.text in ("alpha", "beta", "gamma") and out.finish_reason == "stop"
        out = llm.generate("hello", SamplingParams(guided_regex=r"[a-c]{3}-[0-9]{2}", **sp))[0].outputs[0]
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out.text) and out.finish_reason == "stop", out.text


def test_bad_constraints_are_config_errors_naming_the_field():
    for kw, field in [(dict(json_schema={"type": "foo"}), "json_schema"), (dict(json_schema="{not json"), "json_schema"),
                      (dict(guided_regex="(["), "guided_regex"), (dict(guided_choice=[]), "guided_choice"),
                      (dict(guided_grammar="start: foo bar"), "guided_grammar"),
                      (dict(json_object=True, guided_regex="a"), "json_object")]:
        with pytest.raises(ConfigError, match=f"^{field}"):
            SamplingParams(**kw)


def test_gbnf_and_lark_grammars(llm):
    for grammar in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        out = llm.generate("hi", SamplingParams(temperature=0.0, guided_grammar=grammar, max_tokens=8))[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


# ---------------------------------------------------------------- the default model, Python API
def test_python_api_json_object(default_llm):
    outs = default_llm.generate([_chat(default_llm, q, JSON_SYSTEM) for q in JSON_PROMPTS[:4]],
                                SamplingParams(temperature=0.0, max_tokens=64, json_object=True))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        assert isinstance(json.loads(o.outputs[0].text), dict)


def test_python_api_json_schema(default_llm):
    question, schema = SCHEMAS[0]
    out = default_llm.generate(_chat(default_llm, question), SamplingParams(temperature=0.0, max_tokens=64, json_schema=schema))[0]
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_python_api_choice_and_regex(default_llm):
    prompt = _chat(default_llm, "Is the sky blue?")
    out = default_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, guided_choice=CHOICES))[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"
    out = default_llm.generate(_chat(default_llm, "A name and an age?"),
                               SamplingParams(temperature=0.0, max_tokens=16, guided_regex=REGEX))[0].outputs[0]
    assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop", out.text


def test_python_api_bad_schema(default_llm):
    with pytest.raises(ConfigError, match="json_schema"):
        default_llm.generate("x", SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": 3}}}))


# ---------------------------------------------------------------- metatp serve + openai, default model
def Server(model: str, log: Path) -> MetatpServe:
    return MetatpServe(model, "-c", "512", "--parallel", "4", log=log, ready=180, alias=None)


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    """An openai client of `metatp serve` on the default model (n_ctx 512, 4 slots)."""
    s = Server(str(default_model), tmp_path_factory.mktemp("structured-serve") / "server.log")
    c = s.client()
    c.model_id = Path(default_model).name
    yield c
    s.stop()


serve = requires("serve")


def chat(client, question: str, system: str | None = None, max_tokens: int = 64, **extra):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    rf = extra.pop("response_format", None)
    kw = {"response_format": rf} if rf is not None else {}
    r = client.chat.completions.create(model=client.model_id, messages=msgs, max_tokens=max_tokens, temperature=0.0,
                                       extra_body=extra or None, **kw)
    return r.choices[0]


@serve
def test_server_json_object_parses(served):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda q: chat(served, q, JSON_SYSTEM, response_format={"type": "json_object"}),
                            JSON_PROMPTS))
    for q, c in zip(JSON_PROMPTS, got):
        assert c.finish_reason == "stop", (q, c.message.content)
        assert isinstance(json.loads(c.message.content), dict), q
    plain = chat(served, JSON_PROMPTS[0], JSON_SYSTEM, response_format={"type": "text"})
    assert plain.message.content != got[0].message.content         # text: unconstrained (the model's own words)


@serve
def test_server_json_schema_validates(served):
    for question, schema in SCHEMAS:
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        c = chat(served, question, response_format=rf)
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
    question, schema = SCHEMAS[2]         # vLLM's and llama-server's spellings, and the completions route
    for field in ("guided_json", "json_schema"):
        jsonschema.validate(json.loads(chat(served, question, **{field: schema}).message.content), schema)
    r = served.completions.create(model=served.model_id, prompt="My mood as JSON: ", max_tokens=32, temperature=0.0,
                                  extra_body={"guided_json": schema})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)


@serve
def test_server_choice_regex_and_grammar(served):
    c = chat(served, "Is the sky blue?", max_tokens=8, guided_choice=CHOICES)
    assert c.message.content in CHOICES and c.finish_reason == "stop"
    c = chat(served, "A name and an age?", max_tokens=16, guided_regex=REGEX)
    assert re.fullmatch(REGEX, c.message.content) and c.finish_reason == "stop", c.message.content
    c = chat(served, "Is the sky blue?", max_tokens=8, grammar='root ::= "Yes" | "No"')      # llama-server: GBNF
    assert c.message.content in ("Yes", "No")


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": 7}}}}, "guided_json"),
    ({"guided_regex": "(["}, "guided_regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
@serve
def test_server_bad_constraint_is_a_400_naming_the_field(served, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        chat(served, "hi", max_tokens=4, **extra)
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body
    assert field in e.value.body["message"]


def test_fields_map_to_one_constraint():
    from metatp.server.fields import BadRequest, sampling_params

    def params(**body):
        return sampling_params(body, None, 16)

    assert params().constraint is None and params(response_format={"type": "text"}).constraint is None
    assert params(response_format={"type": "json_object"}).json_object is True
    rf = {"type": "json_schema", "json_schema": {"name": "m", "schema": MOOD, "strict": True}}
    assert params(response_format=rf).json_schema == MOOD == params(guided_json=MOOD).json_schema
    assert params(json_schema=MOOD).json_schema == MOOD                                  # llama-server's
    assert params(grammar='root ::= "a"').guided_grammar == 'root ::= "a"'
    assert params(response_format={"type": "text"}, guided_regex="a+").guided_regex == "a+"
    for body, field in [({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                        ({"guided_choice": "yes"}, "guided_choice"), ({"json_schema": {"type": "foo"}}, "json_schema"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": MOOD, "strict": 1}}},
                         "response_format")]:
        with pytest.raises(BadRequest) as e:
            params(**body)
        assert e.value.param == field and e.value.status == 400, (body, e.value.message)
