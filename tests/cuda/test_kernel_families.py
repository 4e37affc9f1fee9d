"""The kernel families own their decisions: each `kernels/<family>.py` exports HANDLERS, FUSIONS and
`workspace`, `ops` / `fusion` only join and order them, and the scratch `workspace` reports is
what the handlers then ask for (the same decision functions)."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from metatp.backends.cuda import fusion as cuda_fusion, kernels as ck, ops
from metatp.backends.cuda.kernels.attn import ATTN_DECODE_MAX_TOKENS, attention_splits, decode_splits
from metatp.backends.cuda.kernels.handler import FusionRow
from metatp.backends.cuda.kernels.matvec import MATVEC_MAX_TOKENS, matmul_path
from metatp.backends.cuda.kernels.mmq import MMQ_MAX_TOKENS, MMQ_MIN_TOKENS
from metatp.backends.cuda.launch import FAMILIES, using
from metatp.backends.fusion import FusionKind
from metatp.ir import ops as ir_ops
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType
from metatp.testing.synth import SynthSpec
from support.require import require
from support.emulated_gpu import record_scratch_requests

SPEC = SynthSpec(n_layer=2, n_embd=192, n_head=6, n_head_kv=3, n_ff=256, n_vocab=320,
                 types={"q": "Q4_1", "k": "Q4_1", "v": "Q8_0", "o": "Q4_1", "gate": "Q4_1", "up": "Q4_1",
                        "down": "Q4_1", "embd": "Q8_0"}, seed=3)


def test_every_family_exports_its_tables():
    assert tuple(ck.FAMILY_MODULES) == FAMILIES
    joined_ops, joined_rows = {}, {}
    for name, mod in ck.FAMILY_MODULES.items():
        assert isinstance(mod.HANDLERS, dict) and all(isinstance(op, Op) for op in mod.HANDLERS), name
        assert all(isinstance(row, FusionRow) for row in mod.FUSIONS), name
        assert callable(mod.workspace), name
        joined_ops.update(mod.HANDLERS)
        joined_rows.update({row.kind: row for row in mod.FUSIONS})
    assert ops.CUDA_OPS == joined_ops
    assert ops.FUSION_ROWS == joined_rows
    assert {op: mod for op, mod in ops.FAMILY_OF_OP.items()} == {
        op: mod for mod in ck.FAMILY_MODULES.values() for op in mod.HANDLERS}


def test_fusion_rows_run_in_fusion_kind_order():
    kinds = [row.kind for row in cuda_fusion.ORDERED_ROWS]
    assert kinds == [k for k in FusionKind if k in kinds]
    assert set(kinds) == set(ops.FUSION_ROWS)
    assert kinds[:5] == [FusionKind.MATVEC_GLU, FusionKind.MATVEC_ADD, FusionKind.QKV_ROPE_KV, FusionKind.MATVEC_MULTI,
                         FusionKind.NORM]


def test_an_op_claimed_by_two_families_is_an_error():
    def handler(ex, d, node):
        return []
    a = types.SimpleNamespace(__name__="fam_a", HANDLERS={Op.ADD: handler}, FUSIONS=())
    b = types.SimpleNamespace(__name__="fam_b", HANDLERS={Op.ADD: handler}, FUSIONS=())
    with pytest.raises(TypeError, match="ADD has handlers in two families"):
        ops._join_handlers({"a": a, "b": b})
    row = ops.FUSION_ROWS[FusionKind.NORM]
    a.FUSIONS = b.FUSIONS = (row,)
    with pytest.raises(TypeError, match="fusion norm has rows in two families"):
        ops._join_fusions({"a": a, "b": b})


def test_kernels_package_names_modules_and_finds_launchers():
    assert isinstance(ck.norm, types.ModuleType) and isinstance(ck.rope, types.ModuleType)
    assert ck.rms_norm is ck.norm.rms_norm
    assert ck.add_inplace is ck.elementwise.add_inplace
    assert ck.WEIGHT_TYPES is ck.matvec.WEIGHT_TYPES
    with pytest.raises(AttributeError, match="no 'no_such_launcher'"):
        ck.no_such_launcher          # noqa: B018


def _mul_mat(tokens: int, weight: bool = True, batched: bool = False):
    w = ir_ops.new_tensor("w", (64, 32, 2 if batched else 1), GGMLType.F32, Flag.WEIGHT if weight else Flag.INPUT)
    x = ir_ops.new_tensor("x", (64, tokens, 2 if batched else 1), GGMLType.F32, Flag.INPUT)
    return ir_ops.mul_mat(w, x)


def test_matmul_path_is_the_one_decision():
    assert matmul_path(_mul_mat(1), gemm_available=True) == "matvec"
    assert matmul_path(_mul_mat(MATVEC_MAX_TOKENS), gemm_available=True) == "matvec"
    assert matmul_path(_mul_mat(MMQ_MIN_TOKENS), gemm_available=True) == "mmq"
    assert matmul_path(_mul_mat(MMQ_MAX_TOKENS), gemm_available=True) == "mmq"
    assert matmul_path(_mul_mat(MMQ_MAX_TOKENS + 1), gemm_available=True) == "gemm"
    assert matmul_path(_mul_mat(MMQ_MAX_TOKENS + 1), gemm_available=False) == "mmq"
    # the backend's range: wider, narrower, or empty (the matvec / cuBLAS split as before)
    assert matmul_path(_mul_mat(512), gemm_available=True, mmq_tokens=(2, 512)) == "mmq"
    assert matmul_path(_mul_mat(2), gemm_available=True, mmq_tokens=(2, 512)) == "mmq"
    assert matmul_path(_mul_mat(1), gemm_available=True, mmq_tokens=(2, 512)) == "matvec"
    assert matmul_path(_mul_mat(MATVEC_MAX_TOKENS + 1), gemm_available=True, mmq_tokens=(9, 8)) == "gemm"
    assert matmul_path(_mul_mat(MATVEC_MAX_TOKENS + 1), gemm_available=False, mmq_tokens=(9, 8)) == "matvec"
    assert matmul_path(_mul_mat(MMQ_MIN_TOKENS, weight=False), gemm_available=True) == "general"
    assert matmul_path(_mul_mat(4, weight=False), gemm_available=True) == "general"
    assert matmul_path(_mul_mat(64, batched=True), gemm_available=True) == "general"


def test_attention_splits_is_the_one_decision():
    from metatp.testing.cuda_emulator import Emulator

    with using(Emulator(sm_count=4)):
        assert attention_splits(6, 3, ATTN_DECODE_MAX_TOKENS + 1, 512) is None
        for tokens in range(1, ATTN_DECODE_MAX_TOKENS + 1):
            for n_kv in (16, 256, 4096):
                assert attention_splits(6, 3, tokens, n_kv) == decode_splits(3, 6, tokens, n_kv)[0]
        assert attention_splits(6, 4, 1, 4096) == 1          # heads the kernel refuses: no workspace


@pytest.mark.parametrize("n", [1, 2])
def test_workspace_covers_what_the_handlers_ask(synth_factory, monkeypatch, n):
    """Every scratch request a handler makes while a plan is recorded fits what `workspace`
    reported for it (so `_presize` allocated it once and nothing was outgrown)."""
    require("emulator")
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.engine import Engine
    from metatp.ir.loader import load_model
    from metatp.ir.models.common import BatchSpec
    from metatp.passes import DeviceLayout
    from metatp.testing import EmuRuntime

    asked = record_scratch_requests(monkeypatch)
    model = load_model(str(synth_factory(SPEC)[0]))
    lay = DeviceLayout(n, "tensor" if n > 1 else "none", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be = CupyBackend(lay, runtime=EmuRuntime(), cuda_graphs=False)
        eng = Engine(model, 512, lay, be)
    # 3 tokens on one device (4 emulated SMs) fill the GPU without splitting the KV; with half the
    # heads per device they split it (partials and, merged in the launch, its counters); a masked step
    # of several rows makes its mask's cell lists
    cells = {"attn_cells@kq_mask", "attn_cell_off@kq_mask", "attn_cell_counts@kq_mask"}
    split = {"attn", "attn_ticket"}
    expected = {1: split, 3: cells | (set() if n == 1 else split), 64: {"gemm_w_float16", "gemm_x_float16"} | cells}
    for tokens, keys in expected.items():
        asked.clear()
        plan, ex = eng.plan_for(BatchSpec(tokens, eng.kv_span(tokens + 300, tokens), 1))
        with be.rt.kernels():
            needs = [be._scratch_needs(plan, d) for d in range(n)]
        kernel_keys = {key for key, _ in asked} - {"recv_f32", "wire", "recv_bf16"}
        assert kernel_keys == keys, tokens
        for key, count in asked:
            assert any(key in need and count <= need[key][0] for need in needs), (tokens, key, count)
        assert not ex._retired
        assert all(np.dtype(a.dtype) == np.dtype(needs[d][k][1]) for d in range(n) for k, a in ex._scratch[d].items())
