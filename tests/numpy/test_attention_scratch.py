"""The attention kernels' shared scratch buffer: one per device of a plan (its kernels run one after
another), never one for two devices (with parallel_devices their kernels run at the same time)."""

from __future__ import annotations

import numpy as np

from metatp.backends import create_backend
from metatp.backends.numpy.executable import _DeviceContext
from metatp.backends.numpy.kernels.attention import _shared_scratch
from metatp.passes.plan import DeviceLayout
from metatp.sampling import SamplingParams
from metatp.testing.synth import SynthSpec
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=52, default_type="Q8_0")


def test_each_device_has_its_own_scratch_shared_by_its_kernels():
    be = create_backend("numpy", DeviceLayout(2, "tensor"), parallel_devices=True)
    plan_memo: dict = {}                 # one plan's memo, shared by its device contexts
    c0, c1 = (_DeviceContext(be, d, {}, plan_memo) for d in (0, 1))
    a, b = _shared_scratch(c0, 100), _shared_scratch(c0, 80)
    assert a is b and a.size >= 100
    other = _shared_scratch(c1, 100)
    assert not np.shares_memory(a, other)
    assert _shared_scratch(c0, 500).size >= 500          # a larger request gets a larger buffer


@requires("cpu_kernels")
def test_parallel_devices_decode_as_the_devices_in_turn(path):
    from metatp import LLM

    prompts = [[1, 4 + i, 9, 2 + 3 * i] for i in range(4)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for parallel in (False, True):
        llm = LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", max_num_seqs=4,
                  backend_options={"parallel_devices": parallel})
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    assert outs[0] == outs[1]
