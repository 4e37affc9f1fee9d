"""Cells on demand speak cells only (issue 45 item 2): `CellDemand` admits, grows and frees
sequences, the scheduler owns preemption, and every cell operation rank 0's cache makes reaches
the followers through its listener (`KVCells.listener`, installed by the `Leader`)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from metatp.kv_cells import CACHED, KVCells
from metatp.kv_demand import CellDemand
from metatp.lockstep import Leader
from metatp.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]


def test_admit_grow_and_free_take_cells_a_page_at_a_time():
    cells = KVCells(256)
    demand = CellDemand(cells, Metrics(), prefix_caching=False)
    seq = demand.admit(list(range(10)), n_cells=40, alone=True)
    assert seq is not None and seq.capacity == 16 and seq.n_past == 0      # prompt + next token, a block
    seq.n_past = 16
    assert demand.grow(seq, n_cells=40, shared=False) and seq.capacity == 32
    seq.n_past = 17
    assert demand.grow(seq, n_cells=40, shared=False) and seq.capacity == 32     # room already
    seq.n_past = 32
    assert demand.grow(seq, n_cells=40, shared=False) and seq.capacity == 40     # never past what it can use
    assert demand.admit(list(range(300)), n_cells=300, alone=True) is None       # cannot hold it now
    demand.free(seq)
    assert cells.n_used == 0


def test_a_freed_sequence_with_its_tokens_leaves_its_blocks_to_the_next():
    cells = KVCells(256)
    m = Metrics()
    demand = CellDemand(cells, m, prefix_caching=True)
    ids = list(range(1, 41))
    seq = demand.admit(ids, n_cells=50, alone=True)
    seq.n_past = 40                                         # as if prefilled
    demand.free(seq, ids)                                   # finished: its two whole blocks stay
    assert cells.n_cached == 32 and cells.n_used == 0
    again = demand.admit(ids + [99], n_cells=50, alone=True)
    assert again.n_past == 32 and m.prefix_hit_tokens == 32
    demand.free(again)                                      # failed: nothing more kept, the blocks unpinned
    assert cells.n_used == 0 and cells.n_cached == 32
    assert demand.admit(ids, n_cells=50, alone=True, cached=False).n_past == 0    # a scoring request


def test_the_listener_hears_what_followers_replay_and_nothing_the_engine_does_alike():
    cells = KVCells(256)
    heard: list[tuple] = []
    cells.listener = heard.append
    mine = cells.reserve(8)                                  # every rank's engine does this alike
    cells.grow(mine, 20)
    cells.free(mine)
    assert heard == []
    seq = cells.try_reserve(4, 16)
    added = cells.try_grow(seq, 20, 32)
    seq.n_past = 16
    cells.cache(seq.cells[:16])
    cells.free(seq)
    assert [op[0] for op in heard] == ["take", "grow", "cache", "free"]
    assert heard[0][1] == seq.id and heard[0][3] == 0 and np.array_equal(heard[1][2], added)
    cached = np.flatnonzero(cells.owner == CACHED)
    cells.uncache(cached)
    assert heard[-1][0] == "uncache" and np.array_equal(heard[-1][1], cached)


def test_the_leader_listens_to_rank_0s_cache():
    cells = KVCells(64)
    leader = Leader(world=None, cells=cells)
    seq = cells.try_reserve(4)
    cells.free(seq)
    assert [op[0] for op in leader.ops] == ["take", "free"]


def test_kv_demand_knows_no_request_and_no_scheduler():
    tree = ast.parse((ROOT / "metatp" / "kv_demand.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "metatp.scheduler" not in names
    assert "Request" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
