"""frequency_penalty, presence_penalty, logit_bias, min_tokens and stop_token_ids, applied: in the
Python API (greedy generation equal to a reference loop built on `LLM.score` and the OpenAI
definitions, batch invariance, seeded reproducibility, min_tokens against EOS / stop ids / stop
strings, the llama-cpp-python keywords) and through `metatp serve` with the official `openai`
client (penalties cut a repeating greedy continuation, a -100 bias bans, +100 forces, min_tokens
holds EOS and stop ids back, bad values are a 400 naming the field, defaults change nothing).

The synthetic model repeats one token greedily with a margin of ~20 logits, so presence_penalty
(at most 2) is tested at a near-tie that a logit_bias on the runner-up makes."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from metatp.ir.errors import ConfigError
from metatp.sampling import SamplingParams
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

openai = optional_import("openai")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=21,     # the `path` fixture
                 chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
LLM_OPTIONS = {"n_ctx": 512}                                                       # the `llm` fixture
PROMPT = "the the the the"
EOS = 1                                          # the synthetic vocabulary's <|eos|>
FORCED = 2 + ord("q")                            # its byte token "q" (byte b is token 2 + b)


def reference_greedy(llm, ids: list[int], n: int, freq=0.0, pres=0.0, bias=None, min_tokens=0,
                     end_ids=()) -> list[int]:
    """n greedy tokens, each the argmax of `LLM.score`'s last row after OpenAI's penalties computed
    one token at a time in plain Python (the definitions, not metatp.penalties)."""
    gen: list[int] = []
    for _ in range(n):
        x = llm.score(ids + gen)[-1].astype(np.float64)
        for j, c in collections.Counter(gen).items():
            x[j] -= freq * c + pres * (c > 0)
        for j, b in (bias or {}).items():
            x[j] = -np.inf if b == -100 else x[j] + b
        if len(gen) < min_tokens:
            x[list(end_ids)] = -np.inf
        gen.append(int(np.argmax(x)))
    return gen


def greedy(llm, prompt=PROMPT, n=16, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw))[0].outputs[0]


def repeats(tokens) -> int:
    return len(tokens) - len(set(tokens))


def near_tie_bias(llm, ids: list[int]) -> tuple[int, int, dict[int, float]]:
    """(best, runner-up, a bias putting the runner-up 1 logit below the best at the first step)."""
    row = llm.score(ids)[-1].astype(np.float64)
    best, second = (int(i) for i in np.argsort(-row, kind="stable")[:2])
    return best, second, {second: float(row[best] - row[second] - 1.0)}


# ---------------------------------------------------------------- the Python API
def test_greedy_with_penalties_equals_the_reference_loop(llm):
    ids = llm.prompt_ids(PROMPT)
    _, _, bias = near_tie_bias(llm, ids)
    for kw in (dict(freq=2.0), dict(freq=0.7, pres=1.5), dict(pres=2.0, bias=bias), dict(freq=-1.0, bias={7: 30.0})):
        got = greedy(llm, n=16, frequency_penalty=kw.get("freq", 0.0), presence_penalty=kw.get("pres", 0.0),
                     logit_bias=kw.get("bias")).token_ids
        assert got == reference_greedy(llm, ids, 16, **kw), kw


def test_penalties_change_a_repeating_greedy_continuation(llm):
    plain = greedy(llm, n=24).token_ids
    assert repeats(plain) >= 20                         # the model repeats: the test means something
    for kw in (dict(frequency_penalty=2.0), dict(frequency_penalty=2.0, presence_penalty=2.0)):
        pen = greedy(llm, n=24, **kw).token_ids
        assert pen != plain and repeats(pen) < repeats(plain), kw


def test_presence_penalty_decides_a_near_tie(llm):
    ids = llm.prompt_ids(PROMPT)
    best, second, bias = near_tie_bias(llm, ids)
    plain = greedy(llm, n=6, logit_bias=bias).token_ids
    pen = greedy(llm, n=6, logit_bias=bias, presence_penalty=2.0).token_ids
    assert plain[0] == pen[0] == best and pen != plain and pen[1] != best


def test_a_batch_with_penalties_gives_each_request_what_it_gives_alone(llm):
    prompts = [PROMPT, "once upon a time", PROMPT, "Hello, my name is"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=3, presence_penalty=1.0,
                             logit_bias={103: -100}),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={200: 5.0}, frequency_penalty=-0.5)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


def test_seeded_sampling_with_penalties_is_reproducible(llm):
    sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=11, frequency_penalty=1.2,
                        presence_penalty=0.5, logit_bias={103: -100, 50: 3.0})
    a, b = (llm.generate(PROMPT, sp)[0].outputs[0].token_ids for _ in range(2))
    assert a == b and 103 not in a


def test_min_tokens_holds_eos_back(llm):
    """A +100 bias makes EOS the greedy choice: without min_tokens it ends at once, with 5 it is
    the 6th token (banned before), and the generation stops there."""
    assert greedy(llm, n=16, ignore_eos=False, logit_bias={EOS: 100}).token_ids == [EOS]
    out = greedy(llm, n=16, ignore_eos=False, logit_bias={EOS: 100}, min_tokens=5)
    assert len(out.token_ids) == 6 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:5]
    assert out.finish_reason == "stop"


def test_min_tokens_holds_stop_token_ids_back(llm):
    t0 = greedy(llm, n=1).token_ids[0]
    out = greedy(llm, n=16, stop_token_ids=[t0])
    assert out.token_ids == [t0] and out.finish_reason == "stop" and out.stop_reason == t0
    out = greedy(llm, n=16, stop_token_ids=[t0], min_tokens=3)
    assert len(out.token_ids) >= 3 and t0 not in out.token_ids[:3]
    assert out.token_ids == reference_greedy(llm, llm.prompt_ids(PROMPT), len(out.token_ids), min_tokens=3,
                                             end_ids=[t0])
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == t0 and out.stop_reason == t0


def test_a_stop_string_ends_nothing_before_min_tokens(llm):
    """vLLM's rule: a stop string counts only where it ends in the text of a token after the
    first min_tokens (the tokens are the plain greedy ones: only the text is cut)."""
    plain = greedy(llm, n=16)
    stop = plain.text[0]
    assert greedy(llm, n=16, stop=stop).text == ""
    for m in (1, 4):
        out = greedy(llm, n=16, stop=stop, min_tokens=m)
        head = llm.detokenize(plain.token_ids[:m])
        cut = plain.text.find(stop, max(len(head) - len(stop) + 1, 0))
        assert cut >= 0 and out.text == plain.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop


def test_the_llama_cpp_style_keywords_are_applied(llm):
    t0 = greedy(llm, n=1).token_ids[0]
    kw = dict(max_tokens=10, temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0, logit_bias={t0: -100})
    want = llm.detokenize(greedy(llm, n=10, ignore_eos=False, frequency_penalty=2.0, presence_penalty=1.0,
                                 logit_bias={t0: -100}).token_ids, skip_special=True)
    assert llm.create_completion(PROMPT, **kw)["choices"][0]["text"] == want != greedy(llm, n=10).text
    chat = llm.create_chat_completion([{"role": "user", "content": "hi"}], **kw)
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    with pytest.raises(TypeError, match="mirostat_tau"):
        llm.create_completion(PROMPT, mirostat_tau=5.0)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    from metatp.ir.errors import ConfigError

    with pytest.raises(ConfigError, match="logit_bias.*outside the vocabulary"):
        greedy(llm, logit_bias={llm.n_vocab: 1.0})


# ---------------------------------------------------------------- metatp serve + openai
def Server(model: str, log: Path) -> MetatpServe:
    return MetatpServe(model, "-c", "1024", "--parallel", "4", log=log, ready=120, alias=None)


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    s = Server(path, tmp_path_factory.mktemp("pen-serve") / "server.log")
    c = s.client()
    c.model_id = Path(path).name              # the id the server lists: the model file's name
    yield c
    s.stop()


def complete(client, n=16, **extra):
    """A greedy completion of PROMPT (ignore_eos unless extra says), with its tokens' pieces."""
    kw = {k: extra.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias", "seed", "temperature")
          if k in extra}
    r = client.completions.create(model=client.model_id, prompt=PROMPT, max_tokens=n, logprobs=0,
                                  **{"temperature": 0.0, **kw}, extra_body={"ignore_eos": True, **extra})
    return r


serve = requires("serve")


def pieces(r) -> list[str]:
    return r.choices[0].logprobs.tokens


@serve
def test_server_penalties_cut_the_repeats(client, llm):
    plain = pieces(complete(client, 24))
    assert repeats(plain) >= 20
    for kw in (dict(frequency_penalty=2.0), dict(frequency_penalty=2.0, presence_penalty=2.0)):
        pen = complete(client, 24, **kw)
        assert pieces(pen) != plain and repeats(pieces(pen)) < repeats(plain), kw
        assert pen.choices[0].text == greedy(llm, n=24, **kw).text      # what the Python API gives
    _, second, bias = near_tie_bias(llm, llm.prompt_ids(PROMPT))
    got = complete(client, 6, presence_penalty=2.0, logit_bias={str(second): bias[second]}).choices[0].text
    assert got == greedy(llm, n=6, presence_penalty=2.0, logit_bias=bias).text != greedy(llm, n=6, logit_bias=bias).text


@serve
def test_server_a_banned_token_never_appears_and_a_forced_one_always_does(client, llm):
    t0 = greedy(llm, n=1).token_ids[0]
    banned = llm.tokenizer.token_bytes(t0).decode()
    assert len(banned) == 1 and llm.tokenize(banned, add_bos=False) == [t0]    # the only token with this piece
    assert banned in pieces(complete(client, 16, temperature=1.0, seed=0))     # it is likely without the ban
    for temperature, seeds in ((0.0, [None]), (1.0, range(5))):
        for seed in seeds:
            r = complete(client, 16, temperature=temperature, seed=seed, logit_bias={str(t0): -100})
            assert banned not in pieces(r) and len(pieces(r)) == 16, (temperature, seed)
    assert set(pieces(complete(client, 8, logit_bias={str(FORCED): 100}))) == {"q"}
    assert set(pieces(complete(client, 8, temperature=1.0, seed=2, logit_bias={str(FORCED): 100}))) == {"q"}


@serve
def test_server_min_tokens_holds_eos_and_stop_ids_back(client, llm):
    r = complete(client, 16, ignore_eos=False, logit_bias={str(EOS): 100})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = complete(client, 16, ignore_eos=False, logit_bias={str(EOS): 100}, min_tokens=5)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    t0 = greedy(llm, n=1).token_ids[0]
    r = complete(client, 16, stop_token_ids=[t0])
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    r = complete(client, 16, stop_token_ids=[t0], min_tokens=3)
    want = greedy(llm, n=16, stop_token_ids=[t0], min_tokens=3)
    assert r.usage.completion_tokens == len(want.token_ids) >= 3 and r.choices[0].text == want.text


@serve
@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", "1"),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"-5": 1}), ("logit_bias", {"5": 100.5}), ("logit_bias", {"5": True}),
    ("logit_bias", [5, 1]), ("logit_bias", {"100000": 1}), ("logit_bias", {"9" * 5000: 1}),
    ("logit_bias", {"5": 10 ** 400}), ("frequency_penalty", 10 ** 400), ("temperature", 10 ** 400),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", 20), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("stop_token_ids", [10 ** 6]),
])
def test_server_bad_values_are_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=client.model_id, prompt=PROMPT, max_tokens=10, extra_body={field: value})
    assert e.value.status_code == 400 and field in str(e.value)
    assert e.value.body["param"] == field


@serve
def test_server_defaults_leave_outputs_bit_identical(client):
    defaults = dict(frequency_penalty=0.0, presence_penalty=0.0, logit_bias={}, min_tokens=0, stop_token_ids=[])
    for kw in (dict(), dict(temperature=1.0, seed=9)):
        a = complete(client, 16, **kw)
        b = complete(client, 16, **kw, **defaults)
        assert a.choices[0].text == b.choices[0].text
        assert a.choices[0].logprobs.token_logprobs == b.choices[0].logprobs.token_logprobs


@serve
def test_server_chat_applies_them_as_the_python_api_does(client, llm):
    msgs = [{"role": "user", "content": PROMPT}]
    plain = llm.create_chat_completion(msgs, max_tokens=12, temperature=0.0)["choices"][0]["message"]["content"]
    first = llm.tokenize(plain[0], add_bos=False)[0]
    kw = dict(frequency_penalty=2.0, presence_penalty=1.0)
    want = llm.create_chat_completion(msgs, max_tokens=12, temperature=0.0, logit_bias={first: -100}, **kw)
    r = client.chat.completions.create(model=client.model_id, messages=msgs, max_tokens=12, temperature=0.0,
                                       logit_bias={str(first): -100}, **kw)
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"] != plain
    assert plain[0] not in r.choices[0].message.content[:1]


@serve
def test_server_streams_what_it_answers_with_min_tokens_and_a_stop_string(client, llm):
    stop = greedy(llm, n=1).text
    for m in (0, 3):
        extra = {"ignore_eos": True, "min_tokens": m}
        whole = client.completions.create(model=client.model_id, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                          stop=[stop], extra_body=extra).choices[0]
        chunks = client.completions.create(model=client.model_id, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                           stop=[stop], extra_body=extra, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == whole.text == greedy(llm, n=16, stop=stop, min_tokens=m).text
        assert (whole.text != "") == (m > 0) and whole.finish_reason == "stop"


@serve
def test_python_chat_logprobs_are_the_servers(client, llm):
    """llama-cpp-python's `logprobs` / `top_logprobs` on `LLM.create_chat_completion`: the same
    content, tokens, logprobs and alternatives as the server's chat answer for the same request."""
    msgs = [{"role": "user", "content": PROMPT}]
    served = client.chat.completions.create(model=client.model_id, messages=msgs, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2).choices[0]
    mine = llm.create_chat_completion(msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)["choices"][0]
    assert mine["message"]["content"] == served.message.content
    got, want = mine["logprobs"]["content"], served.logprobs.content
    assert [e["token"] for e in got] == [e.token for e in want]
    assert [e["logprob"] for e in got] == pytest.approx([e.logprob for e in want], rel=1e-6, abs=1e-7)
    assert [[t["token"] for t in e["top_logprobs"]] for e in got] == [[t.token for t in e.top_logprobs] for e in want]
    assert llm.create_chat_completion(msgs, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None
    with pytest.raises(ConfigError, match="top_logprobs needs logprobs"):
        llm.create_chat_completion(msgs, max_tokens=2, top_logprobs=2)
    with pytest.raises(ConfigError, match="top_logprobs must be"):
        llm.create_chat_completion(msgs, max_tokens=2, logprobs=True, top_logprobs=21)
