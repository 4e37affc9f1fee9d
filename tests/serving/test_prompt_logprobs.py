"""Prompt logprobs (issue 26 item 3), with the official `openai` client against a real server:
`echo` + `logprobs` (what lm-evaluation-harness's local-completions sends to score a prompt,
usually with max_tokens 0) answers the prompt tokens' logprobs, the first one null, then the
generated ones; vLLM's `prompt_logprobs` field answers them per choice. Every value equals the
log-softmax of `LLM.score`'s logits at that position."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metatp import LLM
from metatp.ir.errors import ConfigError
from metatp.logprobs import prompt_logprobs
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

httpx = optional_import("httpx")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=26, default_type="Q8_0")
PROMPT = [5, 9, 14, 3, 27, 8]
N_CTX = 256


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


@pytest.fixture(scope="module")
def want(path) -> np.ndarray:
    """The log-softmax of every prompt position's logits, in this process."""
    return log_softmax_rows(LLM(path, n_ctx=N_CTX, backend="numpy").score(PROMPT))


@pytest.fixture(scope="module")
def plp_server(path, tmp_path_factory):
    s = MetatpServe(path, "-c", str(N_CTX), "--parallel", "2", log=tmp_path_factory.mktemp("plp") / "serve.log")
    yield s
    s.stop()


def test_prompt_logprobs_are_the_log_softmax_of_the_logits_before_each_token():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((len(PROMPT), 50)) * 3).astype(np.float32)
    logits[2, 7] = logits[2, 8] = logits[2].max() + 1            # a tie: the lower id ranks first
    ref = log_softmax_rows(logits)
    entries = prompt_logprobs(logits, PROMPT, 3)
    assert entries[0] is None and len(entries) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        lp, top, rank = entries[i]
        assert lp == pytest.approx(ref[i - 1, PROMPT[i]], abs=1e-12)
        assert list(top) == list(np.argsort(-ref[i - 1], kind="stable")[:3])
        assert list(top.values()) == pytest.approx(np.sort(ref[i - 1])[::-1][:3], abs=1e-12)
        assert rank == 1 + int((logits[i - 1] > logits[i - 1, PROMPT[i]]).sum())
    with pytest.raises(ValueError, match="rows of logits"):
        prompt_logprobs(logits[:-1], PROMPT, 1)


@requires("serve")
def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(plp_server, want):
    c = plp_server.client()
    r = c.completions.create(model="m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = r.choices[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, PROMPT[i]], rel=1e-5, abs=1e-6)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max(), rel=1e-5, abs=1e-6)
        assert len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)


@requires("serve")
def test_echo_with_logprobs_and_tokens_gives_the_prompt_then_the_generation(plp_server, want):
    c = plp_server.client()
    plain = c.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    r = c.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    ch = r.choices[0]
    assert ch.text.endswith(plain.choices[0].text) and len(ch.text) > len(plain.choices[0].text)
    lp = ch.logprobs
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[len(PROMPT):] == plain.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[1] == pytest.approx(want[0, PROMPT[1]], rel=1e-5, abs=1e-6)
    prompt_len = len(ch.text) - len(plain.choices[0].text)
    assert lp.text_offset[len(PROMPT)] == prompt_len         # the generated offsets follow the prompt's text


@requires("serve")
def test_a_streamed_echo_sends_the_prompt_first(plp_server):
    with httpx.stream("POST", plp_server.base + "/v1/completions", timeout=60,
                      json={"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True,
                            "logprobs": 1, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(PROMPT)
    texts = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert texts.startswith(first["text"]) and first["text"]


@requires("serve")
def test_vllm_prompt_logprobs_field(plp_server, want):
    r = httpx.post(plp_server.base + "/v1/completions", timeout=60,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        own = plp[i][str(PROMPT[i])]
        assert own["logprob"] == pytest.approx(want[i - 1, PROMPT[i]], rel=1e-5, abs=1e-6)
        assert own["rank"] == 1 + int((want[i - 1] > want[i - 1, PROMPT[i]]).sum())
        best = sorted(plp[i].values(), key=lambda v: v["rank"])[:2]      # the top 2 are always there
        assert [v["rank"] for v in best] == [1, 2]
        assert [v["logprob"] for v in best] == pytest.approx(np.sort(want[i - 1])[::-1][:2], rel=1e-5, abs=1e-6)
    assert "logprobs" in r["choices"][0] and r["choices"][0]["logprobs"] is None


@requires("serve")
@pytest.mark.parametrize("bad", [-1, 21, 1.5, "2"])
def test_a_bad_prompt_logprobs_is_a_400(plp_server, bad):
    r = httpx.post(plp_server.base + "/v1/completions", timeout=60,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_generate_reports_prompt_logprobs(path, want):
    from metatp import SamplingParams
    from metatp.ir.errors import ConfigError

    llm = LLM(path, n_ctx=N_CTX, backend="numpy")
    plain, out = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3, temperature=0),
                                                 SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)])
    assert plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids      # the scoring pass changes nothing
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert plp[i][PROMPT[i]].logprob == pytest.approx(want[i - 1, PROMPT[i]], rel=1e-6, abs=1e-7)
        best = sorted(want[i - 1])[::-1][:2]
        others = sorted((v.logprob for v in plp[i].values()), reverse=True)
        assert others[:2] == pytest.approx(best, rel=1e-6, abs=1e-7)               # the top 2 are there
    assert llm.engine.cells.n_used == 0
    for bad in (-1, 21, 1.5, "2"):
        with pytest.raises(ConfigError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@requires("serve")
def test_python_create_completion_logprobs_are_the_servers(path, plp_server):
    """llama-cpp-python's `logprobs` on `LLM.create_completion`: the same entries as the server's
    /v1/completions for the same request (tokens, logprobs, alternatives, offsets), streamed or
    whole, and with echo (the prompt's tokens scored too); bad counts are refused by name."""
    served = plp_server.client().completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                                    logprobs=3).choices[0]
    llm = LLM(path, n_ctx=N_CTX, backend="numpy")
    mine = llm.create_completion(PROMPT, max_tokens=4, temperature=0, logprobs=3)["choices"][0]
    assert mine["text"] == served.text
    lp = mine["logprobs"]
    assert lp["tokens"] == served.logprobs.tokens and lp["text_offset"] == served.logprobs.text_offset
    assert lp["token_logprobs"] == pytest.approx(served.logprobs.token_logprobs, rel=1e-6, abs=1e-7)
    assert [sorted(d) for d in lp["top_logprobs"]] == [sorted(d) for d in served.logprobs.top_logprobs]
    chunks = list(llm.create_completion(PROMPT, max_tokens=4, temperature=0, logprobs=3, stream=True))
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]        # a token that is part of a UTF-8 character too (empty text)
    stream = plp_server.client().completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                                    logprobs=3, stream=True)
    assert [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == lp["tokens"]
    assert llm.create_completion(PROMPT, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None
    echoed = llm.create_completion(PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)["choices"][0]
    served = plp_server.client().completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0,
                                                    logprobs=1, echo=True).choices[0]     # issue 47: as the server
    assert echoed["text"] == served.text and echoed["logprobs"]["tokens"] == served.logprobs.tokens
    mine_lp, served_lp = echoed["logprobs"]["token_logprobs"], served.logprobs.token_logprobs
    assert mine_lp[0] is None and served_lp[0] is None      # the first prompt token has no logprob
    assert mine_lp[1:] == pytest.approx(served_lp[1:], rel=1e-6, abs=1e-7)
    assert echoed["logprobs"]["top_logprobs"][0] is None and served.logprobs.top_logprobs[0] is None
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ConfigError, match="logprobs must be"):
            llm.create_completion(PROMPT, max_tokens=2, logprobs=bad)
