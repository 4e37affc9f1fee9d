"""ir.models.inputs: the step-input contract between the graph builders and whoever feeds them."""

from __future__ import annotations

import numpy as np
import pytest

from metatp.ir.models import BatchSpec
from metatp.ir.models.inputs import declare_inputs, kq_masks, make_feed, sequence_values, step_values


def test_declared_leaves_by_batch_shape():
    inp = declare_inputs(BatchSpec(4, 256, 1), swa=True)
    assert [inp.tokens.name, inp.pos.name, inp.kv_idxs.name, inp.kq_mask.name, inp.out_ids.name,
            inp.kq_mask_swa.name] == ["inp_tokens", "inp_pos", "inp_kv_idxs", "kq_mask", "inp_out_ids", "kq_mask_swa"]
    assert inp.kq_mask.ne[:2] == (256, 4) and inp.out_ids.ne[0] == 1
    full = declare_inputs(BatchSpec(4, 256, 4))
    assert full.out_ids is None and full.kq_mask_swa is None


def test_sliding_window_mask_of_the_engine():
    """The SWA mask the engine feeds: the token at position p sees its sequence's cells of
    positions p - window + 1 .. p (here cells are not in position order: a sequence's cells
    can be anywhere in the unified cache)."""
    cells = np.array([7, 2, 5, 0, 3, 6, 1])                  # cell of positions 0..6
    pos = np.array([4, 5, 6])
    causal, swa = kq_masks([cells[: p + 1] for p in pos], pos, 8, window=3, swa=True)
    visible = [sorted(np.nonzero(row == 0)[0].tolist()) for row in swa]
    assert visible == [sorted(cells[2:5]), sorted(cells[3:6]), sorted(cells[4:7])]
    assert [sorted(np.nonzero(row == 0)[0].tolist()) for row in causal] == [sorted(cells[: p + 1]) for p in pos]
    _, no_window = kq_masks([cells[:5]], pos[:1], 8, window=0, swa=True)
    assert np.array_equal(no_window, causal[:1])


def test_feed_fills_exactly_the_declared_leaves():
    inp = declare_inputs(BatchSpec(2, 256, 1))
    feed = make_feed(inp, sequence_values(inp, [5, 9], n_past=3))
    assert feed[inp.pos].tolist() == [3, 4] == feed[inp.kv_idxs].tolist()
    assert feed[inp.out_ids].tolist() == [1] and feed[inp.tokens].dtype == np.int32
    assert np.nonzero(feed[inp.kq_mask][1] == 0)[0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="out_ids"):
        step_values(inp, np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32), [[0], [0]])
    values = sequence_values(inp, [5, 9], n_past=3)
    with pytest.raises(ValueError, match="kq_mask_swa"):
        make_feed(inp, type(values)(**{**values.__dict__, "kq_mask_swa": values.kq_mask}))
    with pytest.raises(ValueError, match="shape"):
        make_feed(inp, type(values)(**{**values.__dict__, "tokens": np.zeros(3, np.int32)}))
