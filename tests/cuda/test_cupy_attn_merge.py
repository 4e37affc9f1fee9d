"""Decode attention merging its split-KV partials inside its own launch (issue 44 item 2), on the
cupy backend over the CPU emulator.

With the backend option ``attn_merge`` (default) a split decode launch merges its partials itself:
the last block of each (token, head group), by a ticket counter in the family's scratch, merges in
split-index order and puts the counter back to 0. What must hold: no ``attn_merge_f32`` launch is
left, the logits are the same bits as with the merge kernel after the decode launch
(``attn_merge=False``) over a prompt and decode steps replayed from CUDA graphs with the emulator
running blocks in a shuffled order, on one device and on two (tensor split), and every counter is
0 between steps. The kernel itself is checked against float64 in `metatp.testing.kernel_checks.attn`.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.engine import Engine
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.emulated_gpu import record_launches
from support.require import requires

pytestmark = requires("emulator")

SPEC = SynthSpec(n_layer=2, n_embd=128, n_head=8, n_head_kv=2, n_ff=128, n_vocab=200, tied=False, seed=9,
                 default_type="Q8_0")     # G=4, head_dim 16; the `synth_model` fixture (tests/conftest.py)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93, 75, 10,
          58, 20, 97, 49, 44, 59, 23, 7, 81, 64, 6, 28, 62, 8, 99, 86, 34, 82, 53, 42, 11, 70, 67, 98, 21, 17, 45,
          60, 5, 1, 2, 4, 9, 12, 13, 16, 18, 22, 24, 25]       # 66 tokens: the decode steps split the KV
STEPS = 4


def decode_engine(model, attn_merge: bool, n: int, order: str):
    """An engine on a fresh emulated GPU running blocks in `order`, and the kernel names it launches.
    Its new buffers hold garbage, as device memory does (counters the backend forgot to zero show)."""
    rt = EmuRuntime()
    rt.emu.block_order = order
    empty = rt.empty

    def garbage(shape, dtype):
        a = empty(shape, dtype)
        a.reshape(-1).view(np.uint8)[...] = 0x5A
        return a
    rt.empty = garbage
    seen: Counter = Counter()
    record_launches(rt, lambda name: seen.update((name,)))
    lay = DeviceLayout(n, "tensor" if n > 1 else "none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be = CupyBackend(lay, runtime=rt, cuda_graphs=True, attn_merge=attn_merge)
        return Engine(model, 512, lay, be), seen


def counters(eng: Engine) -> list[np.ndarray]:
    """Every merge counter buffer of the engine's executables (each device's)."""
    return [np.asarray(scratch["attn_ticket"]) for ex in eng.backend._executables.values()
            for scratch in ex._scratch if "attn_ticket" in scratch]


@pytest.mark.parametrize("n", [1, 2])
def test_the_merge_inside_the_decode_launch_gives_the_merge_kernels_bits(synth_model, n):
    merged, seen_merged = decode_engine(synth_model, True, n, "shuffle")
    apart, seen_apart = decode_engine(synth_model, False, n, "forward")
    a, b = merged.forward(PROMPT), apart.forward(PROMPT)
    assert np.array_equal(a, b)
    # the first executable asked for every module its plans may launch, once
    assert merged.backend.rt.precompiled == [((0,), tuple(merged.backend.kernel_families()))]
    for _ in range(STEPS):
        tok = int(np.argmax(a))
        a, b = merged.forward([tok]), apart.forward([tok])
        assert np.array_equal(a, b)
        tickets = counters(merged)
        assert tickets and all(not t.any() for t in tickets), tickets
    assert seen_apart["attn_merge_f32"] > 0                 # the KV was split ...
    assert "attn_merge_f32" not in seen_merged              # ... and merged in the decode launch
    assert any(k.startswith("attn_decode_") for k in seen_merged)
    assert merged.backend.rt.graph_launches > 0             # decode steps replayed captured graphs
    assert not counters(apart)
