"""Kernel checks of the ``mmvq`` family (numerics="q8"): the Q8 rounding of activations bit for bit
against `ref_q8_quantize` (codes, d, s; ties and zero blocks), and every int8 product against
`ref_q8_matmul` (llama.cpp's CPU vec_dot in float64 on the same codes and scales): every type, 1..11
tokens (prologue and workspace), rows not a multiple of a block's rows, ne0 256..14336, a residual
and a bias, ne0 slices, unaligned weights (no 16-byte loads), q/k/v and gate/up + GLU with the
RMS norm folded in."""

from __future__ import annotations

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import Q8_KIND_OF_WEIGHT, gelu, make_weight, ref_q8_matmul, ref_q8_quantize, silu

CHECKS = ('mmvq_quantize', 'mmvq', 'mmvq_fused', 'mmvq_half')

#: integer sums are exact: only the float order of the per-block scale products differs
_TOL = 1e-5
_KINDS = {"q8_0": 0, "q8_1": 1, "q8_k": 2}
_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
#: types checked at fewer token counts (the token loop is the same code for every type: emulator time)
_FEW_COUNTS = ("q5_0", "q5_1", "q2_k", "q3_k")


def _mismatch(got, want) -> float:
    """Fraction of elements that differ (bits compared; 0.0 when identical)."""
    got, want = np.asarray(got), np.asarray(want)
    return float(np.mean(got.view(np.uint8) != want.view(np.uint8))) if got.shape == want.shape else 1.0


def _awkward_x(rng, n: int, ne0: int) -> np.ndarray:
    """Activations with the rounding's corner cases: a zero block of 32, a zero block of 256, equal
    |x| of opposite signs (Q8_K takes the first), halves that round to even."""
    x = rng.standard_normal((n, ne0)).astype(np.float32)
    x[0, 32:64] = 0.0
    if ne0 >= 512:
        x[-1, 256:512] = 0.0
    x[0, 0:256] = np.clip(x[0, 0:256], -2.0, 2.0)
    x[0, 5], x[0, 3] = 3.0, -3.0              # the first of the largest |x| is -3 at index 3
    x[-1, -32:] = np.arange(32, dtype=np.float32) - 15.5      # many q at .5 before rint
    return x


def check_mmvq_quantize(c: Checker) -> None:
    """mmvq_quantize_<kind>: codes, d and s exactly as the CPU path; mmvq_round_<kind>: q * d."""
    ck = c.ck
    for kind, k in _KINDS.items():
        for n, ne0 in ((1, 256), (3, 1024)):
            x = _awkward_x(c.rng, n, ne0)
            q, d, s, _ = ref_q8_quantize(x, k)
            xp = np.zeros((n, ne0 + 64), np.float32)       # strided rows
            xp[:, :ne0] = x
            dx = c.dev(xp)
            xq = c.dev(np.zeros(n * ne0, np.int8))
            nd = n * ne0 // 32
            xds = c.nan((2 * nd,))
            run = (lambda dx=dx, xq=xq, xds=xds, kind=kind, ne0=ne0:
                   ck.mmvq.quantize_q8(dx[:, :ne0], kind, xq, xds, ne0=ne0))
            c.case("mmvq_quantize codes", kind, (n, ne0), run,
                   lambda xq=xq, q=q: _mismatch(c.host(xq).reshape(q.shape), q), None, 0.0, lambda o, r: o)
            d32 = np.repeat(d, ne0 // 32 // d.shape[1], axis=1).astype(np.float32)
            c.case("mmvq_quantize d", kind, (n, ne0), lambda: None,
                   lambda xds=xds, d32=d32, nd=nd: _mismatch(c.host(xds)[:nd].reshape(d32.shape), d32), None, 0.0,
                   lambda o, r: o)
            if k == 1:
                c.case("mmvq_quantize s", kind, (n, ne0), lambda: None,
                       lambda xds=xds, s=s, nd=nd: _mismatch(c.host(xds)[nd:].reshape(s.shape), s), None, 0.0,
                       lambda o, r: o)
            out = c.nan((n, ne0))
            want = (q.astype(np.float32).reshape(n, -1, 32) * d32[..., None]).reshape(n, ne0)
            c.case("mmvq_round", kind, (n, ne0),
                   lambda dx=dx, out=out, kind=kind, ne0=ne0: ck.mmvq.round_q8(dx[:, :ne0], kind, out, ne0=ne0),
                   lambda out=out, want=want: _mismatch(c.host(out), want), None, 0.0, lambda o, r: o)


def _product_case(c: Checker, label: str, wt: str, raw, x, *, ne0: int, rows: int, w=None, w_row_bytes=None,
                  add=None, prologue=None) -> None:
    """One `mmvq` launch against ref_q8_matmul (+ add); y inside wider rows, x from the workspace
    or the prologue."""
    ck = c.ck
    nt = x.shape[0]
    ref = ref_q8_matmul(raw, wt, ne0, x)
    if add is not None:
        ref = ref + add.astype(np.float64)
    d_raw = c.dev(raw) if w is None else w
    dx = c.dev(x)
    y = c.nan((nt, rows + 3))
    da = None if add is None else c.dev(add)
    xq = c.dev(np.zeros(nt * ne0, np.int8))
    xds = c.nan((2 * nt * ne0 // 32,))
    c.case(label, wt, (rows, ne0, nt),
           lambda: ck.mmvq.mmvq(d_raw, wt, dx, y[:, :rows], ne0=ne0, n_rows=rows, w_row_bytes=w_row_bytes,
                                add=da, xq=xq, xds=xds, prologue=prologue),
           lambda: c.host(y)[:, :rows], ref, _TOL)


def check_mmvq(c: Checker) -> None:
    """Every type at 1 (prologue and workspace), 2, 3, 5, 8 and 11 tokens; 37 rows; long rows; a
    residual and a bias; ne0 slices; a weight at a 2-byte offset (no 16-byte loads)."""
    for wt in _TYPES:
        ne0, rows = 512, 37
        raw, _ = make_weight(c.rng, wt, rows, ne0)
        counts = (((1, True), (1, False), (2, None), (3, None), (5, None), (8, None), (11, None))
                  if wt not in _FEW_COUNTS else ((1, True), (3, None), (11, None)))
        for nt, prologue in counts:
            x = _awkward_x(c.rng, nt, ne0)
            _product_case(c, f"mmvq {'prologue' if prologue else 'workspace'}", wt, raw, x, ne0=ne0, rows=rows,
                          prologue=prologue)
    # row lengths 256 .. 14336 (one to 8 warps per row)
    for wt, ne0, rows, nt in (("q4_k", 256, 9, 1), ("q8_0", 2048, 5, 2), ("q6_k", 4096, 3, 1),
                              ("q4_0", 14336, 2, 1), ("q5_k", 14336, 2, 3)):
        raw, _ = make_weight(c.rng, wt, rows, ne0)
        _product_case(c, "mmvq", wt, raw, c.rng.standard_normal((nt, ne0)).astype(np.float32), ne0=ne0, rows=rows)
    # more row blocks than a prologue launch has blocks (4 per SM): each block walks several
    for wt, ne0, rows in (("q4_0", 256, 300), ("q6_k", 4096, 41)):
        raw, _ = make_weight(c.rng, wt, rows, ne0)
        _product_case(c, "mmvq prologue row walk", wt, raw, c.rng.standard_normal((1, ne0)).astype(np.float32),
                      ne0=ne0, rows=rows, prologue=True)
    # residual (per token) and bias (one row) added in the epilogue
    for wt, nt in (("q4_1", 1), ("q4_k", 4), ("q6_k", 3)):
        raw, _ = make_weight(c.rng, wt, 21, 512)
        x = c.rng.standard_normal((nt, 512)).astype(np.float32)
        _product_case(c, "mmvq + residual", wt, raw, x, ne0=512, rows=21,
                      add=c.rng.standard_normal((nt, 21)).astype(np.float32))
        _product_case(c, "mmvq + bias", wt, raw, x, ne0=512, rows=21,
                      add=c.rng.standard_normal((1, 21)).astype(np.float32))
    # per-device slice of a weight split along ne0: pointer at the slice's first block, full stride
    for wt in ("q4_0", "q4_k", "q6_k"):
        full, sl0, sl1 = 1024, 256, 768
        raw, _ = make_weight(c.rng, wt, 13, full)
        qk, nb = c.ck.WEIGHT_TYPES[wt]
        b0 = sl0 // qk * nb
        sub = np.ascontiguousarray(raw.reshape(13, -1)[:, b0: sl1 // qk * nb])
        for nt in (1, 2):
            x = c.rng.standard_normal((nt, sl1 - sl0)).astype(np.float32)
            _product_case(c, "mmvq ne0-slice", wt, sub, x, ne0=sl1 - sl0, rows=13,
                          w=c.dev(raw).reshape(-1)[b0:], w_row_bytes=raw.shape[1])
    # K-quants 2 bytes off a 16-byte boundary: the 2-byte loads
    for wt in ("q4_k", "q5_k"):
        raw, _ = make_weight(c.rng, wt, 7, 512)
        buf = np.zeros(raw.size + 2, np.uint8)
        buf[2:] = raw.reshape(-1)
        x = c.rng.standard_normal((1, 512)).astype(np.float32)
        _product_case(c, "mmvq unaligned", wt, raw, x, ne0=512, rows=7, w=c.dev(buf)[2:])


def _normed(x: np.ndarray, nw, eps: float) -> np.ndarray:
    """x' as the RMS_NORM and MUL kernels make it (float32: x * scale, then * nw)."""
    x = x.astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(np.float32(np.mean(x.astype(np.float64) ** 2)) + np.float32(eps))
    xs = (x * np.float32(scale)).astype(np.float32)
    return xs if nw is None else (xs * nw).astype(np.float32)


def _exact_norm_x(rng, ne0: int) -> np.ndarray:
    """Multiples of 1/8: squares and their sums are exact, so every order of the RMS sum gives the
    same scale (and the same codes) as the reference."""
    return (rng.integers(-40, 41, ne0) / 8.0).astype(np.float32)


def check_mmvq_fused(c: Checker) -> None:
    """mmvq_multi (1..3 weights, with and without the folded norm, norm weight or not) and
    mmvq_swiglu / mmvq_geglu (with and without the norm) on every type."""
    ck = c.ck
    eps = 1e-5
    for wt in _TYPES:
        ne0 = 512
        x = _exact_norm_x(c.rng, ne0)
        nw = (1.0 + 0.25 * c.rng.integers(-2, 3, ne0)).astype(np.float32)
        raws = [make_weight(c.rng, wt, r, ne0)[0] for r in ((37, 11, 11) if wt != "q8_0" else (200, 64, 64))]
        for n_jobs, norm, with_w in ((3, True, True), (2, False, False), (1, True, False)):
            xn = _normed(x, nw if with_w else None, eps) if norm else x
            refs = [ref_q8_matmul(raws[j], wt, ne0, xn[None])[0] for j in range(n_jobs)]
            ys = [c.nan((raws[j].shape[0],)) for j in range(n_jobs)]
            jobs = [(c.dev(raws[j]), ys[j], raws[j].shape[0], raws[j].shape[1]) for j in range(n_jobs)]
            kw = {"norm_weight": c.dev(nw) if with_w else None, "eps": eps} if norm else {}
            c.case(f"mmvq_multi{' norm' if norm else ''}", wt, (n_jobs, ne0),
                   lambda jobs=jobs, kw=kw: ck.mmvq.mmvq_multi(jobs, wt, c.dev(x), ne0=ne0, **kw),
                   lambda ys=ys: np.concatenate([c.host(y) for y in ys]), np.concatenate(refs), _TOL)
        g_rows = 29 if wt != "q4_k" else 301          # q4_k: more row blocks than the launch's blocks
        rg, ru = (make_weight(c.rng, wt, g_rows, ne0)[0] for _ in range(2))
        for act, f in (("swiglu", silu), ("geglu", gelu)):
            for norm in (True, False):
                xn = _normed(x, nw, eps) if norm else x
                with np.errstate(over="ignore"):        # silu of a large negative sum: exp overflows to 0
                    ref = f(ref_q8_matmul(rg, wt, ne0, xn[None])[0]) * ref_q8_matmul(ru, wt, ne0, xn[None])[0]
                y = c.nan((g_rows,))
                kw = {"norm_weight": c.dev(nw), "eps": eps} if norm else {}
                c.case(f"mmvq_{act}{' norm' if norm else ''}", wt, (g_rows, ne0),
                       lambda y=y, act=act, kw=kw: ck.mmvq.mmvq_glu(c.dev(rg), c.dev(ru), wt, c.dev(x), y, ne0=ne0,
                                                                   n_rows=g_rows, act=act, **kw),
                       lambda y=y: c.host(y), ref, 1e-4)


def check_mmvq_half(c: Checker) -> None:
    """mmvq_round_f16: x (strided rows) rounded to f16 bit for bit, with and without the folded RMS
    norm; matvec / matvec_multi / matvec_glu on f16 and bf16 weights through `half_rounded` against
    a float64 product with x rounded to f16."""
    ck = c.ck
    for n, ne0, norm in ((3, 1000, False), (1, 512, True), (1, 512, False)):
        x = _exact_norm_x(c.rng, ne0)[None].repeat(n, 0) if norm else c.rng.standard_normal((n, ne0)).astype(np.float32)
        if not norm:          # (the norm's inputs stay multiples of 1/8: an exact scale in any order)
            x[0, :3] = (70000.0, 1e-8, 1.0 + 2.0 ** -11)      # overflow to inf, subnormal, a tie to even
        nw = (1.0 + 0.25 * c.rng.integers(-2, 3, ne0)).astype(np.float32)
        with np.errstate(over="ignore"):
            want = (_normed(x[0], nw, 1e-5)[None] if norm else x).astype(np.float16).astype(np.float32)
        xp = np.zeros((n, ne0 + 8), np.float32)
        xp[:, :ne0] = x
        dx, out = c.dev(xp), c.nan((n, ne0))
        kw = {"norm_weight": c.dev(nw), "eps": 1e-5} if norm else {}
        c.case(f"mmvq_round_f16{' norm' if norm else ''}", "f16", (n, ne0),
               lambda dx=dx, out=out, kw=kw, ne0=ne0: ck.mmvq.round_f16(dx[:, :ne0], out, ne0=ne0, **kw),
               lambda out=out, want=want: _mismatch(c.host(out)[:want.shape[0]], want), None, 0.0, lambda o, r: o)
    for wt in ("f16", "bf16"):
        ne0, rows = 256, 19
        raw, deq = make_weight(c.rng, wt, rows, ne0)
        raw2, deq2 = make_weight(c.rng, wt, rows, ne0)
        buf = c.nan((8 * ne0,))
        x = c.rng.standard_normal((3, ne0)).astype(np.float32)
        xh = x.astype(np.float16).astype(np.float64)
        y = c.nan((3, rows))
        c.case("half_rounded matvec", wt, (rows, ne0, 3),
               lambda raw=raw, y=y, wt=wt, x=x, buf=buf: ck.mmvq.half_rounded(
                   ck.matvec.matvec, buf, c.dev(raw), wt, c.dev(x), y, ne0=ne0, n_rows=rows),
               lambda y=y: c.host(y), xh @ deq.astype(np.float64).T, _TOL)
        x1 = _exact_norm_x(c.rng, ne0)
        nw = (1.0 + 0.25 * c.rng.integers(-2, 3, ne0)).astype(np.float32)
        xn = _normed(x1, nw, 1e-5).astype(np.float16).astype(np.float64)
        y1, y2 = c.nan((rows,)), c.nan((rows,))
        c.case("half_rounded matvec_multi norm", wt, (rows, ne0),
               lambda raw=raw, raw2=raw2, y1=y1, y2=y2, wt=wt, x1=x1, nw=nw, buf=buf: ck.mmvq.half_rounded(
                   ck.matvec.matvec_multi, buf, [(c.dev(raw), y1, rows, raw.shape[1]), (c.dev(raw2), y2, rows,
                                                                                         raw2.shape[1])],
                   wt, c.dev(x1), ne0=ne0, norm_weight=c.dev(nw), eps=1e-5),
               lambda y1=y1, y2=y2: np.concatenate([c.host(y1), c.host(y2)]),
               np.concatenate([deq.astype(np.float64) @ xn, deq2.astype(np.float64) @ xn]), _TOL)
        yg = c.nan((rows,))
        ref = silu(deq.astype(np.float64) @ xn) * (deq2.astype(np.float64) @ xn)
        c.case("half_rounded matvec_glu norm", wt, (rows, ne0),
               lambda raw=raw, raw2=raw2, yg=yg, wt=wt, x1=x1, nw=nw, buf=buf: ck.mmvq.half_rounded(
                   ck.matvec.matvec_glu, buf, c.dev(raw), c.dev(raw2), wt, c.dev(x1), yg, ne0=ne0, n_rows=rows,
                   act="swiglu", norm_weight=c.dev(nw), eps=1e-5),
               lambda yg=yg: c.host(yg), ref, 1e-4)


assert set(Q8_KIND_OF_WEIGHT) >= set(_TYPES)
