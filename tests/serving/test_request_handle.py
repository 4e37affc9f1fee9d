"""`LLM.submit` returns a `RequestHandle` (issue 24 item 1): iterate it, wait for its result, or
cancel it; with `on_output` its outputs go to a callback instead. `generate`, `score`, streaming
and the server all go through it, so what a handle gives is what those give."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metatp import SamplingParams
from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.requests import RequestHandle
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=31, default_type="Q8_0")
LLM_OPTIONS = {"n_ctx": 256, "max_num_seqs": 4}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_a_handle_gives_what_generate_gives(llm):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    h = llm.submit([5, 6, 7], GREEDY)
    assert isinstance(h, RequestHandle)
    got = h.result()
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert h.done and h.finish_reason == "length"
    assert llm.engine.cells.n_used == 0


def test_iterating_a_handle_streams_each_token_once_and_ends_with_the_reason(llm):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    steps = list(llm.submit([5, 6, 7], GREEDY))
    assert [s.token for s in steps if s.token is not None] == want
    assert steps[-1].finish_reason == "length" and all(s.finish_reason is None for s in steps[:-1])


def test_two_handles_share_steps_and_each_gets_its_solo_tokens(llm):
    solo = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in ([5, 6], [9, 10, 11])]
    a, b = llm.submit([5, 6], GREEDY), llm.submit([9, 10, 11], GREEDY)
    assert [b.result().token_ids, a.result().token_ids] == solo[::-1]


def test_cancel_and_leaving_an_iteration_early_free_the_cells(llm):
    h = llm.submit([5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    it = iter(h)
    next(it)
    assert llm.engine.cells.n_used > 0
    it.close()                                   # the caller stopped listening
    llm.generate([[1, 2]], GREEDY)               # the next step boundary drops it and frees its cells
    assert h.done and h.finish_reason == "cancelled"
    assert llm.engine.cells.n_used == 0
    waiting = llm.submit([5, 6, 7], GREEDY)
    waiting.cancel()                             # cancelled before any step: never runs
    assert waiting.done and waiting.finish_reason == "cancelled"


def test_on_output_sends_every_output_to_the_callback(llm):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    got: list = []
    ended = threading.Event()

    def on_output(out) -> None:
        got.append(out)
        if out.finish_reason is not None:
            ended.set()
    h = llm.submit([5, 6, 7], GREEDY, on_output=on_output)
    with pytest.raises(ConfigError, match="on_output"):
        next(iter(h))                            # outputs go to the callback, not to an iterator
    while not ended.is_set():
        llm.scheduler.step()
    assert [o.token for o in got if o.token is not None] == want


def test_a_scoring_handle_gives_the_logits_of_score(llm):
    ids = [5, 6, 7, 8]
    logits = llm.submit(ids, SamplingParams(max_tokens=0), kind="score").logits()
    assert np.array_equal(logits, llm.score(ids))
    h = llm.submit(ids, GREEDY)
    with pytest.raises(ConfigError, match="scoring request"):
        h.logits()
    h.cancel()


def test_a_prompt_past_the_context_is_refused_at_submit(llm):
    with pytest.raises(ContextOverflowError):
        llm.submit(list(range(2, 300)), GREEDY)
    assert llm.scheduler.n_waiting == 0
