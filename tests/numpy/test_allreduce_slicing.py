"""All-reduce (butterfly vs a float64 sum) and split/gather of full arrays by split state."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.collectives import TransferOp, allreduce, butterfly_schedule
from metatp.backends.slicing import gather_array, split_array
from metatp.ir import ops
from metatp.passes.plan import TensorPlan
from metatp.passes.state import SplitState


# ---------------------------------------------------------------- all-reduce


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 16), size=st.integers(0, 40), seed=st.integers(0, 2**16), data=st.data())
def test_butterfly_equals_sum_with_nan_garbage_in_inactive(n, size, seed, data):
    rng = np.random.default_rng(seed)
    active = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    vals = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    bufs = [v.copy() if a else np.full(size, np.nan, np.float32) for v, a in zip(vals, active)]
    want = sum((v.astype(np.float64) for v, a in zip(vals, active) if a), np.zeros(size))
    allreduce(bufs, active, mode="butterfly")
    for b in bufs:
        assert not np.isnan(b).any()
        np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)
        assert np.array_equal(b, bufs[0])            # every device ends with the same bits


def test_butterfly_in_place_on_strided_views_and_rounds():
    base = [np.arange(12, dtype=np.float32).reshape(3, 4) * (j + 1) for j in range(5)]
    views = [b[:, ::2] for b in base]
    allreduce(views, [True] * 5, mode="butterfly")
    assert np.array_equal(base[3][:, ::2], np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2] * 15)
    assert np.array_equal(base[3][:, 1::2], np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1::2] * 4)
    adds = [sum(t.op is TransferOp.ADD for t in r) > 0 for r in butterfly_schedule(5, 4).rounds]
    assert adds == [True, True, True, False]         # fold + log2(4) doubling rounds, then copy back
    assert [len(butterfly_schedule(n, 1).rounds) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 3, 2, 4, 3, 5, 4]


# ---------------------------------------------------------------- split / gather


@st.composite
def split_cases(draw):
    ne = [draw(st.integers(1, 5)) for _ in range(4)]
    axis = draw(st.integers(0, 3))
    n = draw(st.integers(1, 16))
    n_seg = draw(st.integers(1, 3))
    segs = []
    for _ in range(n_seg):
        per_dev = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        nr = draw(st.integers(1, 3))
        segs.append((per_dev, nr))
    total = sum(sum(pd) * nr for pd, nr in segs)
    if total == 0:
        segs[0][0][0] = 1
        total = sum(sum(pd) * nr for pd, nr in segs)
    ne[axis] = total
    return ne, SplitState.segmented(axis, segs), n


@settings(max_examples=150, deadline=None)
@given(case=split_cases(), seed=st.integers(0, 2**16))
def test_split_then_gather_round_trips(case, seed):
    ne, state, n = case
    t = ops.new_tensor("w", ne)
    tp = TensorPlan(t, state, state, [], [True] * n)
    full = np.random.default_rng(seed).standard_normal(tuple(reversed(ne))).astype(np.float32)
    parts = split_array(full, t, tp, n)
    assert len(parts) == n
    for j, p in enumerate(parts):
        assert p.shape[3 - state.axis] == state.extent(j)           # zero slices are empty arrays
    assert np.array_equal(gather_array(parts, t, tp), full)
    # device j's slice is its chunks, in (segment, repeat) order
    ax = 3 - state.axis
    for j, g, loc, length in state.chunks():
        src = np.take(full, range(g, g + length), axis=ax)
        assert np.array_equal(np.take(parts[j], range(loc, loc + length), axis=ax), src)


def test_mirrored_and_partial_slices():
    t = ops.new_tensor("b", (3, 2))
    full = np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)      # numpy shape = reversed(ne), 4-D
    m = SplitState.mirrored()
    parts = split_array(full, t, TensorPlan(t, m, m, [], [True] * 3), 3)
    assert all(np.array_equal(p, full) for p in parts) and parts[0] is not parts[1]
    p = SplitState.partial()
    tp = TensorPlan(t, p, p, [], [True] * 3, owner=2)
    parts = split_array(full, t, tp, 3)
    assert np.array_equal(parts[2], full) and not parts[0].any() and not parts[1].any()
    assert np.array_equal(gather_array(parts, t, tp), full)
    tp.compute = [True, False, True]
    parts[1][...] = np.nan                                # a skipped device's buffer is never read
    assert np.array_equal(gather_array(parts, t, tp), full)
