"""How often the scheduler's thread wakes the server's event loop: once a token for a streamed
answer, once a request for one sent whole (its outputs held until it finishes, then queued
together), with the same outputs either way."""

from __future__ import annotations

import asyncio

import pytest

from metatp.sampling import SamplingParams
from metatp.testing.synth import SynthSpec
from support.require import requires

pytestmark = requires("serve")

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=41, default_type="Q8_0")
PROMPTS = [[1, 5, 9, 13], [1, 7, 2]]
N_TOKENS = 6


def _serve(path, streamed: bool) -> tuple[int, list[list[tuple]]]:
    """(wakes of the loop, each choice's outputs as (token, text, finish_reason)) for PROMPTS."""
    from metatp import LLM
    from metatp.server.frontend import Frontend

    llm = LLM(path, n_ctx=128, backend="numpy", max_num_seqs=4)
    srv = Frontend(llm, "synth")
    srv.sched.start()

    async def run():
        loop = asyncio.get_running_loop()
        wakes = 0
        post = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wakes
            wakes += 1
            return post(*args)
        loop.call_soon_threadsafe = counted
        params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
        reqs, queue = await srv.start(PROMPTS, params, streamed=streamed)
        per: list[list[tuple]] = [[] for _ in reqs]
        left = len(reqs)
        while left:
            choice, out = await asyncio.wait_for(queue.get(), timeout=30)
            assert out.error is None
            per[choice].append((out.token, out.text, out.finish_reason))
            left -= out.finish_reason is not None
        return wakes, per
    try:
        return asyncio.run(run())
    finally:
        srv.sched.stop()


def test_an_answer_sent_whole_wakes_the_loop_once_a_request(path):
    wakes_streamed, streamed = _serve(path, streamed=True)
    wakes_whole, whole = _serve(path, streamed=False)
    assert whole == streamed
    assert all(sum(tok is not None for tok, _, _ in outs) == N_TOKENS for outs in whole)
    assert wakes_whole == len(PROMPTS)
    assert wakes_streamed >= len(PROMPTS) * N_TOKENS
