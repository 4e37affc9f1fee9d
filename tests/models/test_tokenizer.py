"""Tokenizer: llama.cpp's ids on the real SmolLM2 GGUF, and both tokenizer kinds on synthetic vocabularies.

The SentencePiece path is checked against a direct Python port of llama.cpp's SPM algorithm
(`_llama_cpp_spm` below): our tokenizer gets there through HF `tokenizers`' BPE with merges
derived from the vocabulary, which is only right if both agree.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.ir.errors import ConfigError, ModelFormatError
from metatp.ir.tokenizer import StreamDecoder, Tokenizer
from metatp.ir.tokenizer_tables import PRE_TOKENIZERS, gpt2_byte_table

from metatp.models import cache_dir  # noqa: E402
from support.require import require  # noqa: E402

SMOLLM_GGUF = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_CASES = Path(__file__).resolve().parents[3] / "shared" / "refs" / "smollm2" / "cases.json"
GEMMA_GGUF = cache_dir() / "gemma-3-270m-q4_k_m.gguf"

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _read_metadata(path: Path) -> dict:
    from metatp.ir.loader import load_model

    return load_model(path).metadata


# ---------------------------------------------------------------- reference: llama.cpp's SPM, in Python
def _llama_cpp_spm(token_to_id: dict[str, int], scores: list[float], text: str) -> list[int]:
    """llm_tokenizer_spm_session::tokenize on already-escaped text: merge the adjacent pair whose
    concatenation is the highest-scoring vocab token (leftmost on ties), then resegment."""
    syms = [[i, 1, i - 1, i + 1 if i + 1 < len(text) else -1] for i in range(len(text))]  # start, len, prev, next
    heap: list[tuple[float, int, int, int]] = []
    rev: dict[str, tuple[int, int]] = {}

    def try_add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        s = text[syms[left][0]: syms[left][0] + syms[left][1] + syms[right][1]]
        tid = token_to_id.get(s)
        if tid is not None:
            heapq.heappush(heap, (-scores[tid], left, right, len(s)))
            rev[s] = (left, right)

    for i in range(1, len(syms)):
        try_add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        sl, sr = syms[left], syms[right]
        if sl[1] == 0 or sr[1] == 0 or sl[1] + sr[1] != size:
            continue
        sl[1] += sr[1]
        sr[1] = 0
        sl[3] = sr[3]
        if sr[3] >= 0:
            syms[sr[3]][2] = left
        try_add(sl[2], left)
        try_add(left, sl[3])

    out: list[int] = []

    def resegment(i: int) -> None:
        s = text[syms[i][0]: syms[i][0] + syms[i][1]]
        if s in token_to_id:
            out.append(token_to_id[s])
        elif s in rev:
            resegment(rev[s][0])
            resegment(rev[s][1])
        else:
            out.extend(token_to_id[f"<0x{b:02X}>"] for b in s.encode("utf-8"))

    i = 0 if syms else -1
    while i != -1:
        resegment(i)
        i = syms[i][3]
    return out


def _reference_spm_encode(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    """llama.cpp's SPM tokenize(): special-token fragments, space prefix, escape, SPM per fragment."""
    out: list[int] = []
    prev_special = True
    for frag in tok._partition(text, special):
        if isinstance(frag, int):
            out.append(frag)
            prev_special = True
            continue
        if tok.add_space_prefix and prev_special:
            frag = " " + frag
        out += _llama_cpp_spm(tok._token_to_id, tok.scores, frag.replace(" ", "\u2581"))
        prev_special = False
    return out


# ---------------------------------------------------------------- synthetic vocabularies
def _spm_metadata(corpus: str, n_merges: int, **extra) -> dict:
    """A SentencePiece-BPE vocab 'trained' on corpus: pieces made by merging the most frequent
    pair, each new piece scoring lower than the ones before it (as sentencepiece does)."""
    words = [("\u2581" + w) for w in corpus.split()]
    seqs = [list(w) for w in words]
    chars = sorted({c for w in words for c in w})
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs = Counter((s[i], s[i + 1]) for s in seqs for i in range(len(s) - 1))
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    s[i: i + 2] = [a + b]
                i += 1
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, p in enumerate(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-float(rank))
    for c in chars:
        if c not in tokens:
            tokens.append(c)
            types.append(NORMAL)
            scores.append(-1000.0)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(extra)
    return md


SPM_CORPUS = (
    "the quick brown fox jumps over the lazy dog then the dog sleeps and the fox runs "
    "there these those other brother mother thereafter the theme theatre hello help held "
    "abab abba baba aaaa bbbb abc abcabc cabcab ééé été café"
)


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(_spm_metadata(SPM_CORPUS, 120))


def _bpe_metadata(**extra) -> dict:
    """A byte-level BPE ('gpt2') vocab: all 256 byte symbols, a few merges, chat control tokens."""
    b2u = gpt2_byte_table()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)]
    types = [CONTROL] * 3 + [NORMAL] * 256
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(NORMAL)
    tokens += ["<tool>", "<|unused_3|>"]
    types += [USER_DEFINED, CONTROL]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                   "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_metadata(_bpe_metadata())


# ---------------------------------------------------------------- real model: SmolLM2 (gpt2 / smollm)
@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    if not SMOLLM_GGUF.is_file():
        require("model", f"{SMOLLM_GGUF} is absent (fetch it with metatp.models.resolve_model(None))")
    return Tokenizer.from_metadata(_read_metadata(SMOLLM_GGUF))


@pytest.fixture(scope="module")
def smollm_cases() -> list[dict]:
    if not SMOLLM_CASES.is_file():
        require("refs", f"{SMOLLM_CASES} is absent")
    return json.loads(SMOLLM_CASES.read_text())["cases"]


def test_smollm_header(smollm: Tokenizer) -> None:
    assert smollm.n_vocab == 49152
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)
    assert smollm.add_bos is False  # tokenizer.ggml.add_bos_token = false in this file
    # <|endoftext|>, <|im_end|> by text, and <reponame> as llama.cpp's FIM repo token
    assert smollm.eog_ids == frozenset({0, 2, 4})
    assert smollm.is_special(1) and not smollm.is_special(504)


def test_smollm_known_prompts(smollm: Tokenizer) -> None:
    assert smollm.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert smollm.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n") == [
        1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198]


def test_smollm_matches_llama_cpp_ids(smollm: Tokenizer, smollm_cases: list[dict]) -> None:
    for case in smollm_cases:
        prompt = case["prompt"]
        assert smollm.encode(prompt) == case["ids_used_for_logits"]
        assert smollm.encode(prompt, add_bos=False) == case["ids_add_bos_false"]
        assert smollm.encode(prompt, add_bos=False, special=False) == case["ids_add_bos_false_special_false"]
        assert smollm.encode(prompt, add_bos=True) == case["alt_bos_ids"]
        pieces = [smollm.token_bytes(i).decode("utf-8") for i in case["ids_used_for_logits"]]
        assert pieces == case["ids_used_for_logits_pieces"]


def test_smollm_decode_matches_llama_cpp(smollm: Tokenizer, smollm_cases: list[dict]) -> None:
    for case in smollm_cases:
        ids = case["greedy_ids"]
        assert smollm.decode(ids) == case["greedy_text_special"]
        assert smollm.decode(ids, skip_special=True) == case["greedy_text"]
        assert [smollm.token_bytes(i).decode("utf-8") for i in ids] == case["greedy_pieces"]
        stream = StreamDecoder(smollm, skip_special=True)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == case["greedy_text"]


def test_smollm_roundtrip_and_stream(smollm: Tokenizer) -> None:
    text = "naïve café – 世界, 🎉🎊 emoji, ZWJ 👩‍💻 and digits 31415\n\ttabs"
    ids = smollm.encode(text)
    assert smollm.decode(ids) == text
    stream = StreamDecoder(smollm)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_smollm_chat_template(smollm: Tokenizer) -> None:
    out = smollm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = smollm.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("<|im_start|>user\nhi<|im_end|>\n")


# ---------------------------------------------------------------- real model: Gemma 3 (SentencePiece)
@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    if not GEMMA_GGUF.is_file():
        require("model", f"{GEMMA_GGUF} is absent (fetch it with metatp.models.resolve_model('gemma3-270m'))")
    return Tokenizer.from_metadata(_read_metadata(GEMMA_GGUF))


@pytest.mark.slow
def test_gemma_spm_matches_llama_cpp_algorithm(gemma: Tokenizer) -> None:
    assert gemma.add_bos and gemma.bos_id == 2 and not gemma.add_space_prefix
    assert gemma.encode("Hello world") == [2, 9259, 1902]
    assert {1, 106} <= gemma.eog_ids  # <eos>, <end_of_turn>
    texts = [
        "The capital of France is",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "héllo 世界 🎉 1234567 don't  \n\n  x\t\ty",
        "ⅫꙮЖ \x00\x07 ᚠᚢᚦ rare characters fall back to bytes",
        "  leading and trailing spaces  ",
    ]
    for text in texts:
        ids = gemma.encode(text, add_bos=False)
        assert ids == _reference_spm_encode(gemma, text)
        assert gemma.decode(ids) == text


# ---------------------------------------------------------------- synthetic SentencePiece
def test_spm_defaults(spm: Tokenizer) -> None:
    assert spm.add_bos and spm.add_space_prefix and spm.bos_id == 1 and spm.eos_id == 2
    assert spm.eog_ids == frozenset({2})


def test_spm_space_prefix_and_bos(spm: Tokenizer) -> None:
    ids = spm.encode("the fox")
    assert ids[0] == 1
    assert [spm.tokens[i] for i in ids[1:]] == ["\u2581the", "\u2581fox"]
    assert spm.decode(ids, skip_special=True) == " the fox"  # the pieces, prefix space included
    assert spm.encode("the fox", add_bos=False) == ids[1:]


def test_spm_no_space_prefix() -> None:
    tok = Tokenizer.from_metadata(_spm_metadata(SPM_CORPUS, 120, **{"tokenizer.ggml.add_space_prefix": False}))
    ids = tok.encode("the fox", add_bos=False)
    assert tok.tokens[ids[0]] != "\u2581the"
    assert tok.decode(ids) == "the fox"


def test_spm_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("中", add_bos=False)
    assert [spm.tokens[i] for i in ids] == ["\u2581", "<0xE4>", "<0xB8>", "<0xAD>"]
    assert spm.token_bytes(ids[1]) == b"\xe4"
    assert spm.decode(ids) == " 中"


def test_spm_space_after_special(spm: Tokenizer) -> None:
    """llama.cpp prefixes a space to every text fragment that follows a special token."""
    ids = spm.encode("the<s>fox", add_bos=False)
    assert ids == _reference_spm_encode(spm, "the<s>fox")
    assert 1 in ids
    assert spm.tokens[ids[ids.index(1) + 1]].startswith("\u2581")
    assert 1 not in spm.encode("the<s>fox", add_bos=False, special=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["the", "he", "re", "fox", "abc", "ab", "ba", "a", "b", "c", " ", "  ", "é",
                                 "t", "h", "e", "o", "r", "中", "🎉", "<s>", "\u2581", "x", "ll", "\n"]),
                max_size=25).map("".join))
def test_spm_matches_llama_cpp_reference(spm: Tokenizer, text: str) -> None:
    assert spm.encode(text, add_bos=False) == _reference_spm_encode(spm, text)
    assert spm.encode(text, add_bos=False, special=False) == _reference_spm_encode(spm, text, special=False)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_spm_arbitrary_text_roundtrips(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text, add_bos=False, special=False)
    assert ids == _reference_spm_encode(spm, text, special=False)
    expected = (" " + text if text else text).replace("\u2581", " ")  # llama.cpp escapes '▁' and ' ' alike
    assert spm.decode(ids) == expected


# ---------------------------------------------------------------- synthetic byte-level BPE
def test_bpe_merges_and_special_tokens(bpe: Tokenizer) -> None:
    ids = bpe.encode("hello world")
    assert [bpe.tokens[i] for i in ids] == ["hello", "Ġworld"]
    ids = bpe.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    plain = bpe.encode("<|im_start|>hello", special=False)
    assert 1 not in plain and bpe.decode(plain) == "<|im_start|>hello"


def test_bpe_user_defined_always_parsed(bpe: Tokenizer) -> None:
    tool = bpe.tokens.index("<tool>")
    assert tool in bpe.encode("a<tool>b", special=False)
    assert not bpe.is_special(tool)
    assert bpe.decode(bpe.encode("a<tool>b"), skip_special=True) == "a<tool>b"


def test_bpe_flags_and_eog(bpe: Tokenizer) -> None:
    assert bpe.add_bos is False  # gpt2 pre-tokenizer, no add_bos_token key
    assert bpe.encode("hello")[0] != 1
    assert bpe.encode("hello", add_bos=True)[0] == 1
    assert bpe.eog_ids == frozenset({0, 2})  # eos + <|im_end|> found by its text
    assert bpe.is_special(2) and bpe.is_special(bpe.tokens.index("<|unused_3|>"))
    llama3 = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.add_bos is True
    explicit = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert explicit.encode("hello")[0] == 1


def test_bpe_smollm_pre_splits_digits() -> None:
    tok = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.pre": "smollm"}))
    gpt2 = Tokenizer.from_metadata(_bpe_metadata())
    assert [tok.tokens[i] for i in tok.encode("12")] == ["1", "2"]
    assert [gpt2.tokens[i] for i in gpt2.encode("12")] == ["12"]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_compiles_and_is_lossless(pre: str) -> None:
    tok = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.pre": pre}))
    text = "Hello, World! It's 12345 héllo 世界 ひらがな\n\n  x\t\ty 'LL"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_bpe_unknown_pre_warns_and_falls_back() -> None:
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}))
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_bpe_decode_skip_special(bpe: Tokenizer) -> None:
    ids = bpe.encode("<|im_start|>hello<|im_end|>")
    assert bpe.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert bpe.decode(ids, skip_special=True) == "hello"
    assert bpe.token_bytes(1) == b"<|im_start|>"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_bpe_roundtrip(bpe: Tokenizer, text: str) -> None:
    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    assert bpe.decode(bpe.encode(text, special=False)) == text


# ---------------------------------------------------------------- streaming
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_stream_never_emits_half_characters(bpe: Tokenizer, text: str) -> None:
    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").replace("\ufffd", "")
    stream = StreamDecoder(bpe)
    pieces = [stream.push(i) for i in bpe.encode(text, special=False)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_stream_byte_tokens(spm: Tokenizer) -> None:
    ids = spm.encode("é中🎉", add_bos=False)  # 'é' is a piece; 中 and 🎉 are 3 and 4 byte tokens
    stream = StreamDecoder(spm)
    pieces = [stream.push(i) for i in ids]
    assert pieces[-4:] == ["", "", "", "🎉"]
    assert "".join(pieces) + stream.flush() == " é中🎉"


def test_stream_flush_incomplete(spm: Tokenizer) -> None:
    stream = StreamDecoder(spm)
    e4 = spm.tokens.index("<0xE4>")
    assert stream.push(e4) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(spm.tokens.index("<0x41>")) == "A"


def test_stream_skip_special(bpe: Tokenizer) -> None:
    stream = StreamDecoder(bpe, skip_special=True)
    assert [stream.push(i) for i in bpe.encode("<|im_start|>hello")] == ["", "hello"]


# ---------------------------------------------------------------- chat templates and errors
def test_chat_template_synthetic(bpe: Tokenizer) -> None:
    out = bpe.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user: hi\nassistant:"


def test_chat_template_errors() -> None:
    no_template = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.chat_template": None}))
    with pytest.raises(ConfigError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer.from_metadata(_bpe_metadata(**{
        "tokenizer.chat_template": "{% if messages[0]['role'] != 'user' %}"
                                   "{{ raise_exception('first message must be from the user') }}{% endif %}ok"}))
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ConfigError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_bad_metadata() -> None:
    with pytest.raises(ModelFormatError, match="'bert'"):
        Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelFormatError, match="duplicate"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "a"]})
    with pytest.raises(ModelFormatError, match="merges"):
        md = _bpe_metadata()
        del md["tokenizer.ggml.merges"]
        Tokenizer.from_metadata(md)
    with pytest.raises(ModelFormatError, match="token_type"):
        Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))


def test_bad_ids(bpe: Tokenizer) -> None:
    with pytest.raises(ConfigError):
        bpe.decode([bpe.n_vocab])
    with pytest.raises(ConfigError):
        bpe.token_bytes(-1)
    no_bos = Tokenizer.from_metadata(_bpe_metadata(**{"tokenizer.ggml.bos_token_id": None}))
    with pytest.raises(ConfigError, match="BOS"):
        no_bos.encode("hello", add_bos=True)
    with pytest.raises(ConfigError, match="Unicode"):
        bpe.encode("lone \ud800 surrogate")
