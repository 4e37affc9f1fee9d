"""The model runner between scheduler and engine (issue 45): the runner reads logits and samples,
the scheduler keeps token ids and an enum state and delivers each request's events down one
channel, and the output processor runs on the consumer's side, where a stop string cancels the
request."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from metatp import SamplingParams
from metatp.ir.errors import MetatpError, RequestStateError
from metatp.runner import ModelRunner, Purpose, SamplingState, ScheduledItem, TokenResult
from metatp.sampling import CandidateSpec
from metatp.scheduler import Request, RequestState
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=45, default_type="Q8_0")
LLM_OPTIONS = {"n_ctx": 256, "max_num_seqs": 4}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def test_the_logits_mode_follows_what_the_pick_needs(llm):
    rng = np.random.default_rng(0)
    tok = llm.tokenizer
    assert SamplingState(GREEDY, rng, (), tok).mode == "argmax"
    assert isinstance(SamplingState(SamplingParams(temperature=0, logprobs=2), rng, (), tok).mode, CandidateSpec)
    assert isinstance(SamplingState(SamplingParams(temperature=0.8, top_k=20), rng, (), tok).mode, CandidateSpec)
    assert SamplingState(SamplingParams(temperature=0.8, top_k=-1, top_p=1.0, min_p=0.0), rng, (), tok).mode == "last"
    assert SamplingState(SamplingParams(temperature=0, repetition_penalty=1.2), rng, (), tok).mode == "last"


def test_the_runner_alone_gives_the_greedy_tokens_generate_gives(llm):
    """Feed a prompt and decode through the runner by hand: the tokens of `generate`."""
    prompt = [5, 6, 7]
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    runner = ModelRunner(llm.engine, llm.tokenizer)
    req = Request(prompt, GREEDY, np.random.default_rng(0), llm.n_ctx)
    runner.add(req)
    seq = llm.engine.cells.try_reserve(len(prompt) + len(want), len(prompt) + len(want), False, None)
    try:
        feed, purpose = list(prompt), Purpose.SAMPLE
        for _ in want:
            (res,) = runner.execute([ScheduledItem(req, seq, feed, purpose)])
            assert isinstance(res, TokenResult) and res.error is None
            req.history.append(res.token)
            req.output_ids.append(res.token)
            feed = [res.token]
    finally:
        llm.engine.free(seq)
        runner.forget(req.id)
    assert req.output_ids == want


def test_a_fed_chunk_gives_nothing_and_a_broken_row_fails_its_request_alone(llm):
    runner = ModelRunner(llm.engine, llm.tokenizer)
    req = Request([5, 6], SamplingParams(temperature=0, logprobs=1), np.random.default_rng(0), llm.n_ctx)
    st = runner.add(req)
    item = ScheduledItem(req, None, [1], Purpose.SAMPLE)
    bad = runner._result(item, st, np.full(llm.n_vocab, np.nan, dtype=np.float32))
    assert isinstance(bad.error, MetatpError) and "NaN" in str(bad.error)
    good = runner._result(item, st, np.arange(llm.n_vocab, dtype=np.float32))
    assert good.token == llm.n_vocab - 1 and good.logprob is not None and len(good.top_logprobs) == 1
    assert runner._result(ScheduledItem(req, None, [1], Purpose.FEED), st, None) is None


def test_states_are_an_enum_that_reads_as_its_name(llm):
    h = llm.submit([5, 6, 7], GREEDY)
    assert h.request.state is RequestState.WAITING and h.request.state == "waiting"
    h.result()
    assert h.request.state is RequestState.DONE and str(h.request.state) == "done"


def test_request_state_errors_are_typed(llm):
    h = llm.submit([5, 6, 7], GREEDY)
    h.result()
    with pytest.raises(RequestStateError, match="has ended"):
        llm.scheduler.next_event(h.request)
    pushed = llm.submit([5, 6, 7], GREEDY, on_output=lambda out: None)
    with pytest.raises(RequestStateError, match="sink"):
        llm.scheduler.next_event(pushed.request)
    pushed.cancel()


def test_one_channel_a_sink_gets_every_event_and_nothing_queues(llm):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    got: list = []
    h = llm.submit([5, 6, 7], GREEDY, on_output=got.append)
    while not h.done:
        llm.scheduler.step()
    assert [o.token for o in got] == want.token_ids and "".join(o.text for o in got) == want.text
    assert not h.request.events and h.request.closed


def _stop_inside(llm) -> tuple[str, str]:
    text = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0].text
    for i in range(4, len(text) - 2):
        stop = text[i:i + 2]
        if text.index(stop) == i and stop.strip():
            return text, stop
    pytest.fail("the synthetic model's text has no usable stop string: the test needs another prompt")


def test_a_stop_string_found_by_the_consumer_ends_the_request_at_once(llm):
    """Library mode: the handle finds the stop string, cancels the request with reason "stop"
    before another step runs, so no token is generated past it and its cells are free."""
    text, stop = _stop_inside(llm)
    m = llm.scheduler.metrics
    generated, finished, cancelled = m.generated_tokens, m.requests_finished, m.requests_cancelled
    h = llm.submit([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    out = h.result()
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    assert h.done and h.finish_reason == "stop"
    assert h.request.done and h.request.finish_reason == "stop"
    assert m.generated_tokens - generated == len(out.token_ids)
    assert (m.requests_finished - finished, m.requests_cancelled - cancelled) == (1, 0)
    assert llm.engine.cells.n_used == 0


def test_a_stop_string_in_a_sink_ends_the_request_at_the_next_step(llm):
    text, stop = _stop_inside(llm)
    got: list = []
    h = llm.submit([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                   on_output=got.append)
    while llm.scheduler.step():
        pass
    assert "".join(o.text for o in got) == text[:text.index(stop)]
    assert got[-1].finish_reason == "stop" and all(o.finish_reason is None for o in got[:-1])
    assert h.request.done and h.request.finish_reason == "stop" and llm.engine.cells.n_used == 0


def _imports(module: Path) -> set[str]:
    """The modules `module` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(module.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_scheduler_imports_neither_the_sampler_nor_a_tokenizer():
    names = _imports(ROOT / "metatp" / "scheduler.py")
    assert not any(n.startswith("metatp.ir.tokenizer") for n in names), names
    assert "metatp.sampling.Sampler" not in names and "metatp.structured" not in names
    assert not any(n.startswith(("metatp.scheduler", "metatp.requests")) for n in _imports(ROOT / "metatp" / "runner.py"))
    assert not any(n.startswith(("metatp.scheduler", "metatp.runner"))
                   for n in _imports(ROOT / "metatp" / "output_processor.py"))


def test_a_sink_may_submit_a_request_that_ends_at_once(llm):
    """Events go out outside the state lock and the delivery lock is re-entrant: a sink that
    submits (here a request with nothing to generate, ended by its submit) does not deadlock."""
    inner: list = []
    outer: list = []

    def on_output(out) -> None:
        outer.append(out)
        if len(outer) == 1:
            llm.submit([5, 6], SamplingParams(max_tokens=0), on_output=inner.append)
    h = llm.submit([5, 6, 7], GREEDY, on_output=on_output)
    while not h.done:
        llm.scheduler.step()
    assert [o.finish_reason for o in inner] == ["length"] and outer[-1].finish_reason == "length"
