"""The weight/KV split table: rows, segments, granularity, rotation and the share arithmetic."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.ir import ops
from metatp.ir.errors import SplitError
from metatp.ir.tensor import Flag, GGMLType
from metatp.passes.plan import DeviceLayout
from metatp.passes.split_table import ModelDims, SplitTable, integer_weights, rotation_priority, split_sizes
from support.helpers import attn_hparams, llama_hparams

Q4_1, Q8_0, F32 = GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32


def weights_strategy(max_n=16):
    return st.lists(st.integers(0, 5), min_size=1, max_size=max_n).filter(lambda w: sum(w) > 0)


# ---------------------------------------------------------------- share arithmetic


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 10**7), granule=st.integers(1, 4096), w=weights_strategy(), rot=st.integers(0, 40))
def test_split_sizes_exact_and_within_one_granule(total, granule, w, rot):
    sizes = split_sizes(total, granule, w, rot)
    assert sum(sizes) == total
    W = sum(w)
    for s, wj in zip(sizes, w):
        ideal = Fraction(total * wj, W)
        assert abs(s - ideal) < granule, (sizes, w)
        if wj == 0:
            assert s == 0
    off_grid = [s for s in sizes if s % granule]
    tail = total % granule
    assert len(off_grid) <= 1
    if off_grid:
        assert off_grid[0] % granule == tail      # only the tail device is off the grid, by the tail


@settings(max_examples=100, deadline=None)
@given(units=st.integers(0, 50), head_w=st.sampled_from([1, 64, 128, 192]), w=weights_strategy(8),
       rot=st.integers(0, 8), g=st.integers(1, 4))
def test_split_sizes_scale_invariant(units, head_w, w, rot, g):
    """Cutting heads and cutting head*width elements give the same head counts: q, k, v,
    attn_output and the KV cache of a layer always agree."""
    heads = split_sizes(units, g, w, rot)
    elems = split_sizes(units * head_w, g * head_w, w, rot)
    assert [h * head_w for h in heads] == elems


def test_split_sizes_big_totals_stay_exact():
    """No float: 2**40 elements split 1:2 (llama.cpp loses precision above 2**24)."""
    total = 2**40 + 7
    sizes = split_sizes(total, 1, [1, 2])
    assert sum(sizes) == total and abs(sizes[0] - total / 3) < 1


def test_integer_weights_are_exact():
    assert integer_weights([0.1, 0.2], 2) == [1, 2]
    assert integer_weights([3, 1], 2) == [3, 1]
    assert integer_weights(None, 3) == [1, 1, 1]
    assert integer_weights([0.0, 2.5], 2) == [0, 1]


def test_rotation_moves_the_remainder_device():
    # 3 units over 2 equal devices: the extra unit goes to llama.cpp's remainder device (n-1+rot)%n
    assert split_sizes(3, 1, [1, 1], 0) == [1, 2]
    assert split_sizes(3, 1, [1, 1], 1) == [2, 1]
    assert rotation_priority(4, 1) == [0, 3, 2, 1]


def test_largest_remainder_tracks_ratio_better_than_floor():
    """llama.cpp floors every cut, biasing all devices but the remainder device low (#28506).
    Largest remainder: 12 granules at 1:1:1:1:1 give 3,3,2,2,2 (not 2,2,2,2,4)."""
    sizes = split_sizes(12 * 128, 128, [1] * 5, 0)
    assert sorted(sizes) == [256, 256, 256, 384, 384]


# ---------------------------------------------------------------- the table


def make(names_shapes, layout, hp=None, types=None):
    types = types or {}
    ts = [ops.new_tensor(n, ne, types.get(n, F32), Flag.WEIGHT) for n, ne in names_shapes.items()]
    dims = ModelDims.from_hparams(hp) if hp else ModelDims(n_layer=1)
    table = SplitTable(layout, dims, ts)
    return table, {t.name: t for t in ts}


def smollm_like(layout, il=0):
    hp = llama_hparams(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, hd=64, n_ff=1536, n_vocab=1000)
    p = f"blk.{il}."
    shapes = {p + "attn_q.weight": (576, 576), p + "attn_k.weight": (576, 192), p + "attn_v.weight": (576, 192),
              p + "attn_output.weight": (576, 576), p + "ffn_up.weight": (576, 1536), p + "ffn_gate.weight": (576, 1536),
              p + "ffn_down.weight": (1536, 576), f"cache_k_l{il}": (192, 256), f"cache_v_l{il}": (192, 256),
              p + "attn_norm.weight": (576,), "token_embd.weight": (576, 1000), "output_norm.weight": (576,)}
    types = {n: Q4_1 for n in shapes if n.startswith("blk.") and "norm" not in n}
    types["token_embd.weight"] = Q8_0
    return make(shapes, layout, hp, types)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_attention_tensors_cut_in_whole_kv_groups(n):
    for il in (0, 1, 2):
        table, t = smollm_like(DeviceLayout(n, "tensor" if n > 1 else "tensor"), il)
        p = f"blk.{il}."
        q = table.state(t[p + "attn_q.weight"]).extents()
        k = table.state(t[p + "attn_k.weight"]).extents()
        v = table.state(t[p + "attn_v.weight"]).extents()
        o = table.state(t[p + "attn_output.weight"]).extents()
        ck = table.state(t[f"cache_k_l{il}"]).extents()
        assert sum(q) == 576 and sum(k) == 192
        for j in range(n):
            assert k[j] % 64 == 0 and q[j] == 3 * k[j] and v[j] == k[j] == ck[j] and o[j] == q[j]
            assert o[j] % 32 == 0          # whole Q4_1 blocks along attn_output's rows


def test_three_kv_heads_on_four_devices_leave_one_empty():
    table, t = smollm_like(DeviceLayout(4, "tensor"))
    k = table.state(t["blk.0.attn_k.weight"]).extents()
    assert sorted(k) == [0, 64, 64, 64]


def test_bp_doubling_matches_llamacpp_on_two_devices():
    """eq = 3*64 = 192, Q4_1: bp 32 -> 64 -> 128 (stops at 128), gq = lcm(192, 128) = 384:
    q is cut 384 + 192 and the 384 goes to the rotation's remainder device."""
    table, t = smollm_like(DeviceLayout(2, "tensor"), 0)
    assert table.heads_granule(t["blk.0.attn_q.weight"], 0) == 2
    assert table.state(t["blk.0.attn_q.weight"]).extents() == (192, 384)
    table1, t1 = smollm_like(DeviceLayout(2, "tensor"), 1)
    assert table1.state(t1["blk.1.attn_q.weight"]).extents() == (384, 192)   # rotated


def test_ffn_granularity_and_ratio():
    table, t = smollm_like(DeviceLayout(3, "tensor", (3, 0, 1)))
    up = table.state(t["blk.0.ffn_up.weight"])
    down = table.state(t["blk.0.ffn_down.weight"])
    assert up.axis == 1 and down.axis == 0
    assert up.extents() == down.extents() == (1152, 0, 384)
    assert all(e % 128 == 0 for e in up.extents())


def test_mirrored_rows_and_unknown_tensor():
    table, t = smollm_like(DeviceLayout(2, "tensor"))
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"):
        assert table.state(t[name]).is_mirrored
    stray = ops.new_tensor("blk.0.mystery.weight", (4, 4), F32, Flag.WEIGHT)
    with pytest.raises(SplitError, match="mystery"):
        table.state(stray)


def test_misc_rows():
    E, H, Hkv, hd, ff, nexp = 64, 4, 2, 16, 256, 4
    hp = attn_hparams(E, H, Hkv, hd)
    shapes = {
        "blk.0.attn_q_norm.weight": (hd,), "blk.0.attn_k_norm.weight": (hd, Hkv),
        "blk.0.attn_sinks.weight": (H,), "blk.0.attn_output.weight": (H * hd, E), "blk.0.attn_output.bias": (E,),
        "blk.0.attn_q.bias": (H * hd,), "blk.0.ffn_up_exps.weight": (E, ff, nexp),
        "blk.0.ffn_down_exps.weight": (ff, E, nexp), "blk.0.ffn_down_exps.bias": (E, nexp),
        "blk.0.ffn_gate_inp.weight": (E, nexp), "blk.0.ffn_up_shexp.weight": (E, ff), "blk.0.ffn_down.bias": (E,),
        "output.weight": (E, 100), "output.bias": (100,),
        "blk.0.ffn_gate_up_exps.weight": (E, 2 * ff, nexp),
    }
    table, t = make(shapes, DeviceLayout(2, "tensor", (1, 3)), hp)
    s = {n: table.state(x) for n, x in t.items()}
    assert s["blk.0.attn_q_norm.weight"].is_mirrored
    kv_heads = s["blk.0.attn_k_norm.weight"].extents()
    assert s["blk.0.attn_k_norm.weight"].axis == 1 and sum(kv_heads) == Hkv
    assert s["blk.0.attn_output.weight"].extents() == tuple(h * 2 * hd for h in kv_heads)
    assert s["blk.0.attn_sinks.weight"].axis == 0 and s["blk.0.attn_sinks.weight"].extents() == tuple(2 * h for h in kv_heads)
    assert s["blk.0.attn_output.bias"].is_mirrored and s["blk.0.ffn_down.bias"].is_mirrored
    assert s["blk.0.attn_q.bias"].axis == 0 and s["blk.0.attn_q.bias"].extents() == s["blk.0.attn_output.weight"].extents()
    assert s["blk.0.ffn_up_exps.weight"].axis == 1 and s["blk.0.ffn_down_exps.weight"].axis == 0
    assert s["blk.0.ffn_down_exps.bias"].is_partial
    assert s["blk.0.ffn_gate_inp.weight"].is_mirrored and s["blk.0.ffn_up_shexp.weight"].is_mirrored
    assert s["output.weight"].axis == 1 and s["output.bias"].axis == 0
    assert s["output.weight"].extents() == s["output.bias"].extents() == (25, 75)
    gu = s["blk.0.ffn_gate_up_exps.weight"]
    assert gu.nr == (2,) and gu.extents() == tuple(2 * x for x in s["blk.0.ffn_up_exps.weight"].extents())


@pytest.mark.parametrize("hd_v", [16, 24])
def test_fused_qkv_segments(hd_v):
    E, H, Hkv, hd = 64, 6, 3, 16
    hp = attn_hparams(E, H, Hkv, hd, hd_v)
    n_q, n_k, n_v = H * hd, Hkv * hd, Hkv * hd_v
    table, t = make({"blk.0.attn_qkv.weight": (E, n_q + n_k + n_v), "blk.0.attn_output.weight": (H * hd_v, E)},
                    DeviceLayout(3, "tensor", (2, 1, 0)), hp)
    s = table.state(t["blk.0.attn_qkv.weight"])
    if hd_v == hd:
        assert s.nr == (1, 2)
    else:
        assert s.nr == (1, 1, 1)
    heads = [x // hd for x in s.ne[1]]                         # KV heads per device from the K segment
    assert s.ne[0] == tuple(h * 2 * hd for h in heads) and s.ne[-1] == tuple(h * hd_v for h in heads)
    assert sum(heads) == Hkv and heads[2] == 0


def test_fused_up_gate_segment():
    hp = llama_hparams(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, hd=16, n_ff=256)
    table, t = make({"blk.0.ffn_up.weight": (64, 512), "blk.0.ffn_down.weight": (256, 64)}, DeviceLayout(2, "tensor"), hp)
    s = table.state(t["blk.0.ffn_up.weight"])
    assert s.nr == (2,) and s.ne[0] == table.state(t["blk.0.ffn_down.weight"]).ne[0]


def test_rotation_counted_per_layer_class():
    """SWA and full-attention layers rotate separately (no aliasing when the pattern divides n)."""
    hp = llama_hparams(n_layer=4, n_embd=64, n_head=4, n_head_kv=4, hd=16, n_ff=256)
    hp.swa_layers = [True, False, True, False]
    table = SplitTable(DeviceLayout(2, "tensor"), ModelDims.from_hparams(hp))
    assert [table.rotation(il) for il in range(4)] == [0, 0, 1, 1]
    assert table.rotation(None) == 4 % 2


def test_graph_dims_without_hparams():
    """Head geometry read off FLASH_ATTN_EXT (layer from the cache leaf) when no hparams are given."""
    from support.helpers import llama_case
    from metatp.passes.compile import make_table

    hp = llama_hparams(n_layer=2, n_embd=32, n_head=6, n_head_kv=2, hd=8, n_ff=256)
    g, *_ = llama_case(hp, 1, 8, 0, 1)
    table = make_table(g, DeviceLayout(2, "tensor"))
    assert table.dims.attn[1].n_head == 6 and table.dims.attn[1].n_head_kv == 2 and table.dims.n_layer == 2
    ref = make_table(g, DeviceLayout(2, "tensor"), hp)
    for t in g.leaves:
        if not t.flags & Flag.INPUT:
            assert table.state(t) == ref.state(t), t.name
