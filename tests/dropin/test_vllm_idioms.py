"""vLLM's idioms on a synthetic GGUF: SamplingParams' defaults and output options, Logprob
objects, LLM.chat, LLM.get_tokenizer and generate's use_tqdm."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metatp import Logprob, SamplingParams
from metatp.ir.errors import ConfigError
from metatp.sampling import Sampler
from metatp.testing.synth import SynthSpec

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"
SPEC = SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=48, chat_template=TEMPLATE)
LLM_OPTIONS = {"n_ctx": 128}          # the `llm` fixture (tests/conftest.py)
CHAT = [{"role": "user", "content": "hi"}]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


# ---------------------------------------------------------------- SamplingParams
def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n, p.min_p) == (1.0, 1.0, -1, 16, 1, 0.0)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.include_stop_str_in_output,
            p.detokenize, p.ignore_eos, p.min_tokens) == (True, True, False, True, False, 0)
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_n_samples_differ_and_a_seed_repeats_them(llm):
    params = SamplingParams(n=3, temperature=4.0, seed=5, max_tokens=8, ignore_eos=True)   # a peaked random model
    a, b = (llm.generate("hello", params)[0].outputs for _ in range(2))
    assert len({o.text for o in a}) == 3
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    draw = Sampler(SamplingParams(seed=0), None)                    # the default samples: a flat row varies
    assert len({draw(np.zeros(8, np.float32)) for _ in range(50)}) > 1


def test_logprobs_are_logprob_objects(llm):
    out = llm.generate("hello", greedy(max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for tok, d in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in d.values()) and len(d) == 3       # the greedy token is a top one
        assert d[tok].rank == 1 and d[tok].decoded_token == llm.tokenizer.token_text(tok)
        ranked = sorted(d.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked] == [1, 2, 3]
        assert all(x.logprob >= y.logprob for x, y in zip(ranked, ranked[1:]))
        total += d[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_a_sampled_tokens_rank_is_counted_or_none(llm):
    out = llm.generate("hello", SamplingParams(max_tokens=12, temperature=2.0, seed=3, logprobs=1,
                                               ignore_eos=True))[0].outputs[0]
    for tok, d in zip(out.token_ids, out.logprobs):
        best = max(d.values(), key=lambda v: v.logprob)
        assert best.rank == 1
        assert d[tok].rank == (1 if d[tok] is best else None)      # past the top 1: not counted


def test_prompt_logprobs_have_exact_ranks(llm):
    ids = llm.prompt_ids("hello there")
    plp = llm.generate("hello there", greedy(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    logits = llm.score(ids)
    assert plp[0] is None
    for i in range(1, len(ids)):
        row = logits[i - 1]
        entry = plp[i][ids[i]]
        assert entry.rank == int((row > row[ids[i]]).sum()) + 1
        lse = float(row.max()) + math.log(float(np.exp(row.astype(np.float64) - row.max()).sum()))
        assert entry.logprob == pytest.approx(float(row[ids[i]]) - lse, abs=1e-5)
        assert entry.decoded_token == llm.tokenizer.token_text(ids[i])


def test_skip_special_tokens(llm):
    forced = dict(max_tokens=3, logit_bias={0: 100.0})           # token 0: <|bos|>, a control token
    assert llm.generate("hi", greedy(**forced))[0].outputs[0].text == ""
    shown = llm.generate("hi", greedy(skip_special_tokens=False, spaces_between_special_tokens=False, **forced))
    assert shown[0].outputs[0].text == "<|bos|>" * 3
    # vLLM's V1 fast detokenizer writes special tokens as the tokenizer decodes them, with no spaces
    # added (spaces_between_special_tokens only strips a prefixed space between two of them): both equal
    spaced = llm.generate("hi", greedy(skip_special_tokens=False, **forced))
    assert SamplingParams(skip_special_tokens=False).spaces_between_special_tokens is True
    assert spaced[0].outputs[0].text == "<|bos|>" * 3
    for name in ("skip_special_tokens", "include_stop_str_in_output", "detokenize", "spaces_between_special_tokens"):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(**{name: "no"})


def test_include_stop_str_in_output(llm):
    text = llm.generate("hello", greedy(max_tokens=12))[0].outputs[0].text
    stop = text[3:5]
    cut = llm.generate("hello", greedy(max_tokens=12, stop=[stop]))[0].outputs[0]
    kept = llm.generate("hello", greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert cut.stop_reason == kept.stop_reason == stop
    assert kept.text == cut.text + stop and text.startswith(kept.text)


def test_detokenize_false_gives_ids_only(llm):
    with_text = llm.generate("hello", greedy(max_tokens=5, logprobs=1))[0].outputs[0]
    ids_only = llm.generate("hello", greedy(max_tokens=5, logprobs=1, detokenize=False))[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    assert all(v.decoded_token is None for d in ids_only.logprobs for v in d.values())
    with pytest.raises(ConfigError, match="detokenize=False cannot be combined with stop"):
        SamplingParams(detokenize=False, stop=["x"])


# ---------------------------------------------------------------- LLM.chat, get_tokenizer, use_tqdm
def test_chat_renders_the_template_and_generates(llm):
    one = llm.chat(CHAT, greedy(max_tokens=4))
    rendered = "<|bos|>user: hi\nassistant:"
    assert len(one) == 1 and one[0].prompt == rendered
    assert one[0].outputs[0].token_ids == llm.generate(rendered, greedy(max_tokens=4))[0].outputs[0].token_ids
    two = llm.chat([CHAT, CHAT + [{"role": "assistant", "content": "yo"}]], greedy(max_tokens=4))
    assert [o.prompt for o in two] == [rendered, "<|bos|>user: hi\n<|bos|>assistant: yo\nassistant:"]
    assert llm.chat(CHAT, greedy(max_tokens=1), add_generation_prompt=False)[0].prompt == "<|bos|>user: hi\n"
    own = llm.chat(CHAT, greedy(max_tokens=1), chat_template="{{ messages[0]['content'] }}!")
    assert own[0].prompt == "hi!"
    with pytest.raises(ConfigError, match="messages"):
        llm.chat([{"content": "no role"}])
    with pytest.raises(ConfigError, match="messages is empty"):
        llm.chat([])


def test_get_tokenizer_speaks_hugging_face(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("hello there")
    assert ids == llm.tokenize("hello there") and tok.decode(ids) == "hello there"
    assert tok("hello there")["input_ids"] == ids and tok(["a", "b"])["input_ids"] == [tok.encode("a"), tok.encode("b")]
    assert tok.batch_decode([ids, ids[:1]]) == ["hello there", tok.decode(ids[0])]
    assert (tok.eos_token_id, tok.bos_token_id, tok.eos_token, tok.bos_token) == (1, 0, "<|eos|>", "<|bos|>")
    assert tok.vocab_size == len(tok) == llm.n_vocab
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|bos|>", "<|eos|>"]
    assert tok.decode([0, *ids], skip_special_tokens=True) == "hello there"
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == llm.chat(CHAT, greedy(max_tokens=1))[0].prompt
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True) == llm.tokenizer.encode(text, special=True)


def test_use_tqdm_takes_a_bar_factory(llm):
    made = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.n, self.closed = total, 0, False
            made.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    llm.generate(["a", "b", "c"], greedy(max_tokens=1), use_tqdm=Bar)
    assert [(b.total, b.n, b.closed) for b in made] == [(3, 3, True)]
    assert len(llm.generate(["a", "b"], greedy(max_tokens=1), use_tqdm=True)) == 2     # a bar if tqdm is installed
    with pytest.raises(ConfigError, match="use_tqdm"):
        llm.generate("a", greedy(max_tokens=1), use_tqdm="yes")


def test_tokenizer_view_names_a_bad_token_id(llm):
    tok = llm.get_tokenizer()
    for bad in (300, -1, 2.0, True):
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            tok.convert_ids_to_tokens([bad])
