"""Every numeric parameter at its extremes: denormals, huge values, inf, NaN, negative zero, huge ints.

Each one works as its definition says or is a ConfigError naming it -- never a numpy or Python
exception from inside, a hang or a huge allocation. A tiny (even denormal) temperature samples
the softmax's limit (greedy among the maximal logits); an impossible n_ctx is refused by the
memory plan before anything that grows with n_ctx exists.
"""

from __future__ import annotations

import math
import time
import tracemalloc
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metatp import LLM, SamplingParams
from metatp.cli import main
from metatp.ir.errors import ConfigError, MemoryPlanError, MetatpError
from metatp.kv_cells import KVCells
from metatp.passes.memory import parse_bytes
from metatp.sampling import MAX_N, Sampler, _scaled
from metatp.testing.synth import SynthSpec

pytestmark = pytest.mark.filterwarnings("ignore:n_ctx=.*beyond the model's trained context:UserWarning",
                                        "ignore:.*KV heads:UserWarning")

SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=5)
EXTREMES = [0.0, -0.0, 5e-324, 1e-310, 1e-30, 1e308, math.inf, -math.inf, math.nan,
            2**63, 2**64, 10**30, -1, 0.5, 1, 2]
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens", "n", "logprobs"]
LLM_OPTIONS = {"n_ctx": 64}    # the shared `llm` fixture
BIG_ALLOCATION = 64 * 2**20          # no refusal may allocate more than this on its way


def outcome(call):
    """'ok' with the result, or the MetatpError raised (anything else fails the test)."""
    try:
        return "ok", call()
    except MetatpError as e:
        return "error", e


# ---------------------------------------------------------------- SamplingParams through generate
@pytest.mark.parametrize("value", EXTREMES, ids=repr)
@pytest.mark.parametrize("name", SAMPLING)
def test_sampling_parameter_at_its_extremes_works_or_names_itself(llm, name, value):
    kw = {"max_tokens": 3, "temperature": 1.0, "seed": 0, "ignore_eos": True, name: value}
    kind, got = outcome(lambda: llm.generate("hi", SamplingParams(**kw)))
    if kind == "error":
        assert isinstance(got, ConfigError) and name in str(got), str(got)
        return
    outs = got[0].outputs
    room = 64 - len(got[0].prompt_token_ids) + 1          # n_ctx 64; the last token needs no cell
    assert len(outs) == (value if name == "n" else 1)
    for o in outs:
        assert all(0 <= t < llm.n_vocab for t in o.token_ids)
        assert len(o.token_ids) == (min(value, room) if name == "max_tokens" else 3)
        if name == "logprobs":
            assert all(math.isfinite(lp.logprob) for d in o.logprobs for lp in d.values())


def test_negative_zero_is_zero():
    sp = SamplingParams(temperature=-0.0, min_p=-0.0)
    assert sp.greedy and math.copysign(1, sp.temperature) == 1 and math.copysign(1, sp.min_p) == 1


def test_n_is_bounded_so_a_huge_n_is_refused_not_a_hang():
    assert SamplingParams(n=MAX_N).n == MAX_N
    for n in (MAX_N + 1, 2**63, 10**30):
        with pytest.raises(ConfigError, match="n must be"):
            SamplingParams(n=n)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300])
def test_tiny_temperature_is_the_greedy_limit_batch_invariant_and_seeded(llm, temperature):
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=5, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p in ("hi", "there")]
    together = [o.outputs[0].token_ids for o in llm.generate(["hi", "there"], sp)]
    assert together == alone
    assert alone == [llm.generate(p, greedy)[0].outputs[0].token_ids for p in ("hi", "there")]


# ---------------------------------------------------------------- the sampler itself
ORDINARY = st.builds(
    dict, temperature=st.floats(0.05, 5.0), top_k=st.sampled_from([-1, 1, 3, 10]), top_p=st.floats(0.1, 1.0),
    min_p=st.floats(0.0, 0.5), repetition_penalty=st.sampled_from([1.0, 0.8, 1.3, 2.0]), seed=st.integers(0, 2**32))
LOGITS = st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=40).map(lambda v: np.array(v, np.float32))
HOSTILE_LOGITS = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=2, max_size=40).map(
    lambda v: np.array(v, np.float32))
ANY_TEMPERATURE = st.one_of(st.sampled_from([0.0, 5e-324, 1e-310, 1e-300, 1e-30, 1e300, 1e308]),
                            st.floats(0.0, 1e308))
ANY_PENALTY = st.one_of(st.sampled_from([5e-324, 1e-310, 1e-46, 1e-40, 1.0, 3.5e38, 1e300, 1e308]),
                        st.floats(5e-324, 1e308))


@settings(max_examples=200, deadline=None)
@given(LOGITS, ORDINARY)
def test_ordinary_temperatures_divide_exactly_as_before(logits, kw):
    """The overflow guard is the only change on the sampling path: wherever the quotient is
    finite, `_scaled` is the plain float64 quotient to the bit, so seeded draws are unchanged."""
    x = logits.astype(np.float64)
    assert np.array_equal(_scaled(x, kw["temperature"]), x / kw["temperature"])


def test_the_overflow_guard_takes_the_max_off_first():
    x = np.array([1.0, 3.0, 3.0, -2.0])
    with np.errstate(over="ignore"):     # the sampler's caller ignores it too: an overflow is a -inf logit
        z = _scaled(x, 1e-310)
    assert z.tolist()[1:3] == [0.0, 0.0] and np.all(z[[0, 3]] < -1e300)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(HOSTILE_LOGITS, ANY_TEMPERATURE, ANY_PENALTY, st.sampled_from([-1, 1, 2, 2**63]),
       st.sampled_from([5e-324, 1e-310, 0.5, 1.0]), st.sampled_from([0.0, 5e-324, 0.5, 1.0]), st.data())
def test_any_accepted_values_sample_a_valid_token(logits, temperature, penalty, top_k, top_p, min_p, data):
    history = data.draw(st.lists(st.integers(0, logits.size - 1), max_size=6))
    p = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_k=top_k, top_p=top_p,
                       min_p=min_p, seed=1)
    with warnings.catch_warnings(), np.errstate(invalid="raise", divide="raise"):
        warnings.simplefilter("error")             # no NaN, no division by zero, no warning on the way
        picks = [Sampler(p, np.random.default_rng(0))(logits, history) for _ in range(2)]
    assert picks[0] == picks[1] and 0 <= picks[0] < logits.size


@settings(max_examples=80, deadline=None)
@given(HOSTILE_LOGITS, st.sampled_from([5e-324, 1e-310, 1e-300]), st.integers(0, 2**32))
def test_tiny_temperature_picks_among_the_maximal_logits(logits, temperature, seed):
    tok = Sampler(SamplingParams(temperature=temperature, seed=seed), np.random.default_rng(0))(logits)
    assert logits[tok] == logits.max()


def test_ties_at_a_tiny_temperature_are_drawn_uniformly():
    s = Sampler(SamplingParams(temperature=1e-310, seed=4), np.random.default_rng(0))
    picks = [s(np.array([1.0, 3.0, 3.0, -2.0], np.float32)) for _ in range(200)]
    assert set(picks) == {1, 2} and 60 < picks.count(1) < 140


def test_a_penalty_beyond_float32_keeps_the_order_it_defines():
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.0], np.float32)
    seen = [0, 1, 3, 4]
    for t in (0.0, 1e-310, 1.0):
        tiny = Sampler(SamplingParams(temperature=t, repetition_penalty=5e-324, seed=2), np.random.default_rng(0))
        assert {tiny(logits, seen) for _ in range(20)} == {1}      # 3 / penalty beats 1 / penalty
        huge = Sampler(SamplingParams(temperature=t, repetition_penalty=1e308, seed=2), np.random.default_rng(0))
        if t < 1.0:
            assert {huge(logits, seen) for _ in range(20)} == {2}  # the unseen 3 is all that is left on top


# ---------------------------------------------------------------- n_ctx and the memory plan
def refused_quickly(call, error=MetatpError) -> BaseException:
    """The error `call` raises, checked to take well under a second of this process's CPU time
    (not wall time, which other processes on a loaded machine stretch) and no large allocation."""
    tracemalloc.start()
    t0 = time.process_time()
    try:
        with pytest.raises(error) as info:
            call()
        took = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 1.0, took
    assert peak < BIG_ALLOCATION, peak
    return info.value


@pytest.mark.parametrize("n_ctx", [10**9, 2**31 - 1])
@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_an_impossible_context_is_refused_by_the_memory_plan_before_any_allocation(path, n_ctx, budget):
    e = refused_quickly(lambda: LLM(path, n_ctx=n_ctx, backend="numpy", memory_budget=budget), MemoryPlanError)
    assert f"n_ctx={n_ctx}" in str(e) and "budget is" in str(e) and "GiB" in str(e)
    assert "host cell tables and masks" in str(e)


@pytest.mark.parametrize("n_ctx", [2**31, 2**63, 10**30])
def test_a_context_past_32_bit_cells_is_a_config_error(path, n_ctx):
    e = refused_quickly(lambda: LLM(path, n_ctx=n_ctx, backend="numpy"), ConfigError)
    assert "n_ctx" in str(e)


def test_fit_context_from_an_impossible_context_plans_without_allocating(path):
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        llm = LLM(path, n_ctx=10**9, backend="numpy", memory_budget="8MiB", fit_context=True)
        took, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 3.0 and peak < BIG_ALLOCATION, (took, peak)
    assert 0 < llm.n_ctx < 10**9 and llm.engine.n_ctx == llm.n_ctx
    assert len(llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


def test_the_cell_table_is_made_on_first_use_and_planned():
    cells = KVCells(10**12, page=128)             # 8 TB if it were allocated here
    assert cells.n_used == 0 and cells._owner is None
    small = KVCells(300, page=128)
    seq = small.reserve(5)
    assert small.n_used == 5 and small.owner.nbytes == 300 * KVCells.TABLE_BYTES
    small.free(seq)
    assert small.n_used == 0
    assert KVCells.planned_bytes(300) >= small.owner.nbytes


def test_the_memory_plan_counts_the_host_tables_and_masks(llm):
    mem = llm.engine.memory_plan()
    rows = min(llm.engine.n_batch, llm.n_ctx)
    assert mem.host == KVCells.planned_bytes(llm.n_ctx) + rows * llm.n_ctx * 4     # one kq_mask, no SWA


@pytest.mark.parametrize("text", ["nanGiB", "infGiB", "1e400", "1e308GiB", "0.5", "5e-324", "-0GiB", "-1e308"])
def test_memory_sizes_at_their_extremes_are_config_errors(path, text):
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes(text)
    with pytest.raises(ConfigError, match="memory size"):
        LLM(path, n_ctx=32, backend="numpy", memory_budget=text)


# ---------------------------------------------------------------- the other LLM(...) numbers
@pytest.mark.parametrize("value", EXTREMES, ids=repr)
@pytest.mark.parametrize("name", ["n_batch", "max_num_seqs", "seed", "n_devices"])
def test_llm_parameter_at_its_extremes_works_or_names_itself(path, name, value):
    def call():
        llm = LLM(path, n_ctx=32, backend="numpy", **{name: value})
        return llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    kind, got = outcome(call)
    if kind == "error":
        assert isinstance(got, ConfigError) and name in str(got), str(got)
    else:
        assert len(got) == 2


@pytest.mark.parametrize("split", [[1, 5e-324], [1, 1e308], [1e308, 1e308], [5e-324, 5e-324], [1, -0.0], [1, 2**64],
                                   [1, math.inf], [1, math.nan], [0.0, -0.0], [1, -5e-324], "1,1e400", "1,nan", "1,-0"],
                         ids=repr)
def test_tensor_split_entries_at_their_extremes_work_or_name_it(path, split):
    def call():
        llm = LLM(path, n_ctx=32, backend="numpy", n_devices=2, tensor_split=split)
        return llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    kind, got = outcome(call)
    if kind == "error":
        assert isinstance(got, ConfigError) and "tensor_split" in str(got), str(got)
    else:
        assert len(got) == 2


# ---------------------------------------------------------------- the CLI and the server's fields
@pytest.mark.parametrize("flags, ok", [
    (["--temp", "1e-310"], True), (["--temp", "5e-324"], True), (["--temp", "-0"], True), (["--temp", "1e308"], True),
    (["--temp", "nan"], "temperature"), (["--temp", "inf"], "temperature"), (["--top-p", "5e-324"], True),
    (["--top-p", "nan"], "top_p"), (["--top-k", str(2**63)], True), (["--min-p", "1e-310"], True),
    (["--repeat-penalty", "5e-324"], True), (["--repeat-penalty", "1e308"], True),
    (["--repeat-penalty", "nan"], "repetition_penalty"), (["-s", str(2**64)], True), (["-s", "-2"], "seed"),
    (["-n", str(2**63)], True), (["-c", str(10**9)], "n_ctx=1000000000"), (["-c", str(2**63)], "n_ctx"),
    (["-ts", "1,1e308"], True), (["-ts", "1,nan"], "tensor_split"), (["--mem", "nanGiB"], "memory size"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_numbers_at_their_extremes(path, capsys, flags, ok):
    rc = main(["generate", "-m", path, "--backend", "numpy", "-c", "32", "-p", "hi", "-n", "2"] + flags)
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" not in line.lower()]
    if ok is True:
        assert rc == 0, err
    else:
        assert rc == 1 and len(err) == 1 and ok in err[0], err


@pytest.mark.parametrize("body, ok", [
    ({"temperature": 1e-310}, True), ({"temperature": 5e-324}, True), ({"temperature": -0.0}, True),
    ({"temperature": math.nan}, "temperature"), ({"temperature": 1e308}, "temperature"), ({"top_p": 5e-324}, True),
    ({"min_p": 5e-324}, True), ({"repetition_penalty": 5e-324}, True), ({"seed": 2**63 - 1}, True),
    ({"seed": 2**63}, "seed"), ({"max_tokens": 2**63}, True), ({"max_tokens": 1e308}, "max_tokens"),
    ({"n": 2**63}, "n"), ({"top_k": 2**64}, True),
], ids=repr)
def test_server_fields_at_their_extremes(llm, body, ok):
    from metatp.server.fields import BadRequest, sampling_params

    try:
        params = sampling_params(body, None, 3)
    except BadRequest as e:
        assert ok is not True and ok in str(e), str(e)
        return
    assert ok is True
    params.max_tokens = min(params.max_tokens, 3)
    assert len(llm.generate("hi", params)[0].outputs[0].token_ids) >= 1


def test_a_budget_larger_than_the_machine_is_a_typed_error_at_allocation(path):
    """An explicit budget is trusted by the plan; when the machine cannot give the KV cache it
    promised (here: an address-space limit), the allocation is a MemoryPlanError, not MemoryError."""
    import subprocess
    import sys

    code = ("import resource, warnings; warnings.simplefilter('ignore')\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from metatp import LLM\nfrom metatp.ir.errors import MemoryPlanError\n"
            "try:\n"
            f"    LLM({path!r}, n_ctx=2**27, memory_budget=2**62, backend='numpy').generate('hi')\n"
            "except MemoryPlanError as e:\n    print('typed:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("typed: device 0: cannot allocate cache_k"), out.stderr[-2000:]
