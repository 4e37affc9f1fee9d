"""Norm + q/k/v + RoPE + K/V cache write of one token in one launch (``cuda/qkv_rope.cu``, fusion
QKV_ROPE_KV): the launcher, the fused handler and the finder that decides which layers it takes.

The kernel shares matvec's row core (``cuda/matvec_core.cuh``); the finder shares matvec's
decisions (which MUL_MATs are one-token matvecs, when x's RMS norm folds into the products).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from metatp.backends.cuda.kernels.handler import FusionRow, Scratch, array_of, record, weight_operand
from metatp.backends.cuda.kernels.matvec import (NORM_FOLD_MAX_ROWS, backend_matmul_path, busiest_output_rows,
                                                 folded_norm_input, folded_norm_kwargs, is_matvec, matvec_block,
                                                 norm_of, same_weight_layout)
from metatp.backends.cuda.kernels.norm import folded_norm_args, unfused_with_folded_norm
from metatp.backends.cuda.launch import (CHUNK_ELEMS, KV_QUANT_TYPES, NULL, WEIGHT_TYPES, cache_type_of,
                                         cdiv, check_block_type, check_contig, check_f32, check_i32, device_ptr, empty,
                                         estrides, f32, i32, kernel_sources, launch, rows2d)
from metatp.backends.cuda.storage import matmul_tokens, quant_cache_type
from metatp.backends.fusion import Fusion, FusionKind, matmuls_of_x
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op, RopeMode
from metatp.ir.tensor import Tensor
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'MIXED_PAIRS', 'CACHE_CODES', 'qkv_rope_kv', 'entry_point', 'stage_floats', 'stage_tickets_ints',
           'HANDLERS', 'FUSIONS', 'WORKSPACE_OPS', 'workspace']

#: values per block of every quantized cache type (a block is quantized by one warp)
QUANT_BLOCK = 32
_PAIR_LINE = re.compile(r"^\s*M\((\w+), \w+, (\w+), \w+\)", re.MULTILINE)
_CODE_LINE = re.compile(r"^\s*M\((\d+), (\w+)\)", re.MULTILINE)


def _source_table(macro: str) -> str:
    """The lines of the table macro `macro` of cuda/qkv_rope.cu (up to its blank line)."""
    src = kernel_sources()["qkv_rope.cu"]
    table = src[src.index(f"#define {macro}(M)"):]
    return table[:table.index("\n\n")]


def _mixed_pairs() -> tuple[tuple[str, str], ...]:
    """The (q/k type, v type) pairs with a kernel: `MT_QKV_MIXED_PAIRS` in cuda/qkv_rope.cu, the one table."""
    return tuple(_PAIR_LINE.findall(_source_table("MT_QKV_MIXED_PAIRS")))


def _cache_codes() -> dict[str, int]:
    """The kernel's cache_type argument per cache type: `MT_QKV_CACHE_CODES` in cuda/qkv_rope.cu."""
    return {name: int(code) for code, name in _CODE_LINE.findall(_source_table("MT_QKV_CACHE_CODES"))}


#: (q/k weight type, v weight type) pairs of different types the kernel takes (llama.cpp's mixes)
MIXED_PAIRS: tuple[tuple[str, str], ...] = _mixed_pairs()
#: cache type -> the code the kernel takes as its cache_type argument (one kernel serves every cache type)
CACHE_CODES: dict[str, int] = _cache_codes()
ENTRY_POINTS = [f"qkv_rope_kv_{t}" for t in WEIGHT_TYPES] + [f"qkv_rope_kv_{a}_{b}" for a, b in MIXED_PAIRS]


def qkv_rope_kv(weights, qtype, x, q, k_cache, v_cache, kv_row, pos, *, ne0: int, n_head: int, n_head_kv: int,
                head_dim: int, n_dims: int, neox: bool, freq_base: float, freq_scale: float = 1.0,
                freq_factors=None, attn_factor: float = 1.0, v_rows: int | None = None, norm_weight=None,
                eps: float | None = None, q_head_stride: int | None = None, cache_type: str | None = None,
                v_qtype=None, stage=None, tickets=None) -> None:
    """One token: x' (x, RMS-normalised when eps is given, as matvec_multi), q = Wq x' and k = Wk x'
    rotated (RoPE NORMAL or NEOX at position pos[0], the first n_dims of each head), q written to
    ``q`` [n_head, head_dim] and k, v = Wv x' stored into row kv_row[0] of the caches.

    weights: ((wq, row_bytes), (wk, row_bytes), (wv, row_bytes)), raw weights of ne0 columns; Wq and
    Wk of `qtype`, Wv of `v_qtype` (default `qtype`; a different one must be a pair of
    `MIXED_PAIRS`). k_cache / v_cache: [cells, n_head_kv*head_dim] / [cells, v_rows] arrays of one
    storage type: f32, f16 or bf16 bits, or uint8 blocks of a quantized type named by `cache_type`
    (head_dim and v_rows multiples of 32; written bit for bit as set_rows quantizes the same f32
    values); one kernel per weight type or pair serves every cache type, told by its `CACHE_CODES` code. A quantized cache goes through `stage` (f32, n_head_kv*head_dim + v_rows) and
    `tickets` (int32 counters, `stage_tickets_ints`, all 0; every launch leaves them 0), made here
    when not given. pos, kv_row: int32 in device memory (graph replays)."""
    if len(weights) != 3:
        raise ValueError(f"qkv_rope_kv takes the q, k and v weights, got {len(weights)}")
    t, qk, _ = check_block_type(qtype, ne0)
    vt = check_block_type(v_qtype, ne0)[0] if v_qtype is not None else t
    check_f32(x, q, norm_weight, freq_factors, stage)
    check_i32(kv_row, pos, tickets)
    if head_dim % 2 or n_dims % 2 or not 0 < n_dims <= head_dim:
        raise ValueError(f"head_dim ({head_dim}) and n_dims ({n_dims}) must be even, 0 < n_dims <= head_dim")
    if v_rows is None:
        v_rows = n_head_kv * head_dim
    if v_rows % 2:
        raise ValueError(f"v_rows ({v_rows}) must be even")
    kt = cache_type_of(k_cache, cache_type)
    if cache_type_of(v_cache, cache_type) != kt:
        raise TypeError("the k and v caches must have the same storage type")
    name = entry_point(t, vt, kt)
    code = CACHE_CODES[kt]
    if freq_factors is not None and freq_factors.size < n_dims // 2:
        raise ValueError(f"freq_factors has {freq_factors.size} entries for n_dims={n_dims}")
    if x.size < ne0:
        raise ValueError(f"x {x.shape} too small for ne0={ne0}")
    k_ne0, _, k_stride = rows2d(k_cache)
    v_ne0, _, v_stride = rows2d(v_cache)
    if k_ne0 < _cache_row_size(kt, n_head_kv * head_dim) or v_ne0 < _cache_row_size(kt, v_rows):
        raise ValueError(f"cache rows of {k_ne0} / {v_ne0} elements cannot hold k ({n_head_kv * head_dim}) "
                         f"/ v ({v_rows})")
    if q.ndim and q.shape[-1] > 1 and estrides(q)[-1] != 1:
        raise ValueError("q's head_dim must be its contiguous dimension")
    if q_head_stride is None:
        q_head_stride = estrides(q)[0] if q.ndim == 2 else head_dim
    if q.size < (n_head - 1) * q_head_stride + head_dim:
        raise ValueError(f"q {q.shape} too small for {n_head} heads of {head_dim}")
    stage, tickets = _stage_and_tickets(kt, n_head_kv, head_dim, v_rows, stage, tickets)
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    n_pairs = (n_head + n_head_kv) * head_dim // 2 + v_rows // 2
    if n_pairs == 0:
        return
    bx, by = matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    (wq, rbq), (wk, rbk), (wv, rbv) = weights
    launch("qkv_rope", name, (cdiv(n_pairs, by),), (bx, by),
           (wq, wk, wv, i32(rbq), i32(rbk), i32(rbv), x, i32(ne0), nw, e, flag, q, i32(q_head_stride),
            k_cache, v_cache, i32(code), kv_row, i32(k_stride), i32(v_stride), i32(n_head), i32(n_head_kv), i32(v_rows),
            i32(head_dim), i32(n_dims), i32(1 if neox else 0), pos, freq_factors, f32(freq_base), f32(freq_scale),
            f32(attn_factor), stage, tickets))


def entry_point(qk_type: str, v_type: str, cache_type: str) -> str:
    """The kernel for q/k weights of `qk_type`, v of `v_type` (one kernel for every cache type: its
    code is an argument); a cache type with no code and a pair of weight types not in `MIXED_PAIRS`
    are refused by name."""
    if cache_type not in CACHE_CODES:
        raise UnsupportedOpError(f"qkv_rope_kv writes {', '.join(CACHE_CODES)} caches, not {cache_type}")
    if qk_type == v_type:
        return f"qkv_rope_kv_{qk_type}"
    if (qk_type, v_type) not in MIXED_PAIRS:
        raise UnsupportedOpError(f"qkv_rope_kv has no kernel for q/k {qk_type} with v {v_type} (pairs: "
                                 f"{', '.join(f'{a}+{b}' for a, b in MIXED_PAIRS)})")
    return f"qkv_rope_kv_{qk_type}_{v_type}"


def _cache_row_size(cache_type: str, n: int) -> int:
    """Storage elements (bytes for a quantized type) of n cache values."""
    if cache_type not in KV_QUANT_TYPES:
        return n
    qk, nbytes = KV_QUANT_TYPES[cache_type]
    return n // qk * nbytes


def stage_floats(n_head_kv: int, head_dim: int, v_rows: int) -> int:
    """The f32 staging row a quantized cache's launch needs: the token's k row, then its v row."""
    return n_head_kv * head_dim + v_rows


def stage_tickets_ints(n_head_kv: int, v_rows: int) -> int:
    """Counters a quantized cache's launch needs: one per KV head's k row, one per 32-value v block."""
    return n_head_kv + v_rows // QUANT_BLOCK


def _stage_and_tickets(cache_type: str, n_head_kv: int, head_dim: int, v_rows: int, stage, tickets) -> tuple:
    """(stage, tickets) kernel arguments: NULL for a float cache; for a quantized one the given
    buffers checked (or new ones, the counters zeroed)."""
    if cache_type not in KV_QUANT_TYPES:
        return NULL, NULL
    if head_dim % QUANT_BLOCK or v_rows % QUANT_BLOCK:
        raise ValueError(f"a {cache_type} cache needs head_dim ({head_dim}) and v_rows ({v_rows}) in blocks of 32")
    n_stage, n_tick = stage_floats(n_head_kv, head_dim, v_rows), stage_tickets_ints(n_head_kv, v_rows)
    if stage is None:
        stage = empty((n_stage,), np.float32)
    if tickets is None:
        tickets = empty((n_tick,), np.int32)
        tickets.fill(0)
    check_contig(stage, tickets)
    if stage.size < n_stage or tickets.size < n_tick:
        raise ValueError(f"stage ({stage.size}) / tickets ({tickets.size}) smaller than {n_stage} / {n_tick}")
    return stage, tickets


def _fused_qkv_rope_kv(ex: CupyExecutable, d: int, f: Fusion) -> list:
    """Norm + q/k/v + RoPE + K/V cache write of one token as one qkv_rope_kv launch."""
    p = f.parts
    mq, mk, mv, rq, sk, sv, norm = p["q"], p["k"], p["v"], p["q_rope"], p["k_store"], p["v_store"], p["norm"]
    weights, wtypes = [], []
    for mm in (mq, mk, mv):
        data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
        weights.append((data, row_bytes))
        wtypes.append(wtype)
    q = array_of(ex, d, rq)[0, 0]
    n_head, head_dim = q.shape
    k_rows = ex.plan.of(sk.src[0]).local[d].ne[0]
    v_rows = ex.plan.of(sv.src[0]).local[d].ne[0]
    cache_type = quant_cache_type(sk.type)
    stage, tickets = (None, None) if cache_type is None else _stage_buffers(ex, d, k_rows, v_rows, k_rows // head_dim)
    ff = rq.src[2] if len(rq.src) > 2 else None
    prm = rq.params
    return record(qkv_rope_kv, weights, wtypes[0], folded_norm_input(ex, d, mq.src[1], norm), q,
                  array_of(ex, d, sk)[0, 0], array_of(ex, d, sv)[0, 0], array_of(ex, d, sk.src[1]).reshape(-1),
                  array_of(ex, d, rq.src[1]).reshape(-1), ne0=ex.plan.of(mq.src[0]).local[d].ne[0],
                  n_head=n_head, n_head_kv=k_rows // head_dim, head_dim=head_dim, n_dims=prm["n_dims"],
                  neox=prm["mode"] == RopeMode.NEOX, freq_base=prm["freq_base"], freq_scale=prm["freq_scale"],
                  freq_factors=array_of(ex, d, ff).reshape(-1) if ff is not None else None,
                  v_rows=v_rows, cache_type=cache_type, v_qtype=wtypes[2], stage=stage, tickets=tickets,
                  **folded_norm_kwargs(ex, d, norm))


#: scratch keys of a quantized cache's staging row and its group counters (one of each a device,
#: shared by every layer: launches on one stream run in order and leave the counters 0)
_STAGE, _TICKETS = "qkv_stage", "qkv_ticket"


def _stage_buffers(ex: CupyExecutable, d: int, k_rows: int, v_rows: int, n_head_kv: int) -> tuple:
    """Device d's staging row and counters for a quantized cache's launch; the counters zeroed on the
    device's stream the first time the buffer is handed out (the executable synchronizes its
    devices before any step runs)."""
    stage = ex.scratch_buffer(d, _STAGE, k_rows + v_rows, np.float32)
    tickets = ex.scratch_buffer(d, _TICKETS, stage_tickets_ints(n_head_kv, v_rows), np.int32)
    zeroed = ex.__dict__.setdefault("qkv_zeroed_tickets", set())     # (device, address) zeroed once
    if (d, device_ptr(tickets)) not in zeroed:
        with ex.rt.device(ex.devs[d].gpu):
            ex.rt.memset(device_ptr(tickets), int(tickets.nbytes), ex.devs[d].stream)
        zeroed.add((d, device_ptr(tickets)))
    return stage, tickets


# ---- norm + q/k/v + RoPE + KV write (QKV_ROPE_KV)
def _through_reshapes(ex: CupyExecutable, t: Tensor) -> tuple[list[Tensor], Tensor] | None:
    """(the RESHAPEs after t, the one node reading the last of them) when every link has that
    one reader and nothing else views t's memory; else None."""
    chain: list[Tensor] = []
    cur = t
    while True:
        rs = ex.facts.readers.get(cur, [])
        if len(rs) != 1:
            return None
        if rs[0].op is not Op.RESHAPE:
            break
        cur = rs[0]
        chain.append(cur)
    viewers = set(ex.facts.readers_with_views.get(t, []))
    return (chain, rs[0]) if viewers <= {*chain, rs[0]} else None


def _qkv_chain(ex: CupyExecutable, mm: Tensor) -> tuple[str, Tensor | None, Tensor | None] | None:
    """What follows one of the three products: ("q", rope, None), ("k", rope, store) or
    ("v", None, store), through contiguous reshapes; None for anything else (a bias, a norm)."""
    found = _through_reshapes(ex, mm)
    if found is None:
        return None
    chain, nxt = found
    if nxt.op is Op.SET_ROWS and nxt.src[0] is (chain[-1] if chain else mm):
        return "v", None, nxt
    if nxt.op is not Op.ROPE or not chain or nxt.src[0] is not chain[-1]:
        return None
    after = _through_reshapes(ex, nxt)
    if after is not None and after[1].op is Op.SET_ROWS and after[1].src[0] is (after[0][-1] if after[0] else nxt):
        return "k", nxt, after[1]
    if any(r.op is Op.SET_ROWS for r in ex.facts.readers_with_views.get(nxt, [])):
        return None
    return "q", nxt, None


def _rope_fusable(rq: Tensor, rk: Tensor) -> bool:
    """Q and K ropes the kernel's epilogue does: one token, same parameters, positions and freq
    factors, NORMAL or NEOX, one head size."""
    prm = rq.params
    return (prm == rk.params and rq.src[1:] == rk.src[1:] and prm["mode"] in (RopeMode.NORMAL, RopeMode.NEOX)
            and rq.ne[0] == rk.ne[0] and rq.ne[2] == 1 and rk.ne[2] == 1 and rq.ne[3] == 1 and rk.ne[3] == 1
            and set(prm) == {"n_dims", "mode", "freq_base", "freq_scale"})


def _stores_fusable(sk: Tensor, sv: Tensor, head_dim: int) -> bool:
    """K and V stores the kernel writes: one row, the same row index, caches of one type (a quantized
    one with heads and the v row in whole blocks of 32)."""
    ids = sk.src[1]
    if not (ids is sv.src[1] and ids.ne == (1, 1, 1, 1) and sk.type == sv.type
            and sk.src[0].ne[1] == 1 and sv.src[0].ne[1] == 1):
        return False
    if quant_cache_type(sk.type) is None:
        return True
    return head_dim % QUANT_BLOCK == 0 and sv.src[0].ne[0] % QUANT_BLOCK == 0


def _weight_types_fusable(ex: CupyExecutable, wq: Tensor, wk: Tensor, wv: Tensor) -> bool:
    """Wq and Wk of one type and layout, Wv of the same row length and of their type or of a
    `MIXED_PAIRS` partner, on every device."""
    if not same_weight_layout(ex, [wq, wk]):
        return False
    for d in ex.devices:
        qt, vt = weight_operand(ex, d, wq)[1], weight_operand(ex, d, wv)[1]
        if ex.plan.of(wq).local[d].ne[0] != ex.plan.of(wv).local[d].ne[0]:
            return False
        if vt != qt and (qt, vt) not in MIXED_PAIRS:
            return False
    return True


def _untouched_between(ex: CupyExecutable, t: Tensor, start: int, end: int) -> bool:
    """No node at graph positions start..end-1 reads `t` or a view of its memory."""
    idx = ex.plan.graph.index
    root = t.view_src or t
    return not any(start <= idx[r] < end for r in ex.facts.readers_with_views.get(root, []) if r in idx)


def _find_qkv_rope_kv(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The one-token q, k, v products of one x, q and k roped, k and v stored into the KV cache
    (a llama layer's attention input) -> one qkv_rope_kv launch at the first product, with x's
    RMS norm folded in when only the products read it. Refused (today's kernels run) for biases,
    q/k norms, a v weight type not paired with q/k's (`MIXED_PAIRS`), several tokens, quantized
    caches whose heads are not whole blocks, other rope modes."""
    if not ex.backend.fuse_qkv_rope:
        return []
    mms = matmuls_of_x(ex.facts, node, taken, lambda r: is_matvec(ex, r) and matmul_tokens(r) == 1)
    if len(mms) != 3 or backend_matmul_path(ex.backend, mms[0]) != "matvec":    # numerics "q8": the int8 twins
        return []
    chains = {}
    for mm in mms:
        c = _qkv_chain(ex, mm)
        if c is None or c[0] in chains:
            return []
        chains[c[0]] = (mm, c[1], c[2])
    (mq, rq, _), (mk, rk, sk), (mv, _, sv) = chains["q"], chains["k"], chains["v"]
    if not (_rope_fusable(rq, rk) and _stores_fusable(sk, sv, rq.ne[0])):
        return []
    if not _weight_types_fusable(ex, mq.src[0], mk.src[0], mv.src[0]):
        return []
    at = mms[0]
    idx = ex.plan.graph.index
    later = (mq, rq, mk, rk, sk, mv, sv)
    if any(t is not at and (t in taken or not ex.facts.fusable(t, at)) for t in later):
        return []
    leaves = [rq.src[1], sk.src[1], *rq.src[2:]]
    if any(t.op is not Op.NONE and not (idx.get(t, len(idx)) < idx[at]) for t in leaves):
        return []
    if not (_untouched_between(ex, sk, idx[at], idx[sk]) and _untouched_between(ex, sv, idx[at], idx[sv])):
        return []
    norm = norm_of(ex, node, set(mms)) if busiest_output_rows(ex, mms) <= NORM_FOLD_MAX_ROWS else None
    absorbed = tuple(t for t in later if t is not at) + (tuple(norm) if norm is not None else ())
    # everything the unfused fallback writes at `at` lives from there (stores write the cache)
    early = tuple(t for t in (mq, rq, mk, rk, mv) if t is not at)
    return [Fusion(FusionKind.QKV_ROPE_KV, at, absorbed, keep=(norm[1].src[0],) if norm is not None else (),
                   early=early, parts={"q": mq, "k": mk, "v": mv, "q_rope": rq, "k_rope": rk, "k_store": sk,
                                       "v_store": sv, "norm": norm})]


def workspace(backend: CupyBackend, plan: Plan, node: Tensor, d: int, one_token_too: bool = False) -> Scratch:
    """A one-row SET_ROWS into a quantized cache may be the K or V store of a fused launch: room for
    the staging row and counters of a K and a V row as wide as it (the largest any node asks is
    kept, so the widest pair of rows fits)."""
    if (node.op is not Op.SET_ROWS or not backend.fuse_qkv_rope or backend.batch_invariant
            or quant_cache_type(node.type) is None or node.src[0].ne[1:] != (1, 1, 1)):
        return {}
    width = plan.of(node.src[0]).local[d].ne[0]
    return {_STAGE: (2 * width, np.float32), _TICKETS: (2 * width // QUANT_BLOCK, np.int32)}


#: ops another family handles whose nodes this family's fusion may absorb (asked for `workspace`)
WORKSPACE_OPS = (Op.SET_ROWS,)
HANDLERS: dict = {}
FUSIONS = (
    FusionRow(FusionKind.QKV_ROPE_KV, _find_qkv_rope_kv, _fused_qkv_rope_kv, unfused_with_folded_norm),
)
