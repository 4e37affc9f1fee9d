"""The tables the tokenizer reads as llama.cpp does (`src/llama-vocab.cpp`): token attribute
flags, the pre-tokenizer regexes per `tokenizer.ggml.pre`, the texts of end-of-generation and
fill-in-the-middle tokens, and GPT-2's byte-to-character map. Data, kept apart from the logic."""

from __future__ import annotations

# Token attributes, as llama.cpp's llama_token_attr bit flags.
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5

# GGUF token types (gguf.TokenType) -> attribute flags; anything else is "undefined" (0).
TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

SPM_SPACE = "\u2581"  # '▁', SentencePiece's escaped space

# ---------------------------------------------------------------- pre-tokenizers
# The regexes llama.cpp uses per `tokenizer.ggml.pre` (llm_tokenizer_bpe). Where llama.cpp
# rewrote a HF regex for std::regex (e.g. `(?i:'s|...)`), the original HF form is used:
# the `tokenizers` library runs Oniguruma, which takes it as is.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
DEFAULT_PRE = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


class PreTokenizer:
    """How one `tokenizer.ggml.pre` value pre-splits text, and the flags llama.cpp ties to it."""

    def __init__(self, regexes: list[str], *, ignore_merges: bool = False, add_bos: bool = False) -> None:
        self.regexes = regexes
        self.ignore_merges = ignore_merges  # a word that is a whole vocab token skips the merges
        self.add_bos = add_bos  # llama.cpp's add_bos default for this pre-tokenizer


def _pre_table() -> dict[str, PreTokenizer]:
    groups: list[tuple[tuple[str, ...], PreTokenizer]] = [
        (("default",), PreTokenizer(DEFAULT_PRE)),
        (("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
          "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt",
          "olmo", "jais", "exaone4", "trillion", "granite-docling"), PreTokenizer([GPT2])),
        (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
          "jina-v5-nano", "dbrx", "smaug-bpe"), PreTokenizer([LLAMA3], ignore_merges=True, add_bos=True)),
        (("glm4", "chatglm-bpe"), PreTokenizer([LLAMA3])),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
         PreTokenizer([r"\p{N}", GPT2])),
        (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open"),
         PreTokenizer([QWEN2])),
        (("qwen35",), PreTokenizer([QWEN35])),
        (("falcon",), PreTokenizer([r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"])),
        (("deepseek-coder",), PreTokenizer(["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"])),
        (("deepseek-v3", "hunyuan-dense", "joyai-llm"), PreTokenizer(DEEPSEEK3)),
        (("tekken",), PreTokenizer([TEKKEN], ignore_merges=True, add_bos=True)),
        (("gpt-4o", "llama4", "kanana2"), PreTokenizer([GPT4O])),
        (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer([r" ?[^(\s|.,!?…。，、।۔،)]+"])),
        (("seed-coder",), PreTokenizer([SEED_CODER])),
    ]
    return {name: pre for names, pre in groups for name in names}


PRE_TOKENIZERS = _pre_table()

# ---------------------------------------------------------------- end-of-generation detection
# llama.cpp finds these tokens by their text (llama_vocab::impl::load); so do we. Where several
# match, the first text in the tuple wins (llama.cpp's pick is the hash map's order).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                  "<|code_prefix|>", "<|prefix|>")
FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                  "<|code_suffix|>", "<|suffix|>")
FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                  "<|code_middle|>", "<|middle|>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})


def gpt2_byte_table() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = gpt2_byte_table()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
