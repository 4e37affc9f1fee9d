"""Kernel checks of the ``attn`` family: split-KV decode attention, prefill attention, the device-side attended KV length;
float caches and quantized ones (q8_0 ... q5_1 blocks, compared with the float64 attention over the blocks' gguf.quants
dequantization)."""

from __future__ import annotations

import contextlib
import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.backends.cuda.launch import KV_QUANT_TYPES
from metatp.testing.oracles import f32_to_bf16_bits, bf16_bits_to_f32, kv_rows, ref_attention, ref_mask_cells

CHECKS = ('attn_decode', 'attn_prefill', 'attn_kv_len', 'attn_quant', 'attn_prefill_tiles', 'attn_prefill_seqs',
          'attn_decode_cells', 'attn_mask_cells', 'attn_decode_merge')


def _kv(c: Checker, kvt, n_ctx, hkv, D):
    k = c.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
    v = c.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
    if kvt == "f16":
        ks, vs = k.astype(np.float16), v.astype(np.float16)
        return ks, vs, ks.astype(np.float64), vs.astype(np.float64)
    if kvt == "bf16":
        ks, vs = f32_to_bf16_bits(k), f32_to_bf16_bits(v)
        return (ks, vs, bf16_bits_to_f32(ks).astype(np.float64),
                bf16_bits_to_f32(vs).astype(np.float64))
    return k, v, k.astype(np.float64), v.astype(np.float64)


def check_attn_decode(c: Checker) -> None:
    ck = c.ck
    configs = [
        # (kv, D, H, Hkv, n_kv, T, splits, masked, softcap)
        ("f16", 64, 9, 3, 1, 1, 1, False, 0.0),
        ("f16", 64, 9, 3, 7, 1, None, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, 1, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, 3, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, None, True, 0.0),
        ("f16", 128, 8, 8, 200, 1, 4, False, 0.0),
        ("f16", 128, 16, 1, 130, 1, 2, False, 0.0),
        ("bf16", 64, 4, 2, 150, 2, 2, False, 0.0),
        ("f32", 80, 6, 2, 100, 3, 2, False, 30.0),
        ("f16", 256, 4, 1, 70, 1, 2, False, 0.0),
    ]
    for kvt, D, H, hkv, n_kv, T, splits, masked, softcap in configs:
        n_ctx = n_kv + 5
        ks, vs, k64, v64 = _kv(c, kvt, n_ctx, hkv, D)
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        mask = None
        if masked:
            mask = np.where(c.rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
            mask[:, -1] = 0.0
        ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                            softcap, True, n_kv - T)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        dm = c.dev(mask) if mask is not None else None
        out = c.nan((T, H, D))
        c.case("attn_decode",
                  f"{kvt} G={H // hkv} splits={splits or 'auto'}"
                  + (" mask" if masked else "") + (" softcap" if softcap else ""),
                  (D, H, hkv, n_kv, T),
                  lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                  n_kv=n_kv, scale=scale, splits=splits, softcap=softcap:
                  ck.flash_attn_decode(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                       head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                       mask=dm, softcap=softcap, n_splits=splits),
                  lambda out=out: c.host(out), ref, 1e-4)


def check_attn_prefill(c: Checker) -> None:
    ck = c.ck
    configs = [
        # (kv, D, H, Hkv, T, past, masked)
        ("f16", 64, 9, 3, 1, 0, False),
        ("f16", 64, 9, 3, 5, 0, False),
        ("f16", 64, 9, 3, 33, 4, False),
        ("bf16", 128, 4, 2, 20, 40, False),
        ("f32", 64, 2, 2, 17, 0, True),
        ("f16", 256, 2, 1, 9, 3, False),
    ]
    for kvt, D, H, hkv, T, past, masked in configs:
        n_kv = T + past
        ks, vs, k64, v64 = _kv(c, kvt, n_kv + 3, hkv, D)
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        mask = None
        causal = not masked
        if masked:  # causal mask given explicitly instead of the causal flag
            j = np.arange(n_kv)[None, :]
            t = np.arange(T)[:, None]
            mask = np.where(j <= t + past, 0.0, -np.inf).astype(np.float32)
        ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                            0.0, causal, past)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        dm = c.dev(mask) if mask is not None else None
        out = c.nan((T, H, D))
        c.case("attn_prefill", f"{kvt} G={H // hkv}" + (" mask" if masked else " causal"),
                  (D, H, hkv, n_kv, T),
                  lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                  n_kv=n_kv, scale=scale, causal=causal:
                  ck.flash_attn_prefill(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                        head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                        mask=dm, causal=causal),
                  lambda out=out: c.host(out), ref, 1e-4)


def check_attn_kv_len(c: Checker) -> None:
    """kv_len in device memory: keys beyond it are never read (NaN there must not leak),
    and changing it needs no new launch arguments (what a CUDA graph replays)."""
    ck = c.ck
    D, H, hkv, n_kv = 64, 9, 3, 256
    ks, vs, k64, v64 = _kv(c, "f16", n_kv, hkv, D)
    ks[100:] = np.nan
    vs[100:] = np.nan
    for T, kernel in ((1, "decode"), (6, "prefill")):
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        for used in (100, 37):
            mask = np.full((T, n_kv), -np.inf, dtype=np.float32)
            for t in range(T):
                mask[t, : used - T + t + 1] = 0.0
            ref = ref_attention(q.astype(np.float64), k64[:used], v64[:used], 1 / 8.0,
                                mask[:, :used], 0.0, False)
            dm = c.dev(mask)
            dlen = c.dev(np.array([used], dtype=np.int32))
            out = c.nan((T, H, D))
            fn = ck.flash_attn_decode if kernel == "decode" else ck.flash_attn_prefill
            c.case(f"attn_{kernel}", f"f16 kv_len={used}/{n_kv}", (D, H, hkv, n_kv, T),
                      lambda fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, dlen=dlen, out=out, T=T: fn(
                          dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T,
                          n_kv=n_kv, scale=1 / 8.0, mask=dm, causal=False, kv_len=dlen),
                      lambda out=out: c.host(out), ref, 1e-4)


def _quant_kv(c: Checker, qt: str, n_ctx: int, hkv: int, D: int, pad_heads: int = 0):
    """A quantized cache [n_ctx, hkv (+ pad_heads), row bytes] (uint8; padding heads make the row
    stride larger than the heads it holds, as a device's slice of a wider cache view) and its
    float64 value [n_ctx, hkv, D]; K and V. Returns (k, v, k64, v64, (head, row) byte strides)."""
    out = []
    for _ in range(2):
        x = c.rng.standard_normal((n_ctx, hkv + pad_heads, D)).astype(np.float32)
        raw, val = kv_rows(x, qt)
        out += [raw, val[:, :hkv]]
    rb = D // KV_QUANT_TYPES[qt][0] * KV_QUANT_TYPES[qt][1]
    return out[0], out[2], out[1], out[3], (rb, rb * (hkv + pad_heads))


def check_attn_quant(c: Checker) -> None:
    """Decode (split-KV, every NG) and prefill attention reading quantized K and V directly."""
    ck = c.ck
    configs = [
        # (kind, D, H, Hkv, n_kv, T, splits, masked, pad_heads)
        ("decode", 64, 9, 3, 300, 1, 3, False, 0),
        ("decode", 128, 8, 8, 130, 1, None, True, 1),
        ("decode", 64, 16, 2, 70, 2, 2, False, 0),
        ("decode", 32, 4, 1, 40, 3, 1, False, 0),
        ("prefill", 64, 9, 3, 37, 33, None, False, 0),
        ("prefill", 128, 4, 2, 60, 20, None, True, 1),
    ]
    for qt in KV_QUANT_TYPES:
        for kind, D, H, hkv, n_kv, T, splits, masked, pad in configs:
            ks, vs, k64, v64, strides = _quant_kv(c, qt, n_kv + 4, hkv, D, pad)
            q = c.rng.standard_normal((T, H, D)).astype(np.float32)
            scale = 1.0 / math.sqrt(D)
            mask = None
            if masked:
                mask = np.where(c.rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
                mask[:, -1] = 0.0
            ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask, 0.0, True, n_kv - T)
            dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
            dm = c.dev(mask) if mask is not None else None
            out = c.nan((T, H, D))
            fn = ck.flash_attn_decode if kind == "decode" else ck.flash_attn_prefill
            extra = {"n_splits": splits} if kind == "decode" else {}
            c.case(f"attn_{kind}", f"{qt} G={H // hkv}" + (f" splits={splits or 'auto'}" if kind == "decode" else "")
                   + (" mask" if masked else "") + (" padded" if pad else ""), (D, H, hkv, n_kv, T),
                   lambda fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T, n_kv=n_kv,
                   scale=scale, extra=extra, strides=strides, qt=qt:
                   fn(dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                      mask=dm, k_strides=strides, v_strides=strides, kv_type=qt, **extra),
                   lambda out=out: c.host(out), ref, 1e-4)


def _any_kv(c: Checker, kvt: str, n_ctx: int, hkv: int, D: int):
    """K, V of any cache type, their float64 values, and the byte strides a quantized one needs."""
    if kvt in KV_QUANT_TYPES:
        return _quant_kv(c, kvt, n_ctx, hkv, D)
    return (*_kv(c, kvt, n_ctx, hkv, D), None)


def _prefill_case(c: Checker, label: str, kvt: str, D: int, H: int, hkv: int, T: int, n_kv: int, mask, causal: bool,
                  causal_offset: int, poison=None) -> None:
    """One prefill launch; `poison`: cells (of a float cache) set to NaN on the device only, cells
    no query may read (the reference reads the clean values and never sees them either)."""
    ks, vs, k64, v64, strides = _any_kv(c, kvt, n_kv + 2, hkv, D)
    if poison is not None:
        ks, vs = ks.copy(), vs.copy()
        ks[poison] = np.nan
        vs[poison] = np.nan
    q = c.rng.standard_normal((T, H, D)).astype(np.float32)
    scale = 1.0 / math.sqrt(D)
    ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask, 0.0, causal, causal_offset)
    dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
    dm = c.dev(mask) if mask is not None else None
    out = c.nan((T, H, D))
    quant = {"k_strides": strides, "v_strides": strides, "kv_type": kvt} if strides else {}
    c.case("attn_prefill", f"{kvt} G={H // hkv} {label}", (D, H, hkv, n_kv, T),
           lambda: c.ck.flash_attn_prefill(dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T,
                                           n_kv=n_kv, scale=scale, mask=dm, causal=causal,
                                           causal_offset=causal_offset, **quant),
           lambda: c.host(out), ref, 1e-4)


def check_attn_prefill_tiles(c: Checker) -> None:
    """Query rows (token x head-in-group) on both sides of the 16-row tile and keys on both sides of
    the 32-key tile, with the causal flag and with the same causal triangle given as a mask (the
    engine's form: fully masked key tiles are skipped)."""
    D, H = 64, 3
    for hkv, T in ((3, 15), (3, 16), (3, 17), (3, 53), (1, 5), (1, 6), (1, 11)):    # G=3: 15, 18, 33 rows
        for past in (0, 16, 17):
            n_kv = T + past
            _prefill_case(c, f"T={T} past={past} causal", "f16", D, H, hkv, T, n_kv, None, True, past)
    for T, n_kv in ((31, 31), (32, 32), (33, 33), (40, 101)):
        j, t = np.arange(n_kv)[None, :], np.arange(T)[:, None]
        mask = np.where(j <= t + n_kv - T, 0.0, -np.inf).astype(np.float32)
        _prefill_case(c, f"T={T} n_kv={n_kv} causal mask", "f32", D, H, 3, T, n_kv, mask, False, 0)


def _seqs_mask(seq_of_cell: np.ndarray, pos_of_cell: np.ndarray, seq_of_tok, pos_of_tok) -> np.ndarray:
    """The mask of a step of several sequences: a query sees the cells of its own sequence at
    positions up to its own (what the engine builds over its cells)."""
    see = (seq_of_cell[None, :] == np.asarray(seq_of_tok)[:, None]) & (pos_of_cell[None, :] <= np.asarray(pos_of_tok)[:, None])
    return np.where(see, 0.0, -np.inf).astype(np.float32)


def check_attn_prefill_seqs(c: Checker) -> None:
    """Several sequences in one prefill step, each seeing only its own cells (a general mask, no
    causal flag), on every cache type: prompt chunks of 3 sequences after different pasts, cells
    in contiguous runs; and cells interleaved between two sequences (pages handed out in turn),
    with a sequence that has no query in the step."""
    from metatp.backends.cuda.launch import CACHE_TYPES

    # run layout: sequence s owns cells [start_s, start_s + past_s + new_s); its new tokens are queries
    runs = ((0, 20, 5), (1, 0, 40), (2, 33, 2))      # (seq, past, new)
    seq_c, pos_c, seq_t, pos_t = [], [], [], []
    for s, past, new in runs:
        seq_c += [s] * (past + new)
        pos_c += list(range(past + new))
        seq_t += [s] * new
        pos_t += list(range(past, past + new))
    mask_runs = _seqs_mask(np.array(seq_c), np.array(pos_c), seq_t, pos_t)
    # interleaved pages of 8 cells: seq 0, 1, 0, 1, ... (seq 2 owns the last 16 cells, no queries)
    n_kv = 80
    page = np.arange(n_kv) // 8
    seq_i = np.where(page < 8, page % 2, 2)
    pos_i = np.zeros(n_kv, int)
    for s in (0, 1, 2):
        pos_i[seq_i == s] = np.arange((seq_i == s).sum())
    toks = [(0, 27), (0, 28), (1, 31), (1, 5), (0, 3)]
    mask_inter = _seqs_mask(seq_i, pos_i, [s for s, _ in toks], [p for _, p in toks])
    for kvt in CACHE_TYPES:
        _prefill_case(c, "3 sequences in runs", kvt, 64, 4, 2, mask_runs.shape[0], mask_runs.shape[1], mask_runs,
                      False, 0)
    for kvt in ("f16", "q4_0"):
        _prefill_case(c, "interleaved pages", kvt, 64, 4, 2, len(toks), n_kv, mask_inter, False, 0)
    # cells 64..79 (seq 2's, no query) fill the last key tile: it is skipped, never read
    _prefill_case(c, "interleaved pages, unseen tile NaN", "f16", 64, 4, 2, len(toks), n_kv, mask_inter, False, 0,
                  poison=np.arange(64, 80))


def check_attn_decode_cells(c: Checker) -> None:
    """Decode of several sequences, each token reading its own cells through a cell list: lists of
    0, 1, 31..33 and 100 cells (across the 64-key tile and the splits), cells out of order and
    shared by no one else, the cells nobody lists NaN (never read); every cache type, several head
    groupings and split counts."""
    n_ctx = 260
    lens = (1, 33, 0, 100, 31, 32)
    perm = c.rng.permutation(n_ctx - 20)          # the last 20 cells belong to no list
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cells = perm[: offs[-1]].astype(np.int32)
    T = len(lens)
    configs = [("f16", 64, 9, 3, None), ("f16", 64, 9, 3, 1), ("f32", 80, 4, 4, 3), ("bf16", 128, 16, 2, None)]
    configs += [(qt, 64, 8, 2, 2) for qt in KV_QUANT_TYPES]
    for kvt, D, H, hkv, splits in configs:
        ks, vs, k64, v64, strides = _any_kv(c, kvt, n_ctx, hkv, D)
        if strides is None:             # cells no token lists: NaN, so a stray read shows
            ks, vs = ks.copy(), vs.copy()
            nan = 0x7FC0 if ks.dtype == np.uint16 else np.nan      # bf16 is stored as its bits
            ks[n_ctx - 20:] = nan
            vs[n_ctx - 20:] = nan
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        ref = np.zeros((T, H, D))
        for t in range(T):
            rows = cells[offs[t]:offs[t + 1]]
            if len(rows):
                ref[t] = ref_attention(q[t:t + 1].astype(np.float64), k64[rows], v64[rows], scale, None, 0.0,
                                       False)[0]
        dq, dk, dv, dc, do = c.dev(q), c.dev(ks), c.dev(vs), c.dev(cells), c.dev(offs)
        out = c.nan((T, H, D))
        quant = {"k_strides": strides, "v_strides": strides, "kv_type": kvt} if strides else {}
        c.case("attn_decode_cells", f"{kvt} G={H // hkv} splits={splits or 'auto'}", (D, H, hkv, n_ctx, T),
               lambda dq=dq, dk=dk, dv=dv, dc=dc, do=do, out=out, D=D, H=H, hkv=hkv, scale=scale, splits=splits,
               quant=quant: c.ck.flash_attn_decode_cells(
                   dq, dk, dv, out, dc, do, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T, max_cells=max(lens),
                   scale=scale, n_splits=splits, **quant),
               lambda out=out: c.host(out), ref, 1e-4)


def _exact(a, ref) -> float:
    """0 when two integer arrays are equal, else inf (the harness's error for a mismatch)."""
    a, ref = np.asarray(a), np.asarray(ref)
    return 0.0 if a.shape == ref.shape and np.array_equal(a, ref) else float("inf")


def check_attn_mask_cells(c: Checker) -> None:
    """Mask rows -> cell lists on the device (`mask_cells`) against numpy: rows crossing the
    256-key tile, a padded row stride, the device kv_len cutting the rows, a row seeing nothing,
    one seeing everything, finite biases counted as visible; then the handler's path (lists ->
    the cell-list decode kernel, the mask's values added) against the dense decode and prefill
    kernels and float64, on every cache type, for a step of interleaved sequences."""
    from metatp.backends.cuda.launch import CACHE_TYPES

    ck = c.ck
    n_kv, stride, used = 300, 320, 290
    mask = np.full((6, stride), -np.inf, dtype=np.float32)
    mask[0, : n_kv] = 0.0                                     # everything (kv_len cuts it)
    mask[2, c.rng.random(stride) < 0.3] = 0.0                 # scattered, past n_kv too (never listed)
    mask[3, 250:270] = 0.0                                     # a run across the tile edge
    mask[4, 7] = -1e30                                         # finite: visible
    mask[5, ::3] = c.rng.standard_normal(len(mask[5, ::3])).astype(np.float32)
    for n_used, kv_len in ((used, c.dev(np.array([used], np.int32))), (n_kv, None)):
        ref_cells, ref_off = ref_mask_cells(mask[:, :n_kv], n_used)
        cells, off, counts = c.dev(np.full(6 * n_kv, -7, np.int32)), c.dev(np.full(7, -7, np.int32)), \
            c.dev(np.zeros(6, np.int32))
        dm = c.dev(mask)
        run = (lambda dm=dm, cells=cells, off=off, counts=counts, kv_len=kv_len: ck.mask_cells(
            dm, cells, off, counts, n_rows=6, n_kv=n_kv, mask_stride=stride, kv_len=kv_len))
        c.case("attn_mask_cells", f"offsets kv_len={n_used}", (6, n_kv), run, lambda off=off: c.host(off), ref_off,
               0.0, err_fn=_exact)
        c.case("attn_mask_cells", f"cells kv_len={n_used}", (6, n_kv), run,
               lambda cells=cells, m=len(ref_cells): c.host(cells)[:m], ref_cells, 0.0, err_fn=_exact)

    # a decode step of 5 sequences (one token each) over interleaved pages of 8 cells, plus 3 padded rows
    n_ctx, T, D, H, hkv = 200, 8, 64, 8, 2
    page_seq = c.rng.integers(0, 5, size=n_ctx // 8)
    seq_c = np.repeat(page_seq, 8)
    pos_c = np.zeros(n_ctx, int)
    for s in range(5):
        pos_c[seq_c == s] = np.arange((seq_c == s).sum())
    pos_t = [max(0, (seq_c == s).sum() - 1 - 3 * s) for s in range(5)]
    mask = np.full((T, n_ctx), -np.inf, np.float32)
    mask[:5] = _seqs_mask(seq_c, pos_c, list(range(5)), pos_t)
    seen = mask == 0.0                                         # a finite bias on what is seen: added too
    mask[seen] = 0.5 * c.rng.standard_normal(int(seen.sum())).astype(np.float32)
    cells_ref, off_ref = ref_mask_cells(mask, n_ctx)
    q = c.rng.standard_normal((T, H, D)).astype(np.float32)
    scale = 1.0 / math.sqrt(D)
    for kvt in CACHE_TYPES:
        ks, vs, k64, v64, strides = _any_kv(c, kvt, n_ctx, hkv, D)
        ref = ref_attention(q.astype(np.float64), k64, v64, scale, mask, 0.0, False)
        quant = {"k_strides": strides, "v_strides": strides, "kv_type": kvt} if strides else {}
        dq, dk, dv, dm = c.dev(q), c.dev(ks), c.dev(vs), c.dev(mask)
        outs = {}
        for path in ("cells", "decode", "prefill"):
            out = outs[path] = c.nan((T, H, D))
            if path == "cells":
                def run(dq=dq, dk=dk, dv=dv, dm=dm, out=out, quant=quant):
                    cells, off = c.dev(np.zeros(T * n_ctx, np.int32)), c.dev(np.zeros(T + 1, np.int32))
                    ck.mask_cells(dm, cells, off, c.dev(np.zeros(T, np.int32)), n_rows=T, n_kv=n_ctx)
                    ck.flash_attn_decode_cells(dq, dk, dv, out, cells, off, n_head=H, n_head_kv=hkv, head_dim=D,
                                               n_tokens=T, max_cells=n_ctx, scale=scale, mask=dm, **quant)
            else:
                fn = ck.flash_attn_decode if path == "decode" else ck.flash_attn_prefill

                def run(fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, out=out, quant=quant):
                    fn(dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T, n_kv=n_ctx, scale=scale,
                       mask=dm, causal=False, **quant)
            c.case("attn_mask_cells", f"{kvt} {path} vs f64", (D, H, hkv, n_ctx, T), run,
                   lambda out=out: c.host(out), ref, 1e-4)
        for path in ("decode", "prefill"):
            c.case("attn_mask_cells", f"{kvt} cells vs {path}", (D, H, hkv, n_ctx, T), lambda: None,
                   lambda: c.host(outs["cells"]), c.host(outs[path]), 1e-5)


@contextlib.contextmanager
def _block_order(order: str):
    """Run the launches inside in another block order where the engine can (the emulator runs blocks
    one after another; a GPU in an order of its own)."""
    from metatp.backends.cuda.launch import current_engine

    engine = current_engine()
    prev = getattr(engine, "block_order", None)
    if prev is not None:
        engine.block_order = order
    try:
        yield
    finally:
        if prev is not None:
            engine.block_order = prev


def _bits(a, ref) -> float:
    """0 when two float arrays hold the same bits, else inf."""
    a, ref = np.asarray(a), np.asarray(ref)
    return 0.0 if a.shape == ref.shape and np.array_equal(a.view(np.uint32), ref.view(np.uint32)) else float("inf")


def check_attn_decode_merge(c: Checker) -> None:
    """Split-KV decode merging its partials inside its own launch (the last block of each (token, head
    group) by a ticket counter): against float64 on every cache type, GQA groups of 1..16 heads, one
    split and many, KV lengths on both sides of a split boundary, the blocks run in index order,
    reversed and shuffled; three launches in a row over the same counters (each leaves them 0, so the
    next and a CUDA-graph replay start from zero); and bit for bit the same as attn_merge_f32 after it.
    Then the cell-list decode kernel merging in its launch."""
    from metatp.backends.cuda.launch import CACHE_TYPES

    ck = c.ck
    configs = [
        # (kv, D, H, Hkv, n_kv, T, splits, order)
        ("f16", 64, 9, 3, 128, 1, 2, "reverse"),          # 64-key chunks: 128 fills both
        ("f16", 64, 9, 3, 129, 1, 2, "shuffle"),          # one key past the boundary (chunk 65)
        ("f16", 64, 9, 3, 300, 1, 1, "reverse"),          # one split: no merge, no counters
        ("f16", 64, 9, 3, 300, 1, 7, "shuffle"),
        ("bf16", 64, 32, 8, 255, 1, 4, "reverse"),        # G=4 (Llama-3 shapes), chunk 64 - 1
        ("f32", 128, 32, 8, 257, 1, 4, "shuffle"),        # chunk 65: the last split holds 62 keys
        ("f16", 64, 8, 8, 200, 2, 5, "shuffle"),          # G=1, two tokens
        ("f16", 64, 16, 1, 190, 3, 3, "reverse"),         # G=16: two head groups of 8
        ("f32", 64, 6, 2, 40, 1, 9, "shuffle"),           # more splits than 64-key tiles: empty splits
    ]
    configs += [(qt, 64, 12, 4, 161, 1, 3, "shuffle") for qt in KV_QUANT_TYPES]
    for kvt, D, H, hkv, n_kv, T, splits, order in configs:
        ks, vs, k64, v64, strides = _any_kv(c, kvt, n_kv + 3, hkv, D)
        quant = {"k_strides": strides, "v_strides": strides, "kv_type": kvt} if strides else {}
        scale = 1.0 / math.sqrt(D)
        dk, dv = c.dev(ks), c.dev(vs)
        n_tick = ck.attn_ticket_ints(H, hkv, T)
        tickets = c.dev(np.zeros(n_tick, np.int32))
        label = f"{kvt} G={H // hkv} T={T} n_kv={n_kv} splits={splits} {order}"
        for rep in range(3):
            q = c.rng.standard_normal((T, H, D)).astype(np.float32)
            ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, None, 0.0, True, n_kv - T)
            dq = c.dev(q)
            outs = {m: c.nan((T, H, D)) for m in (True, False)}

            def run(dq=dq, outs=outs, D=D, H=H, hkv=hkv, T=T, n_kv=n_kv, splits=splits, scale=scale, dk=dk, dv=dv,
                    quant=quant, tickets=tickets, order=order):
                with _block_order(order):
                    for m, out in outs.items():
                        ck.flash_attn_decode(dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T,
                                             n_kv=n_kv, scale=scale, n_splits=splits, merge_in_launch=m,
                                             tickets=tickets, **quant)
            c.case("attn_decode_merge", f"{label} launch {rep + 1}", (D, H, hkv, n_kv, T), run,
                   lambda outs=outs: c.host(outs[True]), ref, 1e-4)
            c.case("attn_decode_merge", f"{label} launch {rep + 1} == attn_merge_f32", (D, H, hkv, n_kv, T),
                   lambda: None, lambda outs=outs: c.host(outs[True]), c.host(outs[False]), 0.0, err_fn=_bits)
        c.case("attn_decode_merge", f"{label} counters back to 0", (n_tick,), lambda: None,
               lambda tickets=tickets: c.host(tickets), np.zeros(n_tick, np.int32), 0.0, err_fn=_exact)

    # the cell-list kernel: lists of 0..150 cells, out of order, split 4 ways
    n_ctx, D, H, hkv = 200, 64, 8, 2
    lens = (150, 0, 64, 65, 1)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cells = np.concatenate([c.rng.permutation(n_ctx)[:n] for n in lens]).astype(np.int32)
    T = len(lens)
    for kvt in CACHE_TYPES:
        ks, vs, k64, v64, strides = _any_kv(c, kvt, n_ctx, hkv, D)
        quant = {"k_strides": strides, "v_strides": strides, "kv_type": kvt} if strides else {}
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        ref = np.zeros((T, H, D))
        for t in range(T):
            rows = cells[offs[t]:offs[t + 1]]
            if len(rows):
                ref[t] = ref_attention(q[t:t + 1].astype(np.float64), k64[rows], v64[rows], 1 / 8.0, None, 0.0,
                                       False)[0]
        dq, dk, dv, dc, do = c.dev(q), c.dev(ks), c.dev(vs), c.dev(cells), c.dev(offs)
        tickets = c.dev(np.zeros(ck.attn_ticket_ints(H, hkv, T), np.int32))
        outs = {m: c.nan((T, H, D)) for m in (True, False)}

        def run(dq=dq, dk=dk, dv=dv, dc=dc, do=do, outs=outs, quant=quant, tickets=tickets):
            with _block_order("shuffle"):
                for _ in range(2):
                    for m, out in outs.items():
                        ck.flash_attn_decode_cells(dq, dk, dv, out, dc, do, n_head=H, n_head_kv=hkv, head_dim=D,
                                                   n_tokens=T, max_cells=max(lens), scale=1 / 8.0, n_splits=4,
                                                   merge_in_launch=m, tickets=tickets, **quant)
        c.case("attn_decode_merge", f"cells {kvt} G={H // hkv} splits=4 shuffle", (D, H, hkv, n_ctx, T), run,
               lambda outs=outs: c.host(outs[True]), ref, 1e-4)
        c.case("attn_decode_merge", f"cells {kvt} == attn_merge_f32, counters 0", (D, H, hkv, n_ctx, T), lambda: None,
               lambda outs=outs, tickets=tickets: (c.host(outs[True]), c.host(tickets)),
               (c.host(outs[False]), np.zeros(tickets.size, np.int32)), 0.0,
               err_fn=lambda a, r: max(_bits(a[0], r[0]), _exact(a[1], r[1])))
