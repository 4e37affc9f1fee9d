"""Hostile output constraints against `metatp serve` on the default model with the official
openai client (issue 48): the chained-rule grammar that crashed llguidance, a 1 MB grammar, a
3,000-deep schema sent as a JSON string, 10,000 choices and a 100,000-entry enum are each a 400
naming the field and the limit, or a correct answer; the server stays up, no message carries a
library trace, and /health answers within 100 ms while a constraint is being checked."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path

import pytest

from metatp import request_fields as rf
from support.require import requires
from support.serving import MetatpServe, optional_import

openai = optional_import("openai")
httpx = optional_import("httpx")
jsonschema = optional_import("jsonschema")
pytestmark = [requires("structured"), requires("serve")]

TRACE = re.compile(r"panicked|backtrace|Traceback|\.rs:\d+|<state>|<grammar>|RecursionError", re.I)


def chained_rules(n: int, gbnf: bool = False) -> str:
    if gbnf:
        return "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "a"\n'
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "a"\n'


@pytest.fixture(scope="module")
def hostile_server(default_model, tmp_path_factory):
    s = MetatpServe(str(default_model), "-c", "512", "--parallel", "2", log=tmp_path_factory.mktemp("hostile") / "log",
                    ready=180, alias=None)
    s.model_id = Path(default_model).name
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hostile_client(hostile_server):
    c = hostile_server.client()
    c.model_id = hostile_server.model_id
    return c


def chat(client, max_tokens: int = 8, **extra):
    rf_ = extra.pop("response_format", None)
    r = client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": "Pick one."}],
                                       max_tokens=max_tokens, temperature=0.0, extra_body=extra or None,
                                       **({"response_format": rf_} if rf_ is not None else {}))
    return r.choices[0]


def refused(client, field: str, **extra) -> str:
    """The 400's message for a request whose constraint `extra` must be refused naming `field`."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **extra)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == field, body
    assert not TRACE.search(body["message"]), body["message"]
    return body["message"]


def alive(server) -> None:
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200
    assert server.proc.poll() is None


def health_while(server, call) -> tuple[list[float], float, object]:
    """Run `call()` in a thread and probe /health meanwhile: (the seconds of each probe started
    before the call was seen done, at least one; the call's own seconds; its result or exception)."""
    probes: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.base, timeout=30) as h:
        t0 = time.monotonic()
        fut = pool.submit(call)
        while True:
            t = time.monotonic()
            assert h.get("/health").status_code == 200
            probes.append(time.monotonic() - t)
            if fut.done():
                break
            time.sleep(0.02)
        try:
            result = fut.result()
        except Exception as e:          # the refusal is the result
            result = e
        took = time.monotonic() - t0
    return probes, took, result


def answered_quickly(probes: list[float], bound: float = 1.0) -> None:
    """/health within 100 ms (the median: on a loaded machine a process may wait for a core a
    few hundred ms), and no probe near `bound` (a loop waiting on a check shows its whole time)."""
    assert probes and sorted(probes)[len(probes) // 2] < 0.1 and max(probes) < bound, probes


def test_the_chained_rule_grammar_is_a_400_and_the_server_lives(hostile_server, hostile_client):
    msg = refused(hostile_client, "guided_grammar", guided_grammar=chained_rules(3000))
    assert "crashed" in msg and "guided_grammar" in msg
    alive(hostile_server)
    assert chat(hostile_client, guided_choice=["yes", "no"]).message.content in ("yes", "no")    # serving as before


def test_health_answers_while_a_slow_grammar_is_checked(hostile_server, hostile_client):
    # GBNF of 2,000 chained rules: llguidance converts it to Lark for seconds (quadratic)
    probes, took, result = health_while(hostile_server, lambda: chat(hostile_client, guided_grammar=chained_rules(2000, gbnf=True)))
    if isinstance(result, openai.BadRequestError):        # refused (the stack, the time budget): by name
        assert result.body["param"] == "guided_grammar" and not TRACE.search(result.body["message"]), result.body
    else:                                                 # or compiled: the answer keeps to it
        assert re.fullmatch("a+", result.message.content), result
    assert took > 1.0 and len(probes) >= 5, (took, probes)       # the check was slow; probes saw it
    answered_quickly(probes, min(1.0, took / 2))
    alive(hostile_server)


def test_a_1mb_grammar_is_a_400_naming_the_limit(hostile_server, hostile_client):
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(100_000))
    assert len(grammar) > 1_000_000
    probes, took, result = health_while(hostile_server, lambda: refused(hostile_client, "guided_grammar", guided_grammar=grammar))
    assert isinstance(result, str) and f"over the limit of {rf.MAX_CONSTRAINT_BYTES} bytes" in result, result
    answered_quickly(probes)
    alive(hostile_server)


@pytest.mark.parametrize("field", ["guided_json", "json_schema", "response_format"])
def test_a_3000_deep_schema_string_is_a_400(hostile_server, hostile_client, field):
    schema = '{"type": "array", "items": ' * 3000 + '{"type": "integer"}' + "}" * 3000
    extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
             if field == "response_format" else {field: schema})
    probes, took, msg = health_while(hostile_server, lambda: refused(hostile_client, field, **extra))
    assert isinstance(msg, str) and f"nested deeper than {rf.MAX_JSON_DEPTH} levels" in msg, msg
    answered_quickly(probes)
    alive(hostile_server)


def test_ten_thousand_choices_answer_one_of_them(hostile_server, hostile_client):
    choices = [f"option {i}" for i in range(10_000)]
    probes, took, c = health_while(hostile_server, lambda: chat(hostile_client, max_tokens=16, guided_choice=choices))
    assert c.message.content in choices and c.finish_reason == "stop", c.message.content
    answered_quickly(probes)
    r = hostile_client.completions.create(model=hostile_client.model_id, prompt="My pick:", max_tokens=16, temperature=0.8,
                                  seed=1, extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices


def test_a_100k_enum_is_a_400_and_a_10k_enum_an_answer(hostile_server, hostile_client):
    big = {"type": "object", "required": ["a"], "properties": {"a": {"enum": [f"v{i}" for i in range(100_000)]}}}
    rf_big = {"type": "json_schema", "json_schema": {"name": "e", "schema": big}}
    probes, took, result = health_while(hostile_server, lambda: refused(hostile_client, "response_format", response_format=rf_big))
    assert isinstance(result, str) and "over the limit" in result, result
    answered_quickly(probes)
    small = {"type": "object", "required": ["a"], "additionalProperties": False,
             "properties": {"a": {"enum": [f"v{i}" for i in range(10_000)]}}}
    c = chat(hostile_client, max_tokens=16, response_format={"type": "json_schema", "json_schema": {"name": "e",
                                                                                          "schema": small}})
    jsonschema.validate(json.loads(c.message.content), small)
    alive(hostile_server)


def test_over_the_choice_count_is_a_400_naming_it(hostile_server, hostile_client):
    msg = refused(hostile_client, "guided_choice", guided_choice=[f"c{i}" for i in range(rf.MAX_CHOICES + 1)])
    assert f"over the limit of {rf.MAX_CHOICES}" in msg
    alive(hostile_server)


def test_a_grammar_past_the_parser_rows_is_a_400_not_a_failed_generation(hostile_server, hostile_client):
    grammar = "start: " + " | ".join(f'"word{i}"' for i in range(5000))        # was a 500 mid-generation
    msg = refused(hostile_client, "guided_grammar", guided_grammar=grammar)
    assert "too complex" in msg and "max is 2000" in msg, msg
    alive(hostile_server)
