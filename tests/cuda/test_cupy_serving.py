"""Many sequences per step on the cupy backend (issue 46 item 1), on the CPU emulator (and the 16
concurrent requests on a GPU when one is present).

The engine, scheduler and KV cells are the CPU path's: continuous batching, cells on demand,
recompute preemption and the prefix cache. What must hold on the cupy backend as on numpy: 16
concurrent greedy requests each get the tokens they get alone; requests preempted when the cache
runs out get their solo tokens too, and no cell leaks; a prefix found in the cache is looked up,
not prefilled again, and gives the tokens of a run without the cache.

Tokens, not logits bits, are compared: on the cupy backend a row's sums may depend on its
batch-mates (a pass of more rows takes other kernels); `batch_invariant` is what pins the bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.emulated_gpu import on_emulator
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
PROMPTS = [[3 + i, 40 + 2 * i, 7] for i in range(16)]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)




def emulated_llm(path: str, rt: EmuRuntime | None = None, **options) -> LLM:
    with on_emulator(rt or EmuRuntime()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, backend="cupy", **options)


@pytest.fixture(scope="module")
def gpuengine_llm(path):
    """A cupy LLM on the emulator: 512 cells, 16 sequences at once."""
    return emulated_llm(path, n_ctx=512, n_batch=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def gpuengine_solo(gpuengine_llm):
    """Each prompt's greedy tokens alone."""
    return [gpuengine_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@requires("emulator")
def test_sixteen_concurrent_sequences_get_their_solo_tokens(gpuengine_llm, gpuengine_solo):
    llm = gpuengine_llm
    before = llm.engine.passes
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == gpuengine_solo
    # passes carry many sequences: a few prompt passes, then one decode pass per token (one per
    # sequence and token would be 16 * 3)
    assert llm.engine.passes - before <= 2 * (GREEDY.max_tokens + 1)
    assert llm.engine.cells.n_used == 0 and not llm.engine.cells.live


@pytest.mark.gpu
@requires("gpu")
def test_sixteen_concurrent_sequences_get_their_solo_tokens_on_the_gpu(path):
    """The same on a real GPU (issue 46: the emulator in CI, the GPU when present): the passes of 16
    sequences take the many-row kernels (cuBLAS GEMMs for the 48-row prompt pass, the mmq tiles for the
    16-row decode steps), and every request still gets the tokens it gets alone; no cell leaked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, backend="cupy", n_ctx=512, n_batch=64, max_num_seqs=16)
    solo = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    before = llm.engine.passes
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == solo
    assert llm.engine.passes - before <= 2 * (GREEDY.max_tokens + 1)
    assert llm.engine.cells.n_used == 0 and not llm.engine.cells.live


@requires("emulator")
def test_cache_exhaustion_preempts_and_every_request_gets_its_solo_tokens(path):
    """Five requests of 13 cells on a 32-cell cache: some are preempted and recomputed; each
    ends with its solo tokens, no cell leaked."""
    llm = emulated_llm(path, n_ctx=32, n_batch=32, max_num_seqs=8, enable_prefix_caching=False)
    long = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:5]
    m = llm.scheduler.metrics
    solo = [llm.generate([p], long)[0].outputs[0].token_ids for p in prompts[:2]]
    assert m.preemptions == 0
    got = [o.outputs[0] for o in llm.generate(prompts, long)]
    assert m.preemptions > 0 and m.recomputed_tokens > 0
    assert [o.token_ids for o in got[:2]] == solo
    assert all(o.finish_reason == "length" and len(o.token_ids) == long.max_tokens for o in got)
    alone = [llm.generate([p], long)[0].outputs[0].token_ids for p in prompts[2:]]
    assert [o.token_ids for o in got[2:]] == alone
    assert llm.engine.cells.n_used == 0 and not llm.engine.cells.live
    assert not llm.scheduler.running and not llm.scheduler.waiting


@requires("emulator")
def test_a_cached_prefix_is_looked_up_not_prefilled_with_the_same_tokens(path):
    shared = [int(x) for x in np.random.default_rng(7).integers(3, 250, 40)]
    cached = emulated_llm(path, n_ctx=256, n_batch=64, max_num_seqs=4)
    plain = emulated_llm(path, n_ctx=256, n_batch=64, max_num_seqs=4, enable_prefix_caching=False)
    first, second = shared + [1], shared + [2]
    for llm in (cached, plain):
        llm.generate([first], GREEDY)
    m = cached.scheduler.metrics
    hits, prompt = m.prefix_hit_tokens, m.prompt_tokens
    got = cached.generate([second], GREEDY)[0].outputs[0].token_ids
    assert m.prefix_hit_tokens - hits == 32           # 40 shared tokens: two whole blocks of 16
    assert m.prompt_tokens - prompt == len(second) - 32     # only the rest was prefilled
    assert got == plain.generate([second], GREEDY)[0].outputs[0].token_ids
    assert cached.engine.cells.n_cached > 0 and cached.engine.cells.n_used == 0
