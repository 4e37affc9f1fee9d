"""The per-request cap (`max_model_len`, `metatp serve --max-model-len`, default n_ctx // parallel):
one request's prompt + completion is bounded, so one huge max_tokens cannot reserve the whole KV
cache while others wait (issue 24 item 4). A generation reaching the cap ends with "length" at
exactly cap - prompt tokens; a prompt past it is refused up front (ContextOverflowError in
Python, a 400 `context_length_exceeded` naming it from the server), never a hang or a 500.
"""

from __future__ import annotations

import threading
import time

import pytest

from metatp import LLM, SamplingParams
from metatp.cli import main
from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

openai = optional_import("openai")
httpx = optional_import("httpx")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=24, default_type="Q8_0",
                 n_ctx_train=32768)    # the `path` fixture (tests/conftest.py)
HUGE = dict(max_tokens=100_000, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7]                    # token ids: their count is the prompt's


# ---------------------------------------------------------------- the Python API
def test_generation_ends_with_length_at_the_cap_and_equals_the_uncapped_run(path):
    capped = LLM(path, n_ctx=512, backend="numpy", max_model_len=64)
    out = capped.generate([PROMPT], SamplingParams(**HUGE))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - len(PROMPT)
    assert capped.engine.cells.n_used == 0                        # its cells are freed at the end
    free = LLM(path, n_ctx=512, backend="numpy")                  # None: the cache alone (n_ctx - prompt + 1)
    whole = free.generate([PROMPT], SamplingParams(**HUGE))[0].outputs[0]
    assert len(whole.token_ids) == 512 - len(PROMPT) + 1
    assert whole.token_ids[:len(out.token_ids)] == out.token_ids  # the cap only cuts the same tokens short


def test_a_prompt_past_the_cap_is_refused_naming_its_length_and_the_cap(path):
    llm = LLM(path, n_ctx=512, backend="numpy", max_model_len=64)
    with pytest.raises(ContextOverflowError, match=r"prompt has 65 tokens.*at most 64 \(max_model_len\)"):
        llm.generate([list(range(2, 67))], SamplingParams(temperature=0.0, max_tokens=1))
    with pytest.raises(ContextOverflowError, match="65 tokens"):
        llm.score(list(range(2, 67)))
    at = llm.generate([list(range(2, 66))], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert at.finish_reason == "length" and at.token_ids == []     # a prompt of exactly the cap: no room left
    assert llm.score(list(range(2, 66))).shape[0] == 64
    assert llm.engine.cells.n_used == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64"])
def test_a_bad_cap_is_a_config_error(path, bad):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(path, n_ctx=64, backend="numpy", max_model_len=bad)


def test_a_cap_past_the_cache_is_a_config_error(path):
    with pytest.raises(ConfigError, match="max_model_len=65.*n_ctx=64"):
        LLM(path, n_ctx=64, backend="numpy", max_model_len=65)


def test_a_huge_request_does_not_hold_back_small_ones_at_admission(path):
    """Four 128-cell pages: capped at 128, the huge request takes one and three small ones share
    its first step (uncapped, it would reserve the whole cache and they would wait for its end)."""
    llm = LLM(path, n_ctx=512, backend="numpy", max_num_seqs=4, max_model_len=128)
    outs = llm.generate([PROMPT, [8, 9], [10, 11], [12, 13]],
                        [SamplingParams(**HUGE)] + [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 3)
    assert llm.scheduler.metrics.max_step_seqs == 4
    assert [len(o.outputs[0].token_ids) for o in outs] == [128 - len(PROMPT), 4, 4, 4]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert llm.engine.cells.n_used == 0


# ---------------------------------------------------------------- the server
class Server(MetatpServe):
    def running(self) -> float:
        text = httpx.get(self.base + "/metrics", timeout=30).text
        line = next(ln for ln in text.splitlines() if ln.startswith("metatp_requests_running "))
        return float(line.split()[1])


@pytest.fixture(scope="module")
def cap_server(path, tmp_path_factory):
    s = Server(path, "-c", "32768", "--parallel", "4", log=tmp_path_factory.mktemp("cap") / "serve.log")
    yield s
    s.stop()


@requires("serve")
def test_small_requests_finish_in_their_own_time_beside_a_huge_one(cap_server):
    c = cap_server.client()
    done: dict[str, float] = {}
    huge: dict = {}

    def run_huge() -> None:
        # the most the cap leaves (a max_tokens past it is a 400: test_endpoints.py)
        huge["r"] = c.completions.create(model="m", prompt=PROMPT, max_tokens=32768 // 4 - len(PROMPT),
                                         temperature=0, extra_body={"ignore_eos": True})
        done["huge"] = time.monotonic()
    t = threading.Thread(target=run_huge)
    t.start()
    deadline = time.monotonic() + 60
    while cap_server.running() < 1 and time.monotonic() < deadline:   # the huge one holds its slot
        time.sleep(0.02)
    sent = time.monotonic()
    smalls: dict[int, object] = {}

    def run_small(i: int) -> None:                                 # all three at once, beside the huge one
        smalls[i] = c.completions.create(model="m", prompt=[20 + i, 21 + i], max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        done[f"small{i}"] = time.monotonic()
    small_threads = [threading.Thread(target=run_small, args=(i,)) for i in range(3)]
    for s in small_threads:
        s.start()
    for s in small_threads:
        s.join(timeout=300)
    t.join(timeout=300)
    assert not t.is_alive()
    for i, r in sorted(smalls.items()):
        assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
        assert done[f"small{i}"] < done["huge"], done                # none waited for the huge one to end
    assert max(done[f"small{i}"] for i in range(3)) - sent < 10, done                        # their own time, not max_tokens' 100000
    print(f"\n[cap] huge {done['huge'] - sent:.3f} s after the smalls were sent; smalls "
          f"{[round(done[f'small{i}'] - sent, 3) for i in range(3)]}")
    r = huge["r"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 32768 // 4 - len(PROMPT)    # the cap (n_ctx / parallel) - prompt


@requires("serve")
def test_a_prompt_past_the_cap_is_a_400_naming_it(cap_server):
    c = cap_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="m", prompt=[7] * 8193, max_tokens=2)
    err = e.value.body if isinstance(e.value.body, dict) and "param" in e.value.body else e.value.body["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "8193 tokens" in err["message"] and "8192" in err["message"]
    r = c.completions.create(model="m", prompt=[7] * 8192)          # exactly the cap: no room, "length"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:                          # no room for an asked-for token: 400
        c.completions.create(model="m", prompt=[7] * 8192, max_tokens=2)
    assert "'max_tokens' is too large: 2" in str(e.value)
    models = httpx.get(cap_server.base + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == 8192


@requires("serve")
def test_serve_refuses_a_cap_past_the_cache(path, capsys):
    assert main(["serve", "-m", path, "--backend", "numpy", "-c", "256", "--max-model-len", "300"]) == 1
    assert "max_model_len=300" in capsys.readouterr().err
