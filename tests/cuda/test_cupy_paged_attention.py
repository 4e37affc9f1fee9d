"""Each sequence reads only its own cells on the cupy backend (issue 46 item 1, attention side),
on the CPU emulator.

A masked FLASH_ATTN_EXT of several rows turns its mask into per-row cell lists on the device
(`attn_mask_count` / `attn_mask_cells`) and runs the cell-list decode kernel
(`attn_decode_cells_*`) instead of the dense kernels that scan the whole span. What must hold:
that path is the one taken (the emulator sees its kernels launched, eagerly and in replayed
CUDA graphs), and 16 concurrent sequences of different lengths each get the greedy tokens they
get alone on the dense kernels (``METATP_ATTN_CELLS=0``), on float and quantized KV caches.
The kernels themselves are checked against numpy in `metatp.testing.kernel_checks.attn`.
"""

from __future__ import annotations

import warnings

import pytest

from metatp import LLM, SamplingParams
from metatp.backends.cuda.kernels.attn import attention_cells_splits, attention_splits
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.emulated_gpu import on_emulator, record_launches
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, tied=False, seed=11, default_type="Q8_0",
                 n_ctx_train=4096)     # head_dim 32: whole quantized blocks; the `path` fixture (tests/conftest.py)
#: 16 prompts of 1..31 tokens: lists of different lengths, crossing the cells kernel's tiles
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(1 + 2 * i)] for i in range(16)]
#: 3 tokens: the prefill's, an eager decode step's, a captured and replayed one's
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
CELLS_KERNELS = ("attn_mask_count", "attn_mask_cells", "attn_decode_cells_")


def paged_on_emulator(rt: EmuRuntime, cells: bool):
    """`LLM(backend="cupy")` runs on `rt` inside, with the cell-list path on or off."""
    return on_emulator(rt, {"METATP_ATTN_CELLS": "1" if cells else "0"})


class Launched:
    """The kernel names an emulated runtime runs (eager launches and replayed graphs alike)."""

    def __init__(self, rt: EmuRuntime) -> None:
        self.names: set[str] = set()
        record_launches(rt, self.names.add)

    def ran_cells_path(self) -> bool:
        return all(any(n.startswith(k) for n in self.names) for k in CELLS_KERNELS)

    def ran_any_cells_kernel(self) -> bool:
        return any(n.startswith(k) for n in self.names for k in CELLS_KERNELS)


def run_prompts(path: str, cells: bool, prompts, cache_type: str = "f32", concurrent: bool = True):
    """Greedy tokens of `prompts` (all at once, or each alone) and the kernels that ran."""
    rt = EmuRuntime()
    launched = Launched(rt)
    with paged_on_emulator(rt, cells), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, backend="cupy", n_ctx=512, n_batch=64, max_num_seqs=16, cache_type_k=cache_type)
        if concurrent:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        else:
            tokens = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
        assert llm.engine.cells.n_used == 0 and not llm.engine.cells.live
    return tokens, launched


@pytest.fixture(scope="module")
def paged_solo_dense(path):
    """Each prompt alone on the dense kernels (no cell lists anywhere)."""
    tokens, launched = run_prompts(path, cells=False, prompts=PROMPTS, concurrent=False)
    assert not launched.ran_any_cells_kernel()
    return tokens


def test_the_rule_takes_cell_lists_for_masked_steps_of_several_rows(monkeypatch):
    with EmuRuntime().kernels():          # the split counts ask the device's SM count
        check_the_rule(monkeypatch)


def check_the_rule(monkeypatch) -> None:
    assert attention_cells_splits(4, 2, 16, 512, masked=True) is not None
    assert attention_cells_splits(4, 2, 2, 512, masked=True) is not None
    assert attention_cells_splits(4, 2, 256, 512, masked=True) is not None
    assert attention_cells_splits(4, 2, 1, 512, masked=True) is None      # one sequence: the dense decode kernel
    assert attention_cells_splits(4, 2, 16, 512, masked=False) is None
    assert attention_cells_splits(4, 2, 257, 512, masked=True) is None    # beyond the row buckets: prefill kernel
    assert attention_cells_splits(4, 3, 16, 512, masked=True) is None     # a layout the kernels refuse by name
    assert attention_splits(4, 2, 16, 512) is None                       # (what the dense choice would be)
    monkeypatch.setenv("METATP_ATTN_CELLS", "0")
    assert attention_cells_splits(4, 2, 16, 512, masked=True) is None


@requires("emulator")
def test_sixteen_sequences_of_different_lengths_read_their_own_cells(path, paged_solo_dense):
    tokens, launched = run_prompts(path, cells=True, prompts=PROMPTS)
    assert launched.ran_cells_path()
    assert tokens == paged_solo_dense


@requires("emulator")
@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_every_kv_type_gives_the_dense_tokens(path, cache_type):
    prompts = PROMPTS[::4]                       # 4 sequences of 1, 9, 17, 25 tokens
    dense, off = run_prompts(path, cells=False, prompts=prompts, cache_type=cache_type)
    paged, on = run_prompts(path, cells=True, prompts=prompts, cache_type=cache_type)
    assert not off.ran_any_cells_kernel() and on.ran_cells_path()
    assert any(n.startswith(f"attn_decode_cells_{cache_type}_") for n in on.names)
    assert paged == dense


def test_mask_cells_refuses_buffers_smaller_than_rows_times_span():
    import numpy as np

    from metatp.backends.cuda.kernels.attn import mask_cells

    mask = np.zeros((4, 10), np.float32)
    with EmuRuntime().kernels(), pytest.raises(ValueError, match="4 rows x 10 cells"):
        mask_cells(mask, np.zeros(39, np.int32), np.zeros(5, np.int32), np.zeros(4, np.int32), n_rows=4, n_kv=10)
    with EmuRuntime().kernels(), pytest.raises(ValueError, match="4 rows x 10 cells"):
        mask_cells(mask, np.zeros(40, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32), n_rows=4, n_kv=10)
