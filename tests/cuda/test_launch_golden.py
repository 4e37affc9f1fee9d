"""The frozen launch lists of a few small plans, against a golden file this module writes.

Refactors of the CUDA handlers, fusion finders and workspace sizing must keep every launch the
same: same kernels, grids, blocks, shared memory, scalar arguments and the same buffers (pointers
numbered by first use, so aliasing is compared, not addresses), the same fusions and the same
scratch buffers. The plans: the synthetic models the backend tests use, on 1 and 2 devices
(tensor split), a one-token decode step and a 64-token prefill, on the CPU emulator.

Regenerate the golden file (only when a change of launches is intended, and say so in the commit):

    python tests/cuda/test_launch_golden.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).with_name("golden") / "launches.json"

Q_TYPES = {"q": "Q4_1", "k": "Q4_1", "v": "Q8_0", "o": "Q4_1", "gate": "Q4_1", "up": "Q4_1", "down": "Q4_1",
           "embd": "Q8_0"}


def _specs():
    from metatp.testing.synth import SynthSpec

    return {
        "llama-q": SynthSpec(n_layer=2, n_embd=192, n_head=6, n_head_kv=3, n_ff=256, n_vocab=320, types=Q_TYPES,
                             seed=3),
        "llama-f32": SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, qkv_bias=True,
                               arch="qwen2", seed=5),
        "qwen3moe": SynthSpec(arch="qwen3moe", n_layer=1, qk_norm=True, head_dim=32, n_expert=4, n_expert_used=2,
                              n_ff_exp=256, expert_down_bias=True, seed=23,
                              types={"down_exps": "Q4_K", "up_exps": "Q8_0"}),
        "phi3": SynthSpec(arch="phi3", n_layer=1, fused_qkv=True, fused_up_gate=True, n_ff=512, tied=False, seed=21,
                          types={"qkv": "Q8_0", "o": "Q8_0", "down": "Q6_K", "up": "Q4_0"}),
    }


PLANS = [(model, n, t) for model in ("llama-q", "llama-f32", "qwen3moe", "phi3") for n in (1, 2) for t in (1, 64)]


class _Pointers:
    """Device addresses numbered by first use (NULL is 'null'): stable across runs, equal
    where the launches share a buffer."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}

    def __call__(self, ptr: int) -> str:
        if ptr == 0:
            return "null"
        return self.ids.setdefault(ptr, f"p{len(self.ids)}")


def _arg(a, ptrs: _Pointers):
    if isinstance(a, np.uint64):
        return ptrs(int(a))
    if isinstance(a, (np.floating, float)):
        return repr(float(a))
    if isinstance(a, (np.integer, int)) and not isinstance(a, bool):
        return ptrs(int(a)) if int(a) >= 2**32 else int(a)
    if isinstance(a, str):
        return a
    return type(a).__name__


def _step(s, ptrs: _Pointers) -> str:
    from metatp.backends.cuda.device_ops import HostStep, Memset, StreamCall
    from metatp.backends.cuda.launch import Launch

    if isinstance(s, Launch):
        args = ",".join(str(_arg(a, ptrs)) for a in s.args)
        return f"{s.name} grid={list(s.grid)} block={list(s.block)} smem={s.shared_mem} ({args})"
    if isinstance(s, Memset):
        return f"memset {ptrs(int(s.ptr))} {s.nbytes}"
    if isinstance(s, (HostStep, StreamCall)):         # "host": the text the golden file has for both
        cells = dict(zip(s.fn.__code__.co_freevars, (c.cell_contents for c in s.fn.__closure__ or ())))
        args = cells.get("args")
        shown = ",".join(str(_arg(a, ptrs)) for a in args) if isinstance(args, tuple) else ""
        return f"host {s.what} ({shown})"
    return type(s).__name__


def trace(model_name: str, n: int, n_tokens: int, gguf_dir: Path) -> dict:
    """The frozen steps, fusions and scratch buffers of one plan on the emulator."""
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.engine import Engine
    from metatp.ir.loader import load_model
    from metatp.ir.models.common import BatchSpec
    from metatp.passes import DeviceLayout
    from metatp.testing import EmuRuntime
    from metatp.testing.synth import write_synthetic_gguf

    path = gguf_dir / f"{model_name}.gguf"
    if not path.exists():
        write_synthetic_gguf(path, _specs()[model_name])
    model = load_model(str(path))
    lay = DeviceLayout(n, "tensor" if n > 1 else "none", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be = CupyBackend(lay, runtime=EmuRuntime(), cuda_graphs=False)
        eng = Engine(model, 512, lay, be)
        n_kv = eng.kv_span(n_tokens + 200, n_tokens)
        plan, ex = eng.plan_for(BatchSpec(n_tokens, n_kv, 1))
    ptrs = _Pointers()
    steps = [[[_step(s, ptrs) for s in per_dev] for per_dev in sub] for sub in ex.steps]
    idx = plan.graph.index

    def node(t) -> str:
        return f"{idx[t]}:{t.name}"
    fusions = sorted(f"{f.kind.value} at={node(f.at)} absorbed={[node(m) for m in f.absorbed]}"
                     for f in {id(f): f for f in ex.fusions.values()}.values())
    scratch = [{k: [int(a.size), str(a.dtype)] for k, a in sorted(ex._scratch[d].items())} for d in ex.devices]
    return {"steps": steps, "fusions": fusions, "scratch": scratch, "workspace_bytes": be.workspace_bytes(plan)}


def _key(model: str, n: int, t: int) -> str:
    return f"{model} n={n} t={t}"


@pytest.fixture(scope="module")
def golden() -> dict:
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: run `python {Path(__file__).name} --write` in tests/cuda")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("model,n,t", PLANS, ids=[_key(*p) for p in PLANS])
def test_launches_match_golden(golden, tmp_path_factory, model, n, t):
    from support.require import require

    require("emulator")
    got = trace(model, n, t, tmp_path_factory.mktemp("golden"))
    want = golden[_key(model, n, t)]
    assert got["fusions"] == want["fusions"]
    assert got["scratch"] == want["scratch"]
    assert got["workspace_bytes"] == want["workspace_bytes"]
    for k, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        for d, (gd, wd) in enumerate(zip(g, w)):
            assert gd == wd, f"subgraph {k}, device {d}"
    assert len(got["steps"]) == len(want["steps"])


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        print(__doc__)
        return 2
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in PLANS:
            out[_key(*p)] = trace(*p, Path(tmp))
            print(_key(*p), sum(len(d) for sub in out[_key(*p)]["steps"] for d in sub), "steps")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=0) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
