"""KV cells on demand with recompute preemption (issue 24 item 4).

A request takes the cells for its prompt (and next token) at admission and a page more as it
grows; when the cache has no page for a running request, the most recently admitted one is
preempted (cells freed, tokens kept) and re-prefilled later. What must hold: every request ends
with exactly what it gives alone -- tokens, and on the numpy backend's kernel path (Q8_0 weights)
the logits' bits too (compared through logprobs) --, nothing reaches a client twice, no cell is
leaked, a huge max_tokens no longer holds the cache, and under MPI the ranks preempt alike.

Where bit identity rests (measured here): a sequence's pages may lie anywhere as long as they
are in ascending cell order (attention merges its 128-cell chunks in cell order; two chunks
merged in the other order differ in the last bit, an FMA is not commutative).
"""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.engine import StepItem
from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.kv_cells import KVCells
from metatp.lockstep import STOP, StepBatch, follow
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import LoopbackPosts, record_steps

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
LLM_OPTIONS = {"n_ctx": 512, "max_num_seqs": 16}    # the `llm` fixture: four 128-cell pages
PROMPTS = [[3 + i, 40 + 2 * i, 7] for i in range(16)]
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=0)   # two pages each


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt's LONG output alone (two pages of a four-page cache: nothing to preempt)."""
    before = llm.scheduler.metrics.preemptions
    outs = [llm.generate([p], LONG)[0].outputs[0] for p in PROMPTS]
    assert llm.scheduler.metrics.preemptions == before
    return outs


def test_cache_exhaustion_gives_every_request_its_solo_output(llm, solo):
    """16 requests of 2 pages on a 4-page cache: preempted ones are recomputed, and every request
    gets its solo tokens and the same logits bits (logprobs equal exactly), no cell leaked."""
    m = llm.scheduler.metrics
    before, recomputed, prompt_tokens = m.preemptions, m.recomputed_tokens, m.prompt_tokens
    got = [o.outputs[0] for o in llm.generate(PROMPTS, LONG)]
    assert [o.token_ids for o in got] == [o.token_ids for o in solo]
    assert [o.text for o in got] == [o.text for o in solo]
    assert [o.logprobs for o in got] == [o.logprobs for o in solo]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 200 for o in got)
    assert m.preemptions > before and m.recomputed_tokens > recomputed
    assert m.prompt_tokens - prompt_tokens == sum(map(len, PROMPTS))     # recomputed tokens apart
    assert llm.engine.cells.n_used == 0 and not llm.engine.cells.live
    assert not llm.scheduler.running and not llm.scheduler.waiting


@requires("serve")
def test_preemptions_are_in_the_servers_metrics(llm):
    from types import SimpleNamespace

    from metatp.server.metrics import prometheus_text

    m = llm.scheduler.metrics
    before = m.preemptions
    llm.generate(PROMPTS[:5], LONG)               # five requests of two pages on four: one is preempted
    assert m.preemptions > before
    text = prometheus_text(SimpleNamespace(sched=llm.scheduler, llm=llm, requests_total=0))
    assert f"metatp_preemptions_total {m.preemptions}\n" in text and m.preemptions > 0
    assert f"metatp_recomputed_tokens_total {m.recomputed_tokens}\n" in text


def test_streams_through_a_preemption_deliver_each_token_once_in_order(llm, solo, monkeypatch):
    """Outputs as a server gets them (`on_event`): a request preempted after it streamed tokens
    goes on where it was; a seeded sampled one keeps its random stream, one with a stop string
    its held-back text."""
    sched = llm.scheduler
    ref_sampled = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    want_sampled = llm.generate([PROMPTS[3]], ref_sampled)[0].outputs[0]
    stop = solo[2].text[-40:-30]
    want_stop = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                                                          stop=[stop]))[0].outputs[0]
    assert want_stop.finish_reason == "stop" and 150 < len(want_stop.token_ids) < 200
    params = [LONG] * len(PROMPTS)
    params[3] = ref_sampled
    params[2] = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[stop])
    events: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    delivered_at_preemption: list[tuple[int, int]] = []
    preempt = sched.admission.preempt
    index: dict[int, int] = {}

    def recording(r, waiting):
        delivered_at_preemption.append((index[id(r)], len(events[index[id(r)]])))
        preempt(r, waiting)
    monkeypatch.setattr(sched.admission, "preempt", recording)
    reqs = [llm.submit(p, sp, on_output=lambda out, i=i: events[i].append(out)).request
            for i, (p, sp) in enumerate(zip(PROMPTS, params))]      # queued; no step runs before the loop
    index.update({id(r): i for i, r in enumerate(reqs)})
    for _ in range(20_000):
        if not sched.step():
            break
    assert all(r.done for r in reqs)
    mid_stream = {i for i, n in delivered_at_preemption if 0 < n < 200}
    assert {2, 3} <= mid_stream, delivered_at_preemption        # the newest two, when the oldest need pages
    for i, evs in events.items():
        want = want_sampled if i == 3 else want_stop if i == 2 else solo[i]
        assert [e.token for e in evs] == want.token_ids, i                 # each token once, in order
        assert "".join(e.text for e in evs) == want.text, i
        assert [e.finish_reason for e in evs[:-1]] == [None] * (len(evs) - 1)
        assert evs[-1].finish_reason == want.finish_reason
    assert llm.engine.cells.n_used == 0


def _tokens_and_logprobs(sched, req) -> tuple[list[int], list[float]]:
    tokens, lps = [], []
    while True:
        out = sched.next_event(req, timeout=60)
        if out.token is not None:
            tokens.append(out.token)
            lps.append(out.logprob)
        if out.finish_reason is not None:
            return tokens, lps


def test_a_request_preempted_mid_prompt_starts_its_prompt_again(path, monkeypatch):
    """A 200-token prompt fed in chunks of a small n_batch is preempted between two chunks (the
    oldest request needs a page): it is fed again from its start and gives its solo output."""
    # the scenario places pages by hand: no prefix cache holding the solo runs' pages
    llm = LLM(path, n_ctx=512, backend="numpy", n_batch=64, max_num_seqs=4, enable_prefix_caching=False)
    sched = llm.scheduler
    grow = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, logprobs=0)
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(1, 200, 200)]
    want = [llm.generate([ids], sp)[0].outputs[0] for ids, sp in
            (([5, 6, 7], grow), ([8, 9], grow), (long_prompt, short))]
    seen: list[tuple[str, int]] = []
    preempt = sched.admission.preempt

    def recording(r, waiting):
        seen.append((r.state, r.n_fed))
        preempt(r, waiting)
    monkeypatch.setattr(sched.admission, "preempt", recording)
    a = llm.submit([5, 6, 7], grow).request
    while a.seq is None or a.seq.n_past < 126:                  # a: one page, two cells short of its end
        sched.step()
    c = llm.submit([8, 9], grow).request                        # c: the third page; b: the last two
    b = llm.submit(long_prompt, short).request
    outs = [_tokens_and_logprobs(sched, r) for r in (a, c, b)]
    assert seen and seen[0][0] == "prefill" and 0 < seen[0][1] < 200, seen     # b, between two chunks
    for got, w in zip(outs, want):
        assert got == (w.token_ids, [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)])
    m = sched.metrics
    assert m.prompt_tokens == 2 * (3 + 2 + 200) and m.recomputed_tokens >= 124
    assert llm.engine.cells.n_used == 0


def test_a_huge_request_no_longer_reserves_the_cache(llm):
    """max_tokens far past the cache (no max_model_len): it used to reserve all 512 cells at
    admission and the small ones waited for its end; now they share its first step, finish,
    and it runs to the end of the cache ("length", n_ctx - prompt + 1 tokens) alone."""
    m = llm.scheduler.metrics
    m.max_step_seqs = 0
    huge = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    small = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11], [12, 13]], [huge, small, small, small])
    assert m.max_step_seqs == 4
    assert [len(o.outputs[0].token_ids) for o in outs] == [512 - 3 + 1, 4, 4, 4]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    alone = llm.generate([[5, 6, 7]], huge)[0].outputs[0]
    assert outs[0].outputs[0].token_ids == alone.token_ids
    assert llm.engine.cells.n_used == 0


def test_a_request_that_alone_cannot_fit_is_refused_at_submit(llm):
    """Preemption makes room for what fits the cache alone; a prompt past it never waits."""
    with pytest.raises(ContextOverflowError):
        llm.generate([[1] * (llm.n_ctx + 1)], SamplingParams(temperature=0.0, max_tokens=4))
    assert not llm.scheduler.waiting and not llm.scheduler.running and llm.engine.cells.n_used == 0


# ---------------------------------------------------------------- where a sequence's pages lie
def _pages(*pages: int) -> np.ndarray:
    return np.concatenate([np.arange(p * 128, p * 128 + 128) for p in pages]).astype(np.int32)


def _run_on(llm, cells: np.ndarray, prompt: list[int]) -> list[np.ndarray]:
    """Logits of `prompt` fed in 50-token chunks (the kernel path) and 6 decode steps, the
    sequence placed on exactly `cells`, a neighbour sharing every step."""
    eng = llm.engine
    seq = eng.cells.adopt(10_000 + len(eng.cells.live), cells)
    other = eng.new_sequence()
    outs = []
    try:
        for i in range(0, len(prompt), 50):
            outs.append(eng.run([StepItem(seq, prompt[i:i + 50]), StepItem(other, prompt[i:i + 50][::-1])])[0])
        for t in range(6):
            outs.append(eng.run([StepItem(other, [9 + t]), StepItem(seq, [5 + t])])[1])
    finally:
        eng.free(seq)
        eng.free(other)
    return outs


def test_scattered_pages_in_ascending_order_give_the_same_bits(path):
    """Pages 1, 3, 5, 7 (others' cells between) vs 0-3 contiguous: the same logits bits at every
    step. In another order the logits stay close (only the merge of chunks is reordered)."""
    llm = LLM(path, n_ctx=2048, backend="numpy")
    prompt = [int(x) for x in np.random.default_rng(0).integers(1, 200, 400)]
    want = _run_on(llm, _pages(0, 1, 2, 3), prompt)
    for order in [(1, 3, 5, 7), (4, 9, 10, 15)]:
        got = _run_on(llm, _pages(*order), prompt)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), order
    for g, w in zip(_run_on(llm, _pages(3, 2, 1, 0), prompt), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert llm.engine.cells.n_used == 0


def test_placement_grows_in_place_then_on_later_pages():
    c = KVCells(1024, page=128)
    a = c.try_reserve(10, 128, paged=True)
    b = c.try_reserve(10, 128, paged=True)
    assert (a.cells[0], a.capacity, b.cells[0]) == (0, 128, 128)
    assert c.try_grow(a, 100) is not None and a.capacity == 128            # room already: nothing added
    added = c.try_grow(a, 129, 256, paged=True)                          # b is next: the next free page
    assert list(added[[0, -1]]) == [256, 383] and np.all(np.diff(a.cells) > 0)
    c.free(b)
    d = c.try_reserve(300, 384, paged=True)                                # a run of 3 free pages first
    assert (d.cells[0], d.capacity) == (384, 384) and np.all(np.diff(d.cells) == 1)
    e = c.try_reserve(5, 5, paged=True)
    assert e.cells[0] == 128                                                # the lowest free page
    assert c.try_grow(e, 6) is not None and e.cells[-1] == 133           # in place
    filler = c.try_reserve(c.n_free - 10, paged=False)
    assert filler is not None and c.n_free == 10
    assert c.try_reserve(5, 5, paged=True) is None                          # free cells, but no free page
    assert c.try_reserve(5, 5) is not None                                  # any cells, where nothing else runs
    assert c.try_grow(a, 1000) is None and a.capacity == 256               # the cache cannot supply it
    for s in (a, d, e, filler):
        c.free(s)
    assert c.n_used == 5


def test_without_a_run_of_pages_a_sequence_takes_free_pages_in_ascending_order():
    c = KVCells(768, page=128)
    held = [c.try_reserve(128, paged=True) for _ in range(6)]
    for s in held[1::2]:
        c.free(s)                                                           # pages 1, 3, 5 free
    d = c.try_reserve(300, 384, paged=True)
    assert list(d.cells[::128]) == [128, 384, 640] and d.capacity == 384 and np.all(np.diff(d.cells) > 0)


def test_a_cache_of_under_two_pages_is_shared_cell_by_cell():
    c = KVCells(200, page=128)
    assert c.page == 1
    seqs = [c.try_reserve(13, 13, paged=True) for _ in range(15)]
    assert all(s is not None for s in seqs) and c.n_free == 5


def test_follower_growth_is_checked():
    c = KVCells(256, page=128)
    s = c.adopt(4, np.arange(0, 10))
    c.extend(s, np.arange(10, 20))
    assert s.capacity == 20 and c.n_used == 20
    with pytest.raises(ConfigError):
        c.extend(s, np.arange(15, 25))               # owned already
    c.free(s)
    with pytest.raises(ConfigError):
        c.extend(s, np.arange(30, 31))               # ended


# ---------------------------------------------------------------- under MPI
def test_a_follower_replays_growth_and_preemption(path):
    """A served rank 0 posts admissions, growth and the frees of preempted requests; a follower
    replaying them has the same owner in every cell before every step and the same logits."""
    def make() -> LLM:
        return LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", distributed="none",
                   max_num_seqs=4)
    lead, rest = make(), make()
    posts: list = []
    lead.scheduler.lead(LoopbackPosts(0, posts))
    logs = record_steps(lead.engine, rest.engine)
    p = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    outs = lead.generate(PROMPTS[:4], p)
    assert lead.scheduler.metrics.preemptions > 0
    assert all(isinstance(b, StepBatch) for b in posts)
    ops = [op[0] for b in posts for op in b.ops]
    assert "grow" in ops and ops.count("take") > 4
    assert follow(rest.engine, LoopbackPosts(1, posts + [STOP])) == len(logs[0])
    for (own_a, outs_a), (own_b, outs_b) in zip(*logs):
        assert np.array_equal(own_a, own_b)
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(outs_a, outs_b))
    assert rest.engine.cells.n_used == 0 and lead.engine.cells.n_used == 0
    assert [len(o.outputs[0].token_ids) for o in outs] == [150] * 4


MPI_SCRIPT = textwrap.dedent("""
    import json, sys
    from metatp.api import LLM
    from metatp.sampling import SamplingParams
    path, out = sys.argv[1], sys.argv[2]
    llm = LLM(path, n_ctx=256, backend="numpy", distributed="mpi", max_num_seqs=4)
    prompts = [[3 + i, 40 + 2 * i, 7] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    m = llm.scheduler.metrics
    facts = {"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": m.preemptions,
             "passes": llm.engine.passes, "used": llm.engine.cells.n_used}
    open(f"{out}/rank{llm.world.rank}.json", "w").write(json.dumps(facts))
""")


@requires("mpi")
def test_generate_under_mpiexec_preempts_alike_on_every_rank(path, tmp_path):
    """`mpiexec -n 2`: rank 0 schedules and preempts, rank 1 follows its steps (same passes, no
    scheduler of its own: no preemptions counted there); both give the tokens one process gives."""
    from support.mpi import check_ok, mpiexec

    script = tmp_path / "preempt.py"
    script.write_text(MPI_SCRIPT)
    check_ok(mpiexec(2, [sys.executable, str(script), path, str(tmp_path)], timeout=300))
    facts = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert facts[1].pop("preemptions") == 0
    assert {k: v for k, v in facts[0].items() if k != "preemptions"} == facts[1]
    assert facts[0]["preemptions"] > 0 and facts[0]["used"] == 0
    one = LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", distributed="none",
              max_num_seqs=4)
    want = one.generate([[3 + i, 40 + 2 * i, 7] for i in range(4)],
                        SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    assert facts[0]["tokens"] == [o.outputs[0].token_ids for o in want]
    assert facts[0]["preemptions"] == one.scheduler.metrics.preemptions
