"""Logprobs list exactly the tokens of the returned text (issue 47 item 4): the end-of-generation
token adds no text (it is listed with "", as lm-evaluation-harness needs it), a matched stop
string's tokens are not listed, a stop string that begins inside a token lists that token with its
text before the stop, and the listed tokens' texts join to the text --
in the output processor (any tokens, any stop string: hypothesis), and through the server's
completions and chat answers, whole, streamed and with n=2, with the official `openai` client."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from metatp import LLM
from metatp.output_processor import OutputProcessor, TokenEvent
from metatp.sampling import SamplingParams
from metatp.testing.synth import SynthSpec
from support.serving import optional_import

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=49, chat_template=TEMPLATE)
N_CTX = 128
MODEL = "lp-model"


@pytest.fixture(scope="module")
def lp_llm(path):
    return LLM(path, backend="numpy", n_ctx=N_CTX)


def run(llm, ids: list[int], stop: list[str] | None = None, end: str = "eos", min_tokens: int = 0) -> list:
    """The outputs of `ids` generated then ended: by the EOS token after them ("eos") or by max_tokens
    on the last one ("length"); a stop string may end them first."""
    proc = OutputProcessor(SamplingParams(stop=stop, min_tokens=min_tokens), llm.tokenizer)
    outs = []
    events = [TokenEvent(t) for t in ids]
    if end == "eos":
        events.append(TokenEvent(llm.tokenizer.eos_id, "stop", end_token=True))
    else:
        events[-1] = TokenEvent(ids[-1], "length")
    for ev in events:
        outs.append(proc.process(ev))
        if outs[-1].finish_reason is not None:
            break
    return outs


def assert_spelled(outs: list, ids: list[int]) -> str:
    """Each output's tokens spell its text, in order a prefix of `ids` (and the EOS that ended
    them); the whole text returned."""
    for o in outs:
        assert "".join(t.text for t in o.tokens) == o.text, o
    listed = [t.token for o in outs for t in o.tokens]
    ended = ids + [outs[-1].token] if outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None else ids
    assert listed == ended[:len(listed)]
    return "".join(o.text for o in outs)


def test_a_character_split_over_tokens_is_listed_whole_and_eos_with_no_text(lp_llm):
    tok = lp_llm.tokenizer
    ids = tok.encode("hé", add_bos=False)
    assert len(ids) >= 3 and tok.token_text(ids[-2]) == "\ufffd"          # é is two byte tokens here
    outs = run(lp_llm, ids)
    assert assert_spelled(outs, ids) == "hé"
    assert [t.token for o in outs for t in o.tokens] == ids + [tok.eos_id]    # every token, and the EOS
    assert [t.text for t in outs[-2].tokens] == ["", "é"] and outs[-2].text == "é"
    assert outs[-3].tokens == [] and outs[-3].text == ""                  # the first half waits with its text
    assert outs[-1].finish_reason == "stop" and [(t.token, t.text) for t in outs[-1].tokens] == [(tok.eos_id, "")]


def test_a_stop_string_inside_a_token_cuts_the_text_and_that_tokens_text(lp_llm):
    tok = lp_llm.tokenizer
    ids = tok.encode("the tea is hot", add_bos=False)
    texts = [tok.token_text(t) for t in ids]
    k = next(i for i, t in enumerate(texts) if len(t) >= 2 and i > 0)
    start = sum(len(t) for t in texts[:k]) + 1                            # the stop begins inside token k
    full = "".join(texts)
    stop = next(full[start:start + n] for n in range(2, 6) if full.index(full[start:start + n]) == start)
    outs = run(lp_llm, ids, [stop])
    text = assert_spelled(outs, ids)
    assert text == full[:start] and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    last = outs[-1].tokens[-1] if outs[-1].tokens else [t for o in outs for t in o.tokens][-1]
    assert last.token == ids[k] and last.text == texts[k][:1]                # its part before the stop
    assert len([t for o in outs for t in o.tokens]) == k + 1                 # nothing of the stop string after it


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_tokens_and_stop_string_are_spelled_by_the_listed_tokens(lp_llm, data):
    tok = lp_llm.tokenizer
    ordinary = [i for i in range(lp_llm.n_vocab) if not tok.is_special(i)]
    ids = data.draw(st.lists(st.sampled_from(ordinary), min_size=1, max_size=12), label="ids")
    full = tok.decode(ids, skip_special=True)
    stop = None
    if full and data.draw(st.booleans(), label="with a stop"):
        a = data.draw(st.integers(0, len(full) - 1), label="stop start")
        stop = full[a:a + data.draw(st.integers(1, 4), label="stop length")]
    end = data.draw(st.sampled_from(["eos", "length"]), label="end")
    text = assert_spelled(run(lp_llm, ids, [stop] if stop else None, end), ids)
    assert text == (full[:full.index(stop)] if stop else full)


# ---------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def lp_client(lp_llm):
    """The official openai client on the in-process app."""
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    openai = optional_import("openai")
    with testclient.TestClient(create_app(lp_llm, model_name=MODEL, max_model_len=N_CTX)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def stop_inside_a_token(client, prompt: str) -> tuple[str, str]:
    """A stop string of the greedy completion that begins inside one of its tokens, and the text before it."""
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    full, lp = r.choices[0].text, r.choices[0].logprobs
    for tok_text, at in zip(lp.tokens, lp.text_offset):
        if len(tok_text) >= 2 and at > 0:
            for n in range(2, 6):
                stop = full[at + 1:at + 1 + n]
                if len(stop) == n and full.index(stop) == at + 1:
                    return stop, full[:at + 1]
    pytest.fail(f"no stop string inside a token of {full!r}")


def eos_bias(client_llm) -> dict:
    return {"logit_bias": {str(client_llm.tokenizer.eos_id): 100}, "min_tokens": 3}


def completion_spelled(choice) -> None:
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)


def test_completions_logprobs_list_eos_with_no_text_and_leave_out_the_stop_string(lp_client, lp_llm):
    r = lp_client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0, logprobs=2,
                                     extra_body=eos_bias(lp_llm))
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 4     # 3 tokens, then the EOS
    completion_spelled(choice)
    assert len(choice.logprobs.tokens) == 4 and choice.logprobs.tokens[-1] == ""      # the EOS: no text
    stop, before = stop_inside_a_token(lp_client, "abc")
    r = lp_client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, logprobs=2,
                                     stop=[stop])
    assert r.choices[0].text == before and r.choices[0].finish_reason == "stop"
    completion_spelled(r.choices[0])


def test_completions_streams_and_n2_spell_their_text(lp_client, lp_llm):
    stop, before = stop_inside_a_token(lp_client, "xyz")
    for extra in ({"stop": [stop]}, {"extra_body": eos_bias(lp_llm)}):
        whole = lp_client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0, logprobs=1,
                                             **extra)
        chunks = [c.choices[0] for c in lp_client.completions.create(
            model=MODEL, prompt="xyz", max_tokens=16, temperature=0, logprobs=1, stream=True, **extra)]
        for c in chunks:
            if c.logprobs is not None:
                assert "".join(c.logprobs.tokens) == c.text          # each chunk: its text's tokens
        assert "".join(c.text for c in chunks) == whole.choices[0].text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.choices[0].logprobs.tokens
    two = lp_client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=1.0, seed=3, n=2,
                                       logprobs=1, stop=[stop, "e"])
    for choice in two.choices:
        completion_spelled(choice)


def chat_text(content) -> str:
    return "".join(e.token for e in content)


def test_chat_logprobs_spell_the_message_whole_and_streamed(lp_client, lp_llm):
    msgs = [{"role": "user", "content": "hello"}]
    stop, _ = stop_inside_a_token(lp_client, "user: hello\nassistant:")
    for extra in ({"stop": [stop]}, {"extra_body": eos_bias(lp_llm)}):
        r = lp_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=2, **extra)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert chat_text(choice.logprobs.content) == choice.message.content
        assert all(bytes(e.bytes).decode() == e.token for e in choice.logprobs.content)
        chunks = [c.choices[0] for c in lp_client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True, stream=True, **extra)]
        streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
        assert chat_text(streamed) == "".join(c.delta.content or "" for c in chunks) == choice.message.content
    r = lp_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=5, n=2,
                                          logprobs=True, stop=["e"])
    assert all(chat_text(c.logprobs.content) == c.message.content for c in r.choices)


def test_a_scored_prompt_lists_one_generated_token_even_the_eos(lp_client, lp_llm):
    """lm-evaluation-harness scores (context, continuation) with echo, logprobs and max_tokens 1 and
    reads token_logprobs[ctxlen:-1]: the prompt's entries and exactly one generated one, also when
    that one is the EOS (else it would drop the continuation's last token)."""
    ids = lp_llm.tokenize("abc def", add_bos=False)
    r = lp_client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0,
                                     extra_body={"logit_bias": {str(lp_llm.tokenizer.eos_id): 100}})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.tokens[-1] == "" and r.choices[0].finish_reason == "stop"
    assert "".join(lp.tokens) == r.choices[0].text


def test_the_python_api_lists_the_same_tokens(lp_client, lp_llm):
    stop, before = stop_inside_a_token(lp_client, "abc")
    mine = lp_llm.create_completion("abc", max_tokens=16, temperature=0, logprobs=1, stop=[stop])["choices"][0]
    assert mine["text"] == before and "".join(mine["logprobs"]["tokens"]) == before
