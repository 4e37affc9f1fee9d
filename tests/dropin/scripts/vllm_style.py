"""A script in vLLM's idiom (its quickstart and offline-inference examples), run against metatp:
only the import line differs. Usage: python vllm_style.py MODEL"""

import sys

from metatp import LLM, SamplingParams          # was: from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=sys.argv[1])
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
assert [o.prompt for o in outputs] == prompts

# n samples with a seed: different texts, the same again with the same seed
params = SamplingParams(n=3, temperature=0.8, seed=42, max_tokens=24)
first = llm.generate("Write a story about a dragon:", params)[0]
again = llm.generate("Write a story about a dragon:", params)[0]
texts = [c.text for c in first.outputs]
assert len(set(texts)) == 3, texts
assert texts == [c.text for c in again.outputs]

# logprobs as objects
out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                              prompt_logprobs=1))[0]
for token_id, logprobs in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
    chosen = logprobs[token_id]
    print(token_id, chosen.logprob, chosen.rank, repr(chosen.decoded_token))
    assert chosen.rank == 1 and chosen.logprob <= 0
assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][out.prompt_token_ids[1]].rank >= 1

# chat
conversation = [{"role": "system", "content": "You are a helpful assistant"},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hello! How can I assist you today?"},
                {"role": "user", "content": "Write an essay about the importance of higher education."}]
chat_outputs = llm.chat(conversation, sampling_params=SamplingParams(temperature=0.5, max_tokens=32), use_tqdm=False)
print(chat_outputs[0].outputs[0].text)
batch = llm.chat([conversation, conversation[:2]], SamplingParams(temperature=0, max_tokens=8))
assert len(batch) == 2

# the tokenizer
tokenizer = llm.get_tokenizer()
ids = tokenizer.encode("Hello world")
assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
assert batch[0].prompt == prompt and tokenizer.eos_token_id is not None
print(tokenizer.vocab_size, tokenizer.eos_token_id)

# output options
stopped = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=16, stop=[" 6"],
                                                     include_stop_str_in_output=True, skip_special_tokens=True))
print(repr(stopped[0].outputs[0].text))
print("ALL OK")
