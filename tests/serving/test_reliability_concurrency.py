"""One LLM used from several places at once: every result equals the same call run alone.

Streams advanced in turn, a stream paused while `generate` runs, threads calling `generate`
and `score` side by side: each call is a sequence of its own in the continuous batch, with
its own KV cells, and must see only its own rows. These tests compare token ids, texts and
logits bit for bit with solo runs, check that the comparison would catch sequences sharing
cells, and that no call leaks cells.

Bit-identity between a call alone and the same call batched holds where every pass takes the
compiled kernels (quantized weights, prompts of at most 16 tokens; tests/test_batching.py says
why); the model here is Q8_0 and the prompts short for that reason.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.testing.synth import SynthSpec

# Untied lm head: the tied synthetic model mostly repeats its last token, which hides corruption.
SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=3, default_type="Q8_0")
PROMPTS = ["hello there", "the other one", "a"]
MODES = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=7)}

# the `llm` fixture (tests/conftest.py): room for each of the (up to 4) concurrent sequences to start
# on its own KV page: bit-identity with a solo run is what the engine promises then (with n_ctx=128 a
# sequence could start mid-page and straddle an attention block, which sums in another order)
LLM_OPTIONS = {"n_ctx": 4 * 128}


def params(mode: str, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **MODES[mode])


def solo(llm: LLM, prompt: str, mode: str, n: int = 10) -> tuple[list[int], str]:
    out = llm.generate(prompt, params(mode, n))[0].outputs[0]
    return out.token_ids, out.text


def stream_text(chunks) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks)


def completion(llm: LLM, prompt: str, mode: str, n: int = 10):
    """A llama-cpp-python-style stream (it stops at EOS, unlike `params`)."""
    return llm(prompt, max_tokens=n, stream=True, top_k=0, top_p=1.0, min_p=0.0, **MODES[mode])


def solo_stream(llm: LLM, prompt: str, mode: str, n: int = 10) -> str:
    return stream_text(completion(llm, prompt, mode, n))


@pytest.mark.parametrize("mode", MODES)
def test_streams_advanced_in_turn_equal_solo(llm, mode):
    want = [solo_stream(llm, p, mode) for p in PROMPTS]
    gens = [completion(llm, p, mode) for p in PROMPTS]
    got = ["" for _ in PROMPTS]
    live = list(range(len(gens)))
    while live:                          # a, b, c, a, b, c, ...
        for i in list(live):
            try:
                got[i] += next(gens[i])["choices"][0]["text"]
            except StopIteration:
                live.remove(i)
    assert got == want
    assert len(set(want)) == len(want)     # the prompts really give different texts


@pytest.mark.parametrize("mode", MODES)
def test_pause_stream_generate_then_resume(llm, mode):
    want_a, want_b = solo_stream(llm, PROMPTS[0], mode), solo(llm, PROMPTS[1], mode)
    a = completion(llm, PROMPTS[0], mode)
    head = "".join(next(a)["choices"][0]["text"] for _ in range(3))
    assert solo(llm, PROMPTS[1], mode) == want_b          # generate while `a` is paused
    assert llm.score(llm.tokenize(PROMPTS[2])).shape[0] >= 1
    assert head + stream_text(a) == want_a


def test_interleaving_is_bit_exact_at_the_engine(llm):
    """Logits of two interleaved sequences are identical to solo runs, not just close."""
    eng = llm.engine
    ids_a, ids_b = llm.tokenize(PROMPTS[0]), llm.tokenize(PROMPTS[1])
    steps_a, steps_b = [5, 9, 200, 17], [33, 44, 55, 66]

    def alone(ids, steps):
        s = eng.new_sequence()
        out = [eng.forward(ids, seq=s)] + [eng.forward([t], seq=s) for t in steps]
        eng.free(s)
        return out

    want_a, want_b = alone(ids_a, steps_a), alone(ids_b, steps_b)
    sa, sb = eng.new_sequence(), eng.new_sequence()
    got_a, got_b = [eng.forward(ids_a, seq=sa)], [eng.forward(ids_b, seq=sb)]
    for ta, tb in zip(steps_a, steps_b):
        got_a.append(eng.forward([ta], seq=sa))
        got_b.append(eng.forward([tb], seq=sb))
    eng.free(sa)
    eng.free(sb)
    for g, w in zip(got_a + got_b, want_a + want_b):
        assert np.array_equal(g, w)
    assert eng.cells.n_used == 0


def test_the_comparison_catches_a_shared_cache(llm, monkeypatch):
    """With every sequence handed the same cells (one cache simply shared, as before the
    cells), interleaving must differ: the tests above can fail."""
    eng = llm.engine
    want = solo_stream(llm, PROMPTS[1], "greedy", 12)

    def same_cells(seq, need, want, *where):              # every sequence from cell 0, as it grows
        return np.arange(0 if seq is None else seq.capacity, max(need, want), dtype=np.int32)

    llm.scheduler.demand.prefix.clear()          # no cached block may see its cells handed out twice
    monkeypatch.setattr(llm.scheduler.demand, "prefix", None)
    monkeypatch.setattr(eng.cells, "_place", same_cells)
    b = completion(llm, PROMPTS[1], "greedy", 12)
    head = next(b)["choices"][0]["text"]
    solo(llm, PROMPTS[0], "greedy", 12)
    assert head + stream_text(b) != want


def test_no_call_leaks_cells(llm):
    """Finished, closed, failed and scored calls give every KV cell back."""
    cells = llm.engine.cells
    for p in PROMPTS:
        solo(llm, p, "greedy")
    stream_text(completion(llm, PROMPTS[0], "seeded"))
    llm.score(llm.tokenize(PROMPTS[1]))
    assert cells.n_used == 0
    a = completion(llm, PROMPTS[0], "greedy", 50)
    next(a)
    assert cells.n_used > 0
    a.close()                               # the stream's sequence is cancelled at once or next step
    solo(llm, PROMPTS[1], "greedy", 2)
    assert cells.n_used == 0
    with pytest.raises(Exception):
        llm.generate([PROMPTS[0], [10 ** 6]], params("greedy"))   # a bad prompt: nothing starts
    assert cells.n_used == 0 and llm.scheduler.n_running == 0 and llm.scheduler.n_waiting == 0


@pytest.mark.parametrize("mode", MODES)
def test_threads_generate_and_score_equal_solo(llm, mode):
    want = {p: solo(llm, p, mode) for p in PROMPTS}
    want_stream = {p: solo_stream(llm, p, mode) for p in PROMPTS}
    ids = llm.tokenize(PROMPTS[1])
    want_logits = llm.score(ids)
    errors: list[BaseException] = []
    results: dict[tuple[int, int], object] = {}
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            start.wait()
            for r in range(4):
                if k == 3:
                    results[(k, r)] = llm.score(ids)
                elif k == 2:
                    results[(k, r)] = stream_text(completion(llm, PROMPTS[r % 3], mode))
                else:
                    results[(k, r)] = solo(llm, PROMPTS[(k + r) % 3], mode)
        except BaseException as e:    # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    for (k, r), got in results.items():
        if k == 3:
            assert np.array_equal(got, want_logits)
        elif k == 2:
            assert got == want_stream[PROMPTS[r % 3]]
        else:
            assert got == want[PROMPTS[(k + r) % 3]]


def test_abandoned_stream_holds_no_lock(llm):
    """A stream left half read (never closed) must not block another thread."""
    a = completion(llm, PROMPTS[0], "greedy")
    next(a)
    done = threading.Event()
    t = threading.Thread(target=lambda: (solo(llm, PROMPTS[1], "greedy"), done.set()))
    t.start()
    t.join(timeout=60)
    assert done.is_set()
    del a


def test_failed_step_does_not_poison_other_sequences(llm, monkeypatch):
    """A step that dies half way (an interrupt) leaves half-written rows of every sequence in
    it; none of them is committed, so the paused stream that shared the step goes on as if
    the step never ran, and the interrupted call's cells come back."""
    want = solo_stream(llm, PROMPTS[0], "seeded")
    a = completion(llm, PROMPTS[0], "seeded")
    head = next(a)["choices"][0]["text"]
    from metatp.step import Pass

    eng = llm.engine
    real = Pass.run
    calls = {"n": 0}

    def dies_once(self):
        calls["n"] += 1
        if calls["n"] == 1:
            real(self)                     # the rows are written, then the step is lost
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Pass, "run", dies_once)
    with pytest.raises(KeyboardInterrupt):
        solo(llm, PROMPTS[1], "greedy")
    assert head + stream_text(a) == want
    assert eng.cells.n_used == 0


def test_tensor_parallel_interleaving_equals_solo(path):
    tp = LLM(path, n_ctx=64, backend="numpy", n_devices=2, tensor_split=[3, 1])
    want = [solo_stream(tp, p, "seeded", 6) for p in PROMPTS[:2]]
    a, b = completion(tp, PROMPTS[0], "seeded", 6), completion(tp, PROMPTS[1], "seeded", 6)
    got = ["", ""]
    for x, y in zip(a, b):
        got[0] += x["choices"][0]["text"]
        got[1] += y["choices"][0]["text"]
    got[0] += stream_text(a)
    got[1] += stream_text(b)
    assert got == want
