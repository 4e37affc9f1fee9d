"""Flash attention (``cuda/attn.cu``): split-KV decode kernel plus merge for a few query tokens, a
query-tiled prefill kernel (skipping key tiles its mask hides), and a decode kernel reading each
token's own cells from a cell list (`flash_attn_decode_cells`), the lists made from the mask on
the device (`mask_cells`); the attended KV length is read from device memory. The cache may be
f16 / bf16 / f32 or quantized (q8_0, q4_0, q4_1, q5_0, q5_1: uint8 blocks dequantized in
registers, strides in bytes); K and V share one type.

The family's decisions, in two functions side by side: `attention_cells_splits` (a masked step
of several rows reads each row's own cells: mask -> cell lists -> the cell-list decode kernel),
else `attention_splits`: FLASH_ATTN_EXT over a few query tokens runs the decode kernel split over
the KV (with a merge and a scratch workspace when it splits), over more tokens the prefill
kernel. The handler and `workspace` both ask them.

The merge of a split launch: with the cupy backend's option ``attn_merge`` (default), inside the
decode launch itself (each block writes its partial, takes a ticket on its (token, head group)
counter, and the last block merges in split-index order and puts the counter back to 0: the
counters, int32 scratch ``attn_ticket``, are zeroed once when first handed out); without it, by
the ``attn_merge_f32`` kernel after it. Both give the same bits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from metatp.backends.cuda.kernels.handler import Scratch, array_of, record
from metatp.backends.cuda.launch import (CACHE_TYPES, KV_QUANT_TYPES, head_strides, launch, empty, sm_count, i32, f32,
                                         cdiv, cache_type_of, estrides, check_f32, check_i32, check_contig,
                                         device_ptr)
from metatp.backends.cuda.storage import graph_itemsize, quant_cache_type
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'ATTN_DECODE_MAX_TOKENS', 'BATCH_INVARIANT_KV_CHUNK', 'attn_workspace_floats',
           'attn_ticket_ints', 'choose_splits',
           'decode_splits', 'ATTN_CELLS_MAX_TOKENS', 'attention_splits', 'attention_cells_splits', 'flash_attn_decode',
           'flash_attn_decode_cells', 'mask_cells', 'flash_attn_prefill', 'HANDLERS', 'FUSIONS', 'workspace']

_ATTN_NG = (1, 2, 4, 8)
ENTRY_POINTS = ([f"attn_decode_{t}_g{g}" for t in CACHE_TYPES for g in _ATTN_NG] + ["attn_merge_f32"]
                + [f"attn_prefill_{t}" for t in CACHE_TYPES]
                + [f"attn_decode_cells_{t}_g{g}" for t in CACHE_TYPES for g in _ATTN_NG]
                + ["attn_mask_count", "attn_mask_cells"])


def _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv, head_dim, n_tokens, n_kv,
                 q_strides, k_strides, v_strides, mask_stride, causal, causal_offset, kv_type):
    check_f32(q, out, mask)
    check_i32(kv_len)
    kvt = cache_type_of(k, kv_type)
    if cache_type_of(v, kv_type) != kvt:
        raise TypeError("k and v must have the same type")
    if kvt in KV_QUANT_TYPES:
        if head_dim % KV_QUANT_TYPES[kvt][0]:
            raise ValueError(f"head_dim={head_dim} is not whole {kvt} blocks of {KV_QUANT_TYPES[kvt][0]}")
        if k_strides is None or v_strides is None:
            raise ValueError("a quantized cache needs explicit (head, row) byte strides")
        if any(int(s) % 2 for s in (*k_strides, *v_strides)):
            raise ValueError(f"{kvt} cache strides must be even (blocks are 2-byte aligned)")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_head_kv={n_head_kv}")
    if head_dim > 256:
        raise ValueError("head_dim > 256 is not supported")
    qs = head_strides(q, head_dim, n_head, q_strides)
    ks = head_strides(k, head_dim, n_head_kv, k_strides)
    vs = head_strides(v, head_dim, n_head_kv, v_strides)
    if mask is not None and mask_stride is None:
        mask_stride = estrides(mask)[0] if mask.ndim == 2 else n_kv
    if mask_stride is None:
        mask_stride = 0
    if causal_offset is None:
        causal_offset = n_kv - n_tokens
    return kvt, qs, ks, vs, int(mask_stride), 1 if causal else 0, int(causal_offset)


def attn_workspace_floats(n_head: int, head_dim: int, n_tokens: int, n_splits: int) -> int:
    """Floats of scratch that flash_attn_decode needs for n_splits > 1."""
    return n_tokens * n_head * n_splits * (head_dim + 2)


def _heads_per_block(n_head: int, n_head_kv: int) -> int:
    """NG: query heads one decode block serves (all of its KV head's group, up to 8)."""
    g = n_head // n_head_kv
    return next(n for n in _ATTN_NG if n >= min(g, 8))


def attn_ticket_ints(n_head: int, n_head_kv: int, n_tokens: int) -> int:
    """Counters a decode launch that merges its own splits needs: one per (token, head group)."""
    return n_tokens * n_head_kv * cdiv(n_head // n_head_kv, _heads_per_block(n_head, n_head_kv))


def choose_splits(n_head_kv: int, n_head: int, n_tokens: int, n_kv: int) -> int:
    """Split-KV count: about two waves of blocks, chunks of at least 64 keys."""
    g = n_head // n_head_kv
    base = n_head_kv * cdiv(g, _heads_per_block(n_head, n_head_kv)) * n_tokens
    want = cdiv(2 * sm_count(), max(1, base))
    return max(1, min(want, cdiv(max(n_kv, 1), 64)))


def decode_splits(n_head_kv: int, n_head: int, n_tokens: int, n_kv: int,
                  n_splits: int | None = None, chunk: int | None = None) -> tuple[int, int]:
    """(n_splits, chunk) flash_attn_decode will use (chunk = keys per split). A given `chunk`
    is kept as it is (batch invariance: chunks at absolute cell positions), with at least
    `n_splits` splits (the extra ones empty: see `attention_splits`)."""
    if chunk is not None:
        chunk = max(1, int(chunk))
        return max(cdiv(max(n_kv, 1), chunk), int(n_splits or 1)), chunk
    if n_splits is None:
        n_splits = choose_splits(n_head_kv, n_head, n_tokens, n_kv)
    n_splits = max(1, int(n_splits))
    chunk = max(1, cdiv(max(n_kv, 1), n_splits))
    return max(1, cdiv(max(n_kv, 1), chunk)), chunk


def _split_workspace(workspace, n_head: int, head_dim: int, n_tokens: int, n_splits: int):
    """The split-KV partial results' buffer of a decode launch: the one given (checked) or a new one."""
    need = attn_workspace_floats(n_head, head_dim, n_tokens, n_splits)
    if workspace is None:
        return empty((need,), np.float32)
    if workspace.size < need:
        raise ValueError(f"workspace has {workspace.size} floats, need {need}")
    check_f32(workspace)
    return workspace


def _split_tickets(tickets, n_head: int, n_head_kv: int, n_tokens: int):
    """The merge counters of a decode launch that merges its own splits: the ones given
    (checked; they must be 0, as every such launch leaves them) or new zeroed ones."""
    need = attn_ticket_ints(n_head, n_head_kv, n_tokens)
    if tickets is None:
        tickets = empty((need,), np.int32)
        tickets.fill(0)
        return tickets
    check_i32(tickets)
    check_contig(tickets)
    if tickets.size < need:
        raise ValueError(f"tickets has {tickets.size} counters, need {need}")
    return tickets


def _split_decode(family_entry: str, grid: tuple, nth: int, smem: int, head_args: tuple, tail_args: tuple, out,
                  workspace, tickets, merge_in_launch: bool, *, n_head: int, n_head_kv: int, head_dim: int,
                  n_tokens: int) -> None:
    """One decode launch (args: head_args, out, partials, tickets, tail_args) and, when it splits
    the KV and does not merge in the launch, the merge kernel after it."""
    n_splits = grid[0]
    part = tick = None
    if n_splits > 1:
        part = _split_workspace(workspace, n_head, head_dim, n_tokens, n_splits)
        if merge_in_launch:
            tick = _split_tickets(tickets, n_head, n_head_kv, n_tokens)
    launch("attn", family_entry, grid, (nth,), (*head_args, out, part, tick, *tail_args), shared_mem=smem)
    if n_splits > 1 and not merge_in_launch:
        launch("attn", "attn_merge_f32", (n_head, n_tokens), (max(32, cdiv(head_dim, 32) * 32),),
               (part, out, i32(head_dim), i32(n_head), i32(n_tokens), i32(n_splits)))


def flash_attn_decode(q, k, v, out, *, n_head: int, n_head_kv: int, head_dim: int,
                      n_tokens: int, n_kv: int, scale: float, mask=None, softcap: float = 0.0,
                      causal: bool = True, causal_offset: int | None = None,
                      n_splits: int | None = None, workspace=None, q_strides=None,
                      k_strides=None, v_strides=None, mask_stride: int | None = None,
                      kv_len=None, kv_type: str | None = None, chunk: int | None = None,
                      merge_in_launch: bool = True, tickets=None) -> None:
    """Split-KV flash attention for a few query tokens (decode).

    ``q``: f32 [n_tokens, n_head, head_dim]; ``k``/``v``: cache [n_ctx, n_head_kv, head_dim]
    (float16, uint16 = bf16, or float32; or uint8 blocks of the quantized type ``kv_type`` with
    ``k_strides``/``v_strides`` in bytes), first ``n_kv`` rows used; ``out``: f32
    [n_tokens, n_head, head_dim] contiguous. ``mask``: optional f32 [n_tokens, n_kv]
    (additive). ``causal``: key j visible to token t iff j <= t + causal_offset (default
    n_kv - n_tokens). ``kv_len``: optional int32 device scalar; keys at or beyond it are
    skipped. ``workspace``: f32 scratch of ``attn_workspace_floats`` (allocated when None
    and n_splits > 1). Strides: (head, row) in elements. ``chunk``: keys per split, fixed
    (batch invariance; at least ``n_splits`` splits); None: the span cut into n_splits.
    ``merge_in_launch``: a split launch merges its partials itself (the last block of each
    (token, head group)), over ``tickets``: int32 counters of ``attn_ticket_ints``, all 0 (every
    launch leaves them 0; zeroed ones are made when None); False: attn_merge_f32 after it.
    """
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset, kv_type)
    if n_tokens == 0:
        return
    ng = _heads_per_block(n_head, n_head_kv)
    n_qgroup = cdiv(n_head // n_head_kv, ng)
    n_splits, chunk = decode_splits(n_head_kv, n_head, n_tokens, n_kv, n_splits, chunk)
    nth = max(64, cdiv(head_dim, 32) * 32)
    smem = 4 * (ng * head_dim + ng * nth + 3 * ng)
    _split_decode(f"attn_decode_{kvt}_g{ng}", (n_splits, n_head_kv * n_qgroup, n_tokens), nth, smem,
                  (q, k, v, mask, kv_len), (i32(head_dim), i32(n_head), i32(n_head_kv), i32(n_tokens), i32(n_kv),
                                            i32(qs[0]), i32(qs[1]), i32(ks[0]), i32(ks[1]), i32(vs[0]), i32(vs[1]),
                                            i32(ms), i32(chunk), f32(scale), f32(softcap), i32(c), i32(co)),
                  out, workspace, tickets, merge_in_launch, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                  n_tokens=n_tokens)


def flash_attn_decode_cells(q, k, v, out, cells, cell_off, *, n_head: int, n_head_kv: int, head_dim: int,
                            n_tokens: int, max_cells: int, scale: float, softcap: float = 0.0,
                            n_splits: int | None = None, workspace=None, q_strides=None, k_strides=None,
                            v_strides=None, kv_type: str | None = None, mask=None,
                            mask_stride: int | None = None, merge_in_launch: bool = True, tickets=None) -> None:
    """Decode of many sequences, each query token reading only its own cells (paged attention
    over the engine's cell layout) instead of a mask over every cell.

    ``cells``: int32, the cache rows of every token's list, concatenated; ``cell_off``: int32
    [n_tokens + 1], token t's list is ``cells[cell_off[t]:cell_off[t + 1]]`` (any rows, any
    order, all visible; an empty list gives 0). ``max_cells``: a bound on the longest list (it
    sizes the splits; the lists may change between launches up to it, as a CUDA graph
    replays). ``mask``: optional, the dense additive mask the lists came from (its value at a
    listed cell is added to the score). Other arguments (``merge_in_launch``, ``tickets`` too) as
    flash_attn_decode."""
    if cells is None or cell_off is None:
        raise ValueError("flash_attn_decode_cells needs cells and cell_off")
    check_i32(cells, cell_off)
    check_contig(cells, cell_off)
    if cell_off.size < n_tokens + 1:
        raise ValueError(f"cell_off has {cell_off.size} entries for {n_tokens} tokens (need n_tokens + 1)")
    kvt, qs, ks, vs, ms, _, _ = _attn_common(q, k, v, out, mask, None, n_head, n_head_kv, head_dim, n_tokens,
                                             max_cells, q_strides, k_strides, v_strides, mask_stride, False, 0,
                                             kv_type)
    if n_tokens == 0:
        return
    ng = _heads_per_block(n_head, n_head_kv)
    n_splits, chunk = decode_splits(n_head_kv, n_head, n_tokens, max_cells, n_splits)
    nth = max(64, cdiv(head_dim, 32) * 32)
    smem = 4 * (ng * head_dim + ng * nth + 3 * ng + nth)
    _split_decode(f"attn_decode_cells_{kvt}_g{ng}", (n_splits, n_head_kv * cdiv(n_head // n_head_kv, ng), n_tokens),
                  nth, smem, (q, k, v, cells, cell_off, mask),
                  (i32(head_dim), i32(n_head), i32(n_head_kv), i32(n_tokens), i32(qs[0]), i32(qs[1]), i32(ks[0]),
                   i32(ks[1]), i32(vs[0]), i32(vs[1]), i32(ms), i32(chunk), f32(scale), f32(softcap)),
                  out, workspace, tickets, merge_in_launch, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                  n_tokens=n_tokens)


def mask_cells(mask, cells, cell_off, counts, *, n_rows: int, n_kv: int, mask_stride: int | None = None,
               kv_len=None) -> None:
    """Each mask row's cell list, on the device: row r's visible keys (j below n_kv and the
    device scalar ``kv_len`` when given, mask entry not -inf), in increasing order, at
    ``cells[cell_off[r]:cell_off[r + 1]]``, for flash_attn_decode_cells.

    ``mask``: f32 [n_rows, n_kv] (row stride ``mask_stride`` elements); ``cells``: int32 of at
    least n_rows * n_kv; ``cell_off``: int32 [n_rows + 1]; ``counts``: int32 [n_rows] scratch.
    Fixed sizes and no host sync, so a captured CUDA graph replays it with new masks."""
    check_f32(mask)
    check_i32(cells, cell_off, counts)
    if kv_len is not None:
        check_i32(kv_len)
    if mask_stride is None:
        mask_stride = estrides(mask)[0] if mask.ndim == 2 else n_kv
    if cells.size < n_rows * n_kv or cell_off.size < n_rows + 1 or counts.size < n_rows:
        raise ValueError(f"mask_cells: buffers of {cells.size}, {cell_off.size}, {counts.size} ints for "
                         f"{n_rows} rows x {n_kv} cells")
    if n_rows == 0:
        return
    args = (mask, kv_len, counts, i32(n_kv), i32(mask_stride))
    launch("attn", "attn_mask_count", (n_rows,), (_MASK_CELLS_THREADS,), args)
    launch("attn", "attn_mask_cells", (n_rows,), (_MASK_CELLS_THREADS,),
           (mask, kv_len, counts, cells, cell_off, i32(n_kv), i32(mask_stride)))


def flash_attn_prefill(q, k, v, out, *, n_head: int, n_head_kv: int, head_dim: int,
                       n_tokens: int, n_kv: int, scale: float, mask=None, softcap: float = 0.0,
                       causal: bool = True, causal_offset: int | None = None, q_strides=None,
                       k_strides=None, v_strides=None, mask_stride: int | None = None,
                       kv_len=None, kv_type: str | None = None) -> None:
    """Flash attention tiled over queries (prefill); same arguments as flash_attn_decode."""
    kvt, qs, ks, vs, ms, c, co = _attn_common(q, k, v, out, mask, kv_len, n_head, n_head_kv,
                                               head_dim, n_tokens, n_kv, q_strides, k_strides,
                                               v_strides, mask_stride, causal, causal_offset, kv_type)
    if n_tokens == 0:
        return
    g = n_head // n_head_kv
    smem = 4 * (16 * head_dim + 32 * (head_dim + 1) + 16 * 32 + 48)
    launch("attn", f"attn_prefill_{kvt}", (cdiv(n_tokens * g, 16), n_head_kv), (128,),
           (q, k, v, mask, kv_len, out, i32(head_dim), i32(n_head), i32(n_head_kv),
            i32(n_tokens), i32(n_kv), i32(qs[0]), i32(qs[1]), i32(ks[0]), i32(ks[1]),
            i32(vs[0]), i32(vs[1]), i32(ms), f32(scale), f32(softcap), i32(c),
            i32(co)),
           shared_mem=smem)


#: FLASH_ATTN_EXT runs the split-KV decode kernel up to this many query tokens.
ATTN_DECODE_MAX_TOKENS = 4
#: ... and, with a mask, the cell-list decode kernel from 2 up to this many (the row buckets).
ATTN_CELLS_MAX_TOKENS = 256
#: threads of the mask -> cell list kernels (a power of two)
_MASK_CELLS_THREADS = 256

#: Under batch invariance: keys per split-KV chunk, at absolute cell positions (the cupy backend's
#: kv_page then, so a sequence's cells start on a chunk as they do alone).
BATCH_INVARIANT_KV_CHUNK = 128


def attention_splits(n_head: int, n_head_kv: int, n_tokens: int, n_kv: int,
                     batch_invariant: bool = False) -> int | None:
    """Which attention kernel a shape runs: None for the prefill kernel (more than
    ATTN_DECODE_MAX_TOKENS query tokens), else the decode kernel's split-KV count (1 for a
    head layout the kernel refuses by name).

    `batch_invariant`: the decode kernel for every token count (one query row's sums never
    depend on the others'), over chunks of BATCH_INVARIANT_KV_CHUNK keys at absolute cell
    positions (a row's chunk boundaries depend only on where its cells are, not on the span),
    at least two splits so that every row goes through the merge kernel (one split would divide
    in the decode kernel instead: other bits). Chunks a row does not see add exact zeros."""
    if batch_invariant:
        return max(2, cdiv(max(n_kv, 1), BATCH_INVARIANT_KV_CHUNK))
    if n_tokens > ATTN_DECODE_MAX_TOKENS:
        return None
    if n_head_kv <= 0 or n_head % n_head_kv:
        return 1
    return decode_splits(n_head_kv, n_head, n_tokens, n_kv)[0]


def attention_cells_splits(n_head: int, n_head_kv: int, n_tokens: int, n_kv: int, masked: bool,
                           batch_invariant: bool = False) -> int | None:
    """Whether a masked step reads each row's own cells (the mask turned into cell lists on the
    device, then the cell-list decode kernel), and its split-KV count; None: `attention_splits`
    decides. The rule: a mask and 2..ATTN_CELLS_MAX_TOKENS rows (a decode step of several
    sequences, a prompt chunk up to a row bucket). The dense kernels make every row read every
    cell in use (rows x span K/V reads); the lists make a row read its own (sum of lengths).
    One row (single-sequence decode) keeps the dense decode kernel: its mask hides nothing of
    its own sequence, so the lists would save nothing. ``METATP_ATTN_CELLS=0`` turns the rule
    off (the dense kernels everywhere: the comparison a GPU run makes), read as plans compile.
    `batch_invariant`: never (its split count follows the step's rows; the fixed-chunk decode
    kernel of `attention_splits` keeps a row's bits whatever shares its step)."""
    if batch_invariant or os.environ.get("METATP_ATTN_CELLS", "1") == "0":
        return None
    if not masked or not 2 <= n_tokens <= ATTN_CELLS_MAX_TOKENS or n_head_kv <= 0 or n_head % n_head_kv:
        return None
    return decode_splits(n_head_kv, n_head, n_tokens, n_kv)[0]


def _scratch(n_head: int, n_head_kv: int, head_dim: int, n_tokens: int, n_splits: int | None, merge_in_launch: bool,
             cells_kv: int = 0, mask: Tensor | None = None) -> Scratch:
    """The decode kernel's per-split partial results, when it splits the KV (and its merge
    counters when it merges in the launch); with cell lists (`cells_kv`: the span they index)
    the lists of `mask`, their offsets and the per-row counts (buffers of their own per mask:
    every layer reading that mask reads the same lists)."""
    need: Scratch = {}
    if n_splits is not None and n_splits > 1:
        need["attn"] = (attn_workspace_floats(n_head, head_dim, n_tokens, n_splits), np.float32)
        if merge_in_launch:
            need[_TICKETS] = (attn_ticket_ints(n_head, n_head_kv, n_tokens), np.int32)
    if cells_kv and mask is not None:
        need[_cells_key("attn_cells", mask)] = (n_tokens * cells_kv, np.int32)
        need[_cells_key("attn_cell_off", mask)] = (n_tokens + 1, np.int32)
        need[_cells_key("attn_cell_counts", mask)] = (n_tokens, np.int32)
    return need


def _cells_key(what: str, mask: Tensor) -> str:
    return f"{what}@{mask.name}"


#: the scratch key of the in-launch merge's counters (one buffer a device: every launch leaves it 0)
_TICKETS = "attn_ticket"


def _scratch_buffers(ex: CupyExecutable, d: int, need: Scratch) -> dict:
    """Device d's scratch buffers for `need` (keys without their '@mask' part); the merge
    counters zeroed on the device's stream the first time a buffer is handed out (the
    executable synchronizes its devices before any step runs; the launches keep them 0)."""
    bufs = {}
    for key, (n, dtype) in need.items():
        buf = bufs[key.split("@")[0]] = ex.scratch_buffer(d, key, n, dtype)
        if key == _TICKETS:
            zeroed = ex.__dict__.setdefault("attn_zeroed_tickets", set())     # (device, address) zeroed once
            if (d, device_ptr(buf)) not in zeroed:
                with ex.rt.device(ex.devs[d].gpu):
                    ex.rt.memset(device_ptr(buf), int(buf.nbytes), ex.devs[d].stream)
                zeroed.add((d, device_ptr(buf)))
    return bufs


# ---------------------------------------------------------------- handler
def _run_flash_attn_ext(ex: CupyExecutable, d: int, node: Tensor) -> list:
    q, k, v = node.src[0], node.src[1], node.src[2]
    mask = node.src[3] if len(node.src) > 3 else None
    if len(node.src) > 4 and node.src[4] is not None:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r} with attention sinks")
    qa, ka, va = array_of(ex, d, q), array_of(ex, d, k), array_of(ex, d, v)
    loc = {t: ex.plan.of(t).local[d] for t in (q, k, v)}
    D, T, H = loc[q].ne[0], loc[q].ne[1], loc[q].ne[2]
    n_kv, Hkv = loc[k].ne[1], loc[k].ne[2]
    if loc[v].ne[0] != D:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r}: V head size differs from K's")
    qs = (loc[q].nb[2] // 4, loc[q].nb[1] // 4)
    # strides in storage elements: a quantized cache is bytes (its views are byte views of blocks)
    kq, vq = quant_cache_type(k.type), quant_cache_type(v.type)
    gk, gv = (1 if kq else graph_itemsize(k)), (1 if vq else graph_itemsize(v))
    ks = (loc[k].nb[2] // gk, loc[k].nb[1] // gk)
    vs = (loc[v].nb[2] // gv, loc[v].nb[1] // gv)
    if kq != vq:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r}: K ({k.type.name}) and V "
                                 f"({v.type.name}) caches of different types")
    ma = array_of(ex, d, mask) if mask is not None else None
    kw = dict(n_head=H, n_head_kv=Hkv, head_dim=D, n_tokens=T, n_kv=n_kv, scale=node.params["scale"],
              softcap=node.params.get("softcap", 0.0), causal=False, q_strides=qs, k_strides=ks,
              v_strides=vs, mask=ma[0, 0] if ma is not None else None,
              mask_stride=(ex.plan.of(mask).local[d].nb[1] // 4) if mask is not None else None,
              kv_len=ex.kv_len_view(d, mask) if mask is not None else None, kv_type=kq)
    out = array_of(ex, d, node)
    invariant = ex.backend.batch_invariant
    cell_splits = attention_cells_splits(H, Hkv, T, n_kv, mask is not None, invariant)
    if cell_splits is not None:
        return _cells_steps(ex, d, node, (qa, ka, va, out), kw, cell_splits)
    n_splits = attention_splits(H, Hkv, T, n_kv, invariant)
    if n_splits is None:
        return record(flash_attn_prefill, qa, ka, va, out, **kw)
    merge = ex.backend.attn_merge
    buf = _scratch_buffers(ex, d, _scratch(H, Hkv, D, T, n_splits, merge))
    return record(flash_attn_decode, qa, ka, va, out, n_splits=n_splits,
                  chunk=BATCH_INVARIANT_KV_CHUNK if invariant else None, workspace=buf.get("attn"),
                  merge_in_launch=merge, tickets=buf.get(_TICKETS), **kw)


def _cells_steps(ex: CupyExecutable, d: int, node: Tensor, arrays: tuple, kw: dict, n_splits: int) -> list:
    """The mask turned into cell lists, then the cell-list decode kernel (kw: the dense call's).
    The lists are made once per mask and device, by the first node reading it (steps run in
    the order they are made; the other layers read the same mask, so the same lists)."""
    H, D, T, n_kv = kw["n_head"], kw["head_dim"], kw["n_tokens"], kw["n_kv"]
    mask = node.src[3]
    merge = ex.backend.attn_merge
    buf = _scratch_buffers(ex, d, _scratch(H, kw["n_head_kv"], D, T, n_splits, merge, cells_kv=n_kv, mask=mask))
    makers = ex.__dict__.setdefault("attn_cell_list_makers", {})     # (device, mask) -> the node making its lists
    steps = []
    if makers.setdefault((d, mask), node) is node:
        steps = record(mask_cells, kw["mask"], buf["attn_cells"], buf["attn_cell_off"], buf["attn_cell_counts"],
                       n_rows=T, n_kv=n_kv, mask_stride=kw["mask_stride"], kv_len=kw["kv_len"])
    return steps + record(flash_attn_decode_cells, *arrays, buf["attn_cells"], buf["attn_cell_off"],
                          n_head=H, n_head_kv=kw["n_head_kv"], head_dim=D, n_tokens=T, max_cells=n_kv,
                          scale=kw["scale"], softcap=kw["softcap"], n_splits=n_splits,
                          workspace=buf.get("attn"), q_strides=kw["q_strides"], k_strides=kw["k_strides"],
                          v_strides=kw["v_strides"], kv_type=kw["kv_type"], mask=kw["mask"],
                          mask_stride=kw["mask_stride"], merge_in_launch=merge, tickets=buf.get(_TICKETS))


def workspace(backend: CupyBackend, plan: Plan, node: Tensor, d: int, one_token_too: bool = False) -> Scratch:
    """FLASH_ATTN_EXT's split-KV workspace on device d (`one_token_too`: the larger of this
    shape's and a one-token step's at the same KV length, which splits the KV more)."""
    if node.op is not Op.FLASH_ATTN_EXT:
        return {}
    q, k = plan.of(node.src[0]).local[d], plan.of(node.src[1]).local[d]
    D, T, H, n_kv, Hkv = q.ne[0], q.ne[1], q.ne[2], k.ne[1], k.ne[2]
    need: Scratch = {}
    masked = len(node.src) > 3 and node.src[3] is not None
    for tok in sorted({T, 1} if one_token_too else {T}):
        cell_splits = attention_cells_splits(H, Hkv, tok, n_kv, masked, backend.batch_invariant)
        merge = backend.attn_merge
        scratch = (_scratch(H, Hkv, D, tok, cell_splits, merge, cells_kv=n_kv, mask=node.src[3])
                   if cell_splits is not None
                   else _scratch(H, Hkv, D, tok, attention_splits(H, Hkv, tok, n_kv, backend.batch_invariant), merge))
        for key, (n, dtype) in scratch.items():
            if n > need.get(key, (0, None))[0]:
                need[key] = (n, dtype)
    return need


HANDLERS = {Op.FLASH_ATTN_EXT: _run_flash_attn_ext}
FUSIONS = ()
