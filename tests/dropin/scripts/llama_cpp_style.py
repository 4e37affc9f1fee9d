"""A script in llama-cpp-python's idiom (its README's examples), run against metatp: only the
import line differs. Usage: python llama_cpp_style.py MODEL.gguf"""

import json
import sys

from metatp import Llama          # was: from llama_cpp import Llama

llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_batch=512, n_threads=2, n_gpu_layers=-1, seed=1337,
            verbose=False)

# text completion, as the README's first example
output = llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stop=["Q:", "\n"], echo=True)
print(output["choices"][0]["text"])
assert output["object"] == "text_completion"
assert output["choices"][0]["text"].startswith("Q: Name the planets in the solar system? A: ")
assert output["usage"]["prompt_tokens"] > 0

# echo with logprobs: the prompt's tokens scored too
scored = llm("The capital of France is", max_tokens=4, echo=True, logprobs=3, temperature=0)
lp = scored["choices"][0]["logprobs"]
assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
assert "".join(lp["tokens"]) == scored["choices"][0]["text"]
print(json.dumps(lp["top_logprobs"][-1]))

# streaming
pieces = []
for chunk in llm.create_completion("Once upon a time", max_tokens=16, stream=True, temperature=0):
    pieces.append(chunk["choices"][0]["text"])
streamed = "".join(pieces)
assert streamed == llm.create_completion("Once upon a time", max_tokens=16, temperature=0)["choices"][0]["text"]
print(streamed)

# chat completion
chat = llm.create_chat_completion(
    messages=[{"role": "system", "content": "You are an assistant who perfectly describes images."},
              {"role": "user", "content": "Describe this image in detail please."}],
    max_tokens=24)
print(chat["choices"][0]["message"]["content"])
assert chat["choices"][0]["message"]["role"] == "assistant"

# JSON mode, and JSON schema mode (llama-cpp-python's "schema" inside json_object)
as_json = llm.create_chat_completion(
    messages=[{"role": "system", "content": "You are a helpful assistant that outputs in JSON."},
              {"role": "user", "content": "Who won the world series in 2020?"}],
    response_format={"type": "json_object"}, temperature=0.7, max_tokens=256)
print(as_json["choices"][0]["message"]["content"])
schema_answer = llm.create_chat_completion(
    messages=[{"role": "system", "content": "You are a helpful assistant that outputs in JSON."},
              {"role": "user", "content": "Who won the world series in 2020?"}],
    response_format={"type": "json_object",
                     "schema": {"type": "object", "properties": {"team_name": {"type": "string", "maxLength": 40}},
                                "required": ["team_name"], "additionalProperties": False}},
    temperature=0.7, max_tokens=128)
team = json.loads(schema_answer["choices"][0]["message"]["content"])
assert set(team) == {"team_name"}
print(team)

# tokens
tokens = llm.tokenize(b"Hello, world!")
assert llm.detokenize(tokens) == b"Hello, world!"
assert llm.n_ctx() == 2048 and llm.n_vocab() > 0 and llm.token_eos() is not None
print(tokens, llm.token_bos(), llm.token_eos(), llm.token_nl())
print("ALL OK")
