"""The prefix cache (issue 26 item 4): finished requests' whole blocks of KV cells are kept and
reused by prompts that start the same way.

What must hold: a reused prefix is only looked up, never recomputed (the prompt-token count says
so); on the kernel path (passes of at most 64 rows, where a row's sums do not depend on the pass)
the output has the same bits as a run without the cache; with long passes the same tokens and
logprobs within float rounding; the cache gives its cells back when the pool needs them (no
request waits or is preempted for it, none is leaked); a solo run keeps its bits beside a cache
full of other blocks (its pages stay in order); a served follower rank mirrors every cached and
evicted cell; and through `metatp serve` a second chat turn prefills only what the first did not.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.ir.errors import ConfigError
from metatp.kv_cells import CACHED, KVCells
from metatp.lockstep import STOP, follow
from metatp.prefix_cache import PrefixCache
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import LoopbackPosts, MetatpServe, optional_import, record_steps

openai = optional_import("openai")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
LLM_OPTIONS = {"n_ctx": 1024, "n_batch": 64}    # the `llm` fixture: every pass on the kernel path
SHARED = [int(x) for x in np.random.default_rng(7).integers(3, 250, 300)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)


def out(llm, ids, params=GREEDY):
    return llm.generate([ids], params)[0].outputs[0]


@pytest.fixture(scope="module")
def uncached(path):
    return LLM(path, backend="numpy", enable_prefix_caching=False, **LLM_OPTIONS)


def test_a_shared_prefix_is_looked_up_not_recomputed_with_the_same_bits(llm, uncached):
    m = llm.scheduler.metrics
    a, b = SHARED + [5, 6, 7], SHARED + [9, 8]
    out(llm, a)
    prompt_tokens, hits = m.prompt_tokens, m.prefix_hit_tokens
    got = out(llm, b)
    assert m.prefix_hit_tokens - hits == 288                    # 300 shared tokens: 18 whole blocks of 16
    assert m.prompt_tokens - prompt_tokens == len(b) - 288      # only the rest was prefilled
    want = out(uncached, b)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs     # the same bits
    again = out(llm, a)                                          # a itself again: all but its last block
    assert again.token_ids == out(uncached, a).token_ids
    assert llm.engine.cells.n_used == 0 and llm.engine.cells.n_cached > 0


def test_a_chat_continuing_a_finished_answer_reuses_the_answer_too(llm, uncached):
    """The second turn's prompt holds the first's prompt and generated tokens: both are reused."""
    m = llm.scheduler.metrics
    first = SHARED[:100]
    reply = out(llm, first).token_ids
    turn2 = first + reply + [11, 12, 13]
    hits = m.prefix_hit_tokens
    got = out(llm, turn2)
    assert m.prefix_hit_tokens - hits == (len(first) + len(reply) - 1) // 16 * 16
    want = out(uncached, turn2)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_long_passes_reuse_with_the_same_tokens(path):
    """n_batch 512: a prefix computed inside a long pass (dequantize + BLAS, whose sums depend on
    the pass) is reused: the same greedy tokens, logprobs equal within float rounding."""
    cached, plain = (LLM(path, backend="numpy", n_ctx=1024, enable_prefix_caching=flag) for flag in (True, False))
    out(cached, SHARED + [5, 6, 7])
    got, want = out(cached, SHARED + [9, 8]), out(plain, SHARED + [9, 8])
    assert cached.scheduler.metrics.prefix_hit_tokens == 288
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys() and np.allclose([v.logprob for v in g.values()], [v.logprob for v in w.values()], atol=1e-4)


def test_the_cache_gives_cells_back_and_solo_runs_keep_their_bits(path):
    """A four-page cache: eight solo runs of two pages each leave blocks behind; every later run
    still gets the cells it needs (the cache evicts; nothing waits or is preempted for it) and its
    pages in order, so each gives exactly what it gives on an empty cache."""
    opts = {"n_ctx": 512, "max_num_seqs": 4}
    cached, plain = (LLM(path, backend="numpy", enable_prefix_caching=flag, **opts) for flag in (True, False))
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[3 + i, 40 + 2 * i, 7] for i in range(8)]
    for p in prompts:
        assert out(cached, p, long).logprobs == out(plain, p, long).logprobs
        cells = cached.engine.cells
        assert cells.n_used == 0 and 0 < cells.n_cached <= cells.n_cells
    batch = cached.generate(prompts[:4], long)
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in plain.generate(prompts[:4], long)]
    assert cached.scheduler.metrics.preemptions == plain.scheduler.metrics.preemptions
    n = cached.scheduler.demand.prefix.clear()
    assert n > 0 and cached.engine.cells.n_cached == 0 and cached.engine.cells.n_free == 512


def test_a_follower_mirrors_cached_and_evicted_cells(path):
    """A served rank 0 posts the prefix cache's keeps and evictions; a follower replaying them has
    the same owner in every cell (CACHED included) before every step, and the same logits."""
    def make() -> LLM:
        return LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", distributed="none",
                   max_num_seqs=4, n_batch=64)
    lead, rest = make(), make()
    posts: list = []
    lead.scheduler.lead(LoopbackPosts(0, posts))
    logs = record_steps(lead.engine, rest.engine)
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for tail in ([1], [2], [3, 4], [5]):
        lead.generate([SHARED[:100] + tail, SHARED[:40] + tail], p)
    ops = [op[0] for b in posts for op in b.ops]
    assert "cache" in ops and "uncache" in ops and lead.scheduler.metrics.prefix_hit_tokens > 0
    assert follow(rest.engine, LoopbackPosts(1, posts + [STOP])) == len(logs[0])
    for (own_a, outs_a), (own_b, outs_b) in zip(*logs):
        assert np.array_equal(own_a, own_b)
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(outs_a, outs_b))
    assert any((own_a == CACHED).any() for own_a, _ in logs[1])       # the follower held cached cells too


@requires("serve")
def test_prefix_hits_are_in_the_servers_metrics(llm):
    from metatp.server.metrics import prometheus_text

    out(llm, SHARED[:50] + [1])
    out(llm, SHARED[:50] + [2])
    m = llm.scheduler.metrics
    text = prometheus_text(SimpleNamespace(sched=llm.scheduler, llm=llm, requests_total=0))
    assert f"metatp_prefix_cache_hits_total {m.prefix_hit_tokens}\n" in text and m.prefix_hit_tokens >= 48
    assert f"metatp_prefix_cache_queries_total {m.prefix_queried_tokens}\n" in text
    assert f"metatp_kv_cells_cached {llm.engine.cells.n_cached}\n" in text


def test_enable_prefix_caching_must_be_a_bool(path):
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        LLM(path, backend="numpy", n_ctx=256, enable_prefix_caching="no")


# ---------------------------------------------------------------- the cache's bookkeeping alone
def _finished(cells: KVCells, n: int, start: np.ndarray | None = None):
    seq = cells.try_reserve(n, prefix=start)
    seq.n_past = n
    return seq


def test_blocks_are_kept_found_pinned_and_evicted_leaves_first():
    cells = KVCells(512, page=128)
    cache = PrefixCache(cells)
    ids = list(range(100, 180))
    s = _finished(cells, 80)
    assert cache.keep(s, ids) == 5                               # 80 positions: five blocks of 16
    cells.free(s)
    assert cells.n_used == 0 and cells.n_cached == 80 and (cells.owner[:80] == CACHED).all()
    assert len(cache.lookup(ids)) == 4                           # the last token is always computed
    assert len(cache.lookup(ids + [1])) == 5 and cache.lookup([0] + ids) == []
    chain = cache.lookup(ids + [1])[:2]
    cache.pin(chain)
    assert not cache.evict_range(0, 16)                          # in use: nothing evicted
    for _ in range(3):
        assert cache.evict_one()
    assert [b.cells[0] for b in cache.blocks.values()] == [0, 16]      # the deepest went first
    assert not cache.evict_one()                                 # the pinned two stay
    cache.unpin(chain)
    assert cache.evict_range(0, 1) and cache.n_blocks == 0       # a block goes with what continues it
    assert cells.n_cached == 0 and cells.n_free == 512


def test_cached_cells_are_shared_never_scratch_and_outlive_their_sequence():
    cells = KVCells(512, page=128)
    cache = PrefixCache(cells)
    s = _finished(cells, 40)
    cache.keep(s, list(range(40)))
    cells.free(s)
    start = np.concatenate([b.cells for b in cache.lookup(list(range(41)))])
    t = cells.try_reserve(60, prefix=start)
    assert t.capacity == 60 and np.array_equal(t.cells[:32], np.arange(32))
    assert not np.isin(cells.scratch_cells(512, {}), start).any()    # no padding row writes a cached cell
    cells.free(t)
    assert cells.n_cached == 32 and cells.n_used == 0                  # the shared cells stay cached
    with pytest.raises(ConfigError):
        cells.try_reserve(10, prefix=np.arange(100, 110))             # not cached cells
    with pytest.raises(ConfigError):
        cells.uncache(np.arange(200, 210))


def test_a_block_out_of_phase_is_not_kept():
    """Cells not at their positions' phase in a page would not give the same bits: the chain stops."""
    cells = KVCells(512, page=128)
    cache = PrefixCache(cells)
    s = cells.adopt(7, np.concatenate([np.arange(0, 16), np.arange(200, 216)]))
    s.n_past = 32
    assert cache.keep(s, list(range(32))) == 1


# ---------------------------------------------------------------- metatp serve + openai
@requires("serve")
def test_a_second_chat_turn_prefills_only_its_new_tokens(default_model, tmp_path):
    """The official client, two turns of one chat on the default model: the second turn's prefill
    is what the first did not hold (whole blocks of 16 apart), and its answer is the one a run
    without the cache gives."""
    import httpx

    s = MetatpServe(str(default_model), "-c", "2048", "--parallel", "2", log=tmp_path / "server.log")
    try:
        client = s.client()

        def metrics() -> dict[str, float]:
            text = httpx.get(f"http://127.0.0.1:{s.port}/metrics", timeout=30).text
            return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln.startswith("metatp_")
                                             and "{" not in ln)}
        chat = [{"role": "user", "content": "Name three rivers of France, with a sentence on each."}]
        first = client.chat.completions.create(model="m", messages=chat, max_tokens=40, temperature=0)
        chat += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which one is the longest?"}]
        before = metrics()
        second = client.chat.completions.create(model="m", messages=chat, max_tokens=24, temperature=0)
        after = metrics()
    finally:
        s.stop()
    hit = after["metatp_prefix_cache_hits_total"] - before["metatp_prefix_cache_hits_total"]
    prefilled = after["metatp_prompt_tokens_total"] - before["metatp_prompt_tokens_total"]
    n_first = first.usage.prompt_tokens + first.usage.completion_tokens
    assert hit >= (n_first - 16) // 16 * 16 - 16, (hit, n_first)       # the first turn's blocks, bar its tail
    assert prefilled == second.usage.prompt_tokens - hit
    plain = LLM(str(default_model), backend="numpy", n_ctx=2048, enable_prefix_caching=False)
    want = plain.create_chat_completion(chat, max_tokens=24, temperature=0)
    assert second.choices[0].message.content == want["choices"][0]["message"]["content"]


def test_a_forward_without_the_scheduler_evicts_what_it_needs(path):
    """The cache full of blocks, `Engine.forward` (tools drive it directly) still gets its cells."""
    llm = LLM(path, backend="numpy", n_ctx=256, max_num_seqs=2)
    for i in range(6):
        out(llm, [3 + i] * 60, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    cells = llm.engine.cells
    assert cells.n_cached > 0
    logits = llm.engine.forward([5] * 250)
    assert logits.shape[-1] == llm.engine.model.hparams.n_vocab and cells.n_cached <= 256 - 250
