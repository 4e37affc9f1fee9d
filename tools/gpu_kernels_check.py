"""Check every metatp CUDA kernel against a numpy reference on a GPU.

    python -m metatp.tools.gpu_kernels_check            # markdown table, exit 1 on a failure
    python -m metatp.tools.gpu_kernels_check matvec attn_decode --reps 20
    python -m metatp.tools.gpu_kernels_check --emulate      # no GPU: kernels as host C++

``check_all_kernels()`` returns one dict per case: name, dtype, shape, max_rel_err,
threshold, pass, time_us (median of ``time_reps`` timed launches; None when not timed)
and error (the exception text when the case crashed). Every check runs in its own
try/except so one broken kernel does not hide the others. Outputs are pre-filled with
NaN, inputs are fresh random data; references are float64 numpy (``gguf.quants`` for
dequantisation). ``max_rel_err`` is max|out - ref| / max|ref|.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import traceback
from typing import Callable

import numpy as np

#: The check groups, in run order (``check_all_kernels(names=...)`` selects among them).
CHECK_NAMES = (
    "compile",
    "dequant",
    "matvec",
    "matvec_fused",
    "matvec_multi",
    "matvec_id",
    "rms_norm",
    "norm_sum_rows",
    "rope",
    "rope_pair",
    "set_rows",
    "set_rows_pair",
    "attn_decode",
    "attn_prefill",
    "attn_kv_len",
    "binary",
    "inplace_scale_fill",
    "activations",
    "unary",
    "soft_max",
    "argmax",
    "top_k",
    "get_rows",
    "add_id",
    "copy",
    "bf16",
)


# --------------------------------------------------------------------------- helpers
def _gguf():
    import gguf  # noqa: PLC0415

    return gguf


def _qtype(name: str):
    return _gguf().GGMLQuantizationType[name.upper()]


def rel_err(out, ref) -> float:
    """max|out - ref| / max|ref| (inf when out has NaN/inf where ref is finite)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} != reference {ref.shape}")
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(out), fin):
        return math.inf
    if not np.array_equal(out[~fin], ref[~fin], equal_nan=True):
        return math.inf
    if not fin.any():
        return 0.0
    denom = max(float(np.abs(ref[fin]).max()), 1e-30)
    return float(np.abs(out[fin] - ref[fin]).max() / denom)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's f32 -> bf16 (round to nearest even, NaN quieted) as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    r = np.where(nan, ((u >> 16) | 64).astype(np.uint16), r)
    return r.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def make_weight(rng: np.random.Generator, wtype: str, n_rows: int, ne0: int):
    """Random weight of a ggml type: (raw uint8 [n_rows, row_bytes], dequantized f32 [n_rows, ne0]).

    Q8_0/Q4_0/Q4_1/BF16 go through ``gguf.quants.quantize``; K-quants (which gguf cannot
    quantize) are random raw blocks with sane f16 d / dmin; the oracle is
    ``gguf.quants.dequantize``.
    """
    gguf = _gguf()
    quants = gguf.quants
    w = rng.standard_normal((n_rows, ne0)).astype(np.float32)
    if wtype == "f32":
        return w.view(np.uint8).copy(), w.copy()
    if wtype == "f16":
        w16 = w.astype(np.float16)
        return w16.view(np.uint8).copy(), w16.astype(np.float32)
    if wtype == "bf16":
        bits = f32_to_bf16_bits(w)
        return bits.view(np.uint8).copy(), bf16_bits_to_f32(bits)
    qt = _qtype(wtype)
    if wtype in ("q8_0", "q4_0", "q4_1"):
        raw = np.ascontiguousarray(quants.quantize(w, qt))
        return raw, quants.dequantize(raw, qt).astype(np.float32)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    nb = n_rows * ne0 // bs
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)

    def f16col(scale):
        return (rng.uniform(0.5, 1.5, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if wtype in ("q4_k", "q5_k"):
        raw[:, 0:2] = f16col(0.01)
        raw[:, 2:4] = f16col(0.005)
    elif wtype == "q6_k":
        raw[:, 208:210] = f16col(0.01)
    else:
        raise ValueError(wtype)
    raw = raw.reshape(n_rows, ne0 // bs * ts)
    return raw, quants.dequantize(raw, qt).astype(np.float32)


# ------------------------------------------------------------------- references
def ref_rope(x, pos, n_dims, freq_base, freq_scale, neox, freq_factors=None, attn_factor=1.0):
    """x float64 [T, H, D] -> rotated copy (ggml ROPE, mode NORMAL or NEOX)."""
    x = np.asarray(x, dtype=np.float64)
    y = x.copy()
    i0 = np.arange(0, n_dims, 2)
    theta = pos[:, None].astype(np.float64) * freq_base ** (-i0[None, :] / n_dims)
    if freq_factors is not None:
        theta = theta / np.asarray(freq_factors, np.float64)[None, :]
    theta = theta * freq_scale
    c = (np.cos(theta) * attn_factor)[:, None, :]
    s = (np.sin(theta) * attn_factor)[:, None, :]
    if neox:
        a, b = i0 // 2, i0 // 2 + n_dims // 2
    else:
        a, b = i0, i0 + 1
    x0, x1 = x[:, :, a], x[:, :, b]
    y[:, :, a] = x0 * c - x1 * s
    y[:, :, b] = x0 * s + x1 * c
    return y


def ref_attention(q, k, v, scale, mask=None, softcap=0.0, causal=True, causal_offset=0):
    """q [T, H, D], k/v [n_kv, Hkv, D] (float64) -> [T, H, D]; empty rows give 0."""
    T, H, D = q.shape
    n_kv, hkv, _ = k.shape
    g = H // hkv
    out = np.zeros((T, H, D))
    for h in range(H):
        kh = k[:, h // g, :]
        vh = v[:, h // g, :]
        s = (q[:, h, :] @ kh.T) * scale  # [T, n_kv]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + mask[:, :n_kv]
        if causal:
            j = np.arange(n_kv)[None, :]
            t = np.arange(T)[:, None]
            s = np.where(j <= t + causal_offset, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        ok = np.isfinite(m[:, 0])
        p = np.where(ok[:, None], np.exp(s - np.where(ok[:, None], m, 0.0)), 0.0)
        den = p.sum(axis=1, keepdims=True)
        o = p @ vh
        out[:, h, :] = np.where(den > 0, o / np.where(den > 0, den, 1.0), 0.0)
    return out


def _gelu(x):
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + np.tanh(c * x * (1.0 + 0.044715 * x * x)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


# ------------------------------------------------------------------- the checker
class _Arrays:
    """The few array operations the checks need, on CuPy (a GPU) or numpy (the emulator)."""

    def __init__(self, emulator=None):
        self.emulated = emulator is not None
        if self.emulated:
            self.xp = np
        else:
            import cupy as cp  # noqa: PLC0415

            self.xp = cp

    def dev(self, a):
        return self.xp.array(np.ascontiguousarray(a), copy=True)

    def host(self, a):
        return np.array(a, copy=True) if self.emulated else self.xp.asnumpy(a)

    def full(self, shape, value, dtype=np.float32):
        return self.xp.full(shape, value, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype=dtype)

    def empty_like(self, a):
        return self.xp.empty_like(a)

    def sync(self):
        if not self.emulated:
            self.xp.cuda.runtime.deviceSynchronize()


class _Checker:
    def __init__(self, seed: int, time_reps: int, emulator=None):
        from metatp.backends import cuda_kernels as ck  # noqa: PLC0415

        self.arrays = _Arrays(emulator)
        self.cp = self.arrays.xp
        self.ck = ck
        self.rng = np.random.default_rng(seed)
        self.time_reps = 0 if emulator is not None else time_reps
        self.results: list[dict] = []

    # device helpers
    def dev(self, a):
        return self.arrays.dev(a)

    def nan(self, shape, dtype=np.float32):
        return self.arrays.full(shape, np.nan, dtype)

    def host(self, a):
        return self.arrays.host(a)

    def sync(self):
        self.arrays.sync()

    def time_us(self, run: Callable[[], None]) -> float | None:
        if self.time_reps <= 0:
            return None
        cp = self.cp
        run()  # warm-up
        times = []
        for _ in range(self.time_reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000.0)
        return float(np.median(times))

    def case(self, name: str, dtype: str, shape, run: Callable[[], None], out: Callable,
             ref, threshold: float, err_fn=rel_err) -> None:
        """Run one case: launch, compare, time. Exceptions become a failed row."""
        row = {"name": name, "dtype": dtype, "shape": str(tuple(shape)), "max_rel_err": None,
               "threshold": threshold, "pass": False, "time_us": None, "error": None}
        try:
            run()
            self.sync()
            err = err_fn(out(), ref)
            row["max_rel_err"] = err
            row["pass"] = bool(err <= threshold)
            try:
                row["time_us"] = self.time_us(run)
            except Exception as e:  # noqa: BLE001 - timing must not fail a correct kernel
                row["error"] = f"timing: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=6)
        self.results.append(row)

    def fail(self, name: str, e: BaseException) -> None:
        self.results.append({"name": name, "dtype": "-", "shape": "-", "max_rel_err": None,
                             "threshold": None, "pass": False, "time_us": None,
                             "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc(limit=6)})

    # ------------------------------------------------------------------ checks
    def check_compile(self):
        ck = self.ck
        for fam in ck.FAMILIES:
            row = {"name": f"compile:{fam}", "dtype": "-", "shape": "-", "max_rel_err": None,
                   "threshold": None, "pass": False, "time_us": None, "error": None}
            try:
                t0 = time.perf_counter()
                ck.compile_all([fam])
                row["time_us"] = (time.perf_counter() - t0) * 1e6
                row["pass"] = True
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            self.results.append(row)

    def check_dequant(self):
        ck = self.ck
        n_rows, ne0 = 6, 512
        for wt in ck.WEIGHT_TYPES:
            raw, deq = make_weight(self.rng, wt, n_rows, ne0)
            d_raw = self.dev(raw)
            for odt, np_dt in (("f32", np.float32), ("f16", np.float16)):
                out = self.nan((n_rows, ne0), np_dt)
                ref = deq.astype(np_dt).astype(np.float64)
                self.case("dequant", f"{wt}->{odt}", (n_rows, ne0),
                          lambda d_raw=d_raw, out=out, wt=wt: ck.dequantize(
                              d_raw, wt, out, ne0=ne0, n_rows=n_rows),
                          lambda out=out: self.host(out), ref, 0.0)
        # padded destination rows (dst_row_stride > ne0)
        raw, deq = make_weight(self.rng, "q4_k", 3, 256)
        out = self.nan((3, 300))
        ref = np.full((3, 300), np.nan)
        ref[:, :256] = deq
        d_raw = self.dev(raw)
        self.case("dequant", "q4_k->f32 dst_stride=300", (3, 256),
                  lambda: ck.dequantize(d_raw, "q4_k", out, ne0=256, n_rows=3,
                                        dst_row_stride=300),
                  lambda: self.host(out), ref, 0.0)

    def check_matvec(self):
        ck = self.ck
        n_rows = 37
        for wt in ck.WEIGHT_TYPES:
            ne0 = 512
            raw, deq = make_weight(self.rng, wt, n_rows, ne0)
            d_raw = self.dev(raw)
            for nt in (1, 3, 8, 11):
                x = self.rng.standard_normal((nt, ne0)).astype(np.float32)
                ref = x.astype(np.float64) @ deq.astype(np.float64).T
                dx = self.dev(x)
                y = self.nan((nt, n_rows))
                self.case("matvec", wt, (n_rows, ne0, nt),
                          lambda d_raw=d_raw, dx=dx, y=y, wt=wt: ck.matvec(
                              d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows),
                          lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(ne0))
        # other block shapes: tiny rows (one warp per row), long rows (8 warps per row),
        # odd float rows
        for wt, ne0, rows, nt in (("q8_0", 64, 37, 1), ("q4_k", 4096, 5, 2), ("f32", 33, 7, 1),
                                  ("bf16", 1000, 3, 5)):
            raw, deq = make_weight(self.rng, wt, rows, ne0)
            x = self.rng.standard_normal((nt, ne0)).astype(np.float32)
            ref = x.astype(np.float64) @ deq.astype(np.float64).T
            d_raw, dx, y = self.dev(raw), self.dev(x), self.nan((nt, rows))
            self.case("matvec", wt, (rows, ne0, nt),
                      lambda d_raw=d_raw, dx=dx, y=y, wt=wt, ne0=ne0, rows=rows: ck.matvec(
                          d_raw, wt, dx, y, ne0=ne0, n_rows=rows),
                      lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(ne0))
        # per-device slice of a weight split along ne0 (row parallel): rows keep their
        # full stride, the pointer starts at the slice's first block.
        for wt in ("q4_0", "q6_k", "f16"):
            full, sl0, sl1 = 1024, 256, 768
            raw, deq = make_weight(self.rng, wt, n_rows, full)
            qk, nb = ck.WEIGHT_TYPES[wt]
            d_raw = self.dev(raw)
            b0 = sl0 // qk * nb
            x = self.rng.standard_normal((2, sl1 - sl0)).astype(np.float32)
            ref = x.astype(np.float64) @ deq[:, sl0:sl1].astype(np.float64).T
            dx = self.dev(x)
            y = self.nan((2, n_rows))
            self.case("matvec", f"{wt} ne0-slice", (n_rows, sl1 - sl0, 2),
                      lambda d_raw=d_raw, dx=dx, y=y, wt=wt, b0=b0: ck.matvec(
                          d_raw.reshape(-1)[b0:], wt, dx, y, ne0=sl1 - sl0, n_rows=n_rows,
                          w_row_bytes=raw.shape[1]),
                      lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(full))
        # SmolLM2-like shape, Q4_1 (576 -> 1536)
        raw, deq = make_weight(self.rng, "q4_1", 1536, 576)
        x = self.rng.standard_normal((1, 576)).astype(np.float32)
        d_raw, dx, y = self.dev(raw), self.dev(x), self.nan((1, 1536))
        self.case("matvec", "q4_1", (1536, 576, 1),
                  lambda: ck.matvec(d_raw, "q4_1", dx, y, ne0=576, n_rows=1536),
                  lambda: self.host(y), x.astype(np.float64) @ deq.astype(np.float64).T, 1e-4)

    def check_rms_norm(self):
        ck = self.ck
        n_rows, ne0, eps = 5, 576, 1e-5
        x = self.rng.standard_normal((n_rows, 600)).astype(np.float32)
        w = self.rng.standard_normal(ne0).astype(np.float32)
        xs = x[:, :ne0].astype(np.float64)
        base = xs / np.sqrt((xs * xs).mean(axis=1, keepdims=True) + eps)
        dx, dw = self.dev(x), self.dev(w)
        for with_w in (True, False):
            y = self.nan((n_rows, ne0))
            ref = base * w if with_w else base
            self.case("rms_norm", "f32" + ("" if with_w else " no-weight"), (n_rows, ne0),
                      lambda y=y, with_w=with_w: ck.rms_norm(dx[:, :ne0], y, eps=eps,
                                                             weight=dw if with_w else None),
                      lambda y=y: self.host(y), ref, 1e-5)
        # in place, single long row
        x1 = self.rng.standard_normal((1, 8192)).astype(np.float32)
        d1 = self.dev(x1)
        x64 = x1.astype(np.float64)
        ref = x64 / np.sqrt((x64 * x64).mean() + eps)
        self.case("rms_norm", "f32 in-place", (1, 8192),
                  lambda: ck.rms_norm(d1, d1, eps=eps), lambda: self.host(d1), ref, 1e-5)

    def check_rope(self):
        ck = self.ck
        T, H, D = 5, 3, 64
        pos = self.rng.integers(0, 100, size=T).astype(np.int32)
        dpos = self.dev(pos)
        for neox in (False, True):
            for n_dims, fs in ((64, 1.0), (32, 0.5)):
                x = self.rng.standard_normal((T, H, D)).astype(np.float32)
                ref = ref_rope(x, pos, n_dims, 10000.0, fs, neox)
                dx = self.dev(x)
                y = self.nan((T, H, D))
                self.case("rope", f"{'neox' if neox else 'norm'} n_dims={n_dims} fs={fs}",
                          (D, H, T),
                          lambda dx=dx, y=y, neox=neox, n_dims=n_dims, fs=fs: ck.rope(
                              dx, y, dpos, head_dim=D, n_head=H, n_tokens=T, n_dims=n_dims,
                              freq_base=10000.0, freq_scale=fs, neox=neox),
                          lambda y=y: self.host(y), ref, 1e-4)
        # strided input (Q part of a fused QKV row), freq_factors, in place
        fused = self.rng.standard_normal((T, 5 * H * D)).astype(np.float32)
        ff = self.rng.uniform(1.0, 4.0, D // 2).astype(np.float32)
        xq = fused[:, : H * D].reshape(T, H, D)
        ref_full = fused.astype(np.float64).copy()
        ref_full[:, : H * D] = ref_rope(xq, pos, D, 500000.0, 1.0, True, ff, 1.0).reshape(T, -1)
        dfused, dff = self.dev(fused), self.dev(ff)
        self.case("rope", "neox strided in-place freq_factors", (D, H, T),
                  lambda: ck.rope(dfused, dfused, dpos, head_dim=D, n_head=H, n_tokens=T,
                                  n_dims=D, freq_base=500000.0, neox=True, freq_factors=dff,
                                  x_strides=(D, 5 * H * D), y_strides=(D, 5 * H * D)),
                  lambda: self.host(dfused), ref_full, 1e-4)

    def check_rope_pair(self):
        """Q and K of a layer rotated in one launch (strided views of different head counts)."""
        ck = self.ck
        T, D = 3, 64
        pos = self.rng.integers(0, 500, size=T).astype(np.int32)
        dpos = self.dev(pos)
        for neox in (False, True):
            q = self.rng.standard_normal((T, 9, D)).astype(np.float32)
            k = self.rng.standard_normal((T, 5 * D)).astype(np.float32)   # 3 heads + padding
            kv = k[:, : 3 * D].reshape(T, 3, D)
            ref = np.concatenate([ref_rope(q, pos, D, 10000.0, 1.0, neox).reshape(-1),
                                  ref_rope(kv, pos, D, 10000.0, 1.0, neox).reshape(-1)])
            dq, dk = self.dev(q), self.dev(k)
            yq, yk = self.nan((T, 9, D)), self.nan((T, 3, D))
            self.case("rope", f"{'neox' if neox else 'norm'} pair q+k", (D, 9 + 3, T),
                      lambda dq=dq, dk=dk, yq=yq, yk=yk, neox=neox: ck.rope(
                          dq, yq, dpos, head_dim=D, n_head=9, n_tokens=T, n_dims=D, freq_base=10000.0,
                          neox=neox, second=(dk, yk, 3, (D, 5 * D), None)),
                      lambda yq=yq, yk=yk: np.concatenate([self.host(yq).reshape(-1),
                                                           self.host(yk).reshape(-1)]), ref, 1e-4)

    def check_set_rows(self):
        ck = self.ck
        ne0, n_slots = 96, 10
        src = self.rng.standard_normal((4, 128)).astype(np.float32)
        idx = np.array([7, 2, 9, 0], dtype=np.int32)
        dsrc, didx = self.dev(src), self.dev(idx)
        for name, dt in (("f16", np.float16), ("bf16", np.uint16), ("f32", np.float32)):
            init = self.rng.standard_normal((n_slots, ne0)).astype(np.float32)
            if name == "bf16":
                init_s = f32_to_bf16_bits(init)
                vals = f32_to_bf16_bits(src[:, :ne0])
            else:
                init_s = init.astype(dt)
                vals = src[:, :ne0].astype(dt)
            ref = init_s.copy()
            ref[idx] = vals
            dst = self.dev(init_s)

            def get(dst=dst, name=name):
                h = self.host(dst)
                return bf16_bits_to_f32(h) if name == "bf16" else h.astype(np.float64)

            ref_v = bf16_bits_to_f32(ref) if name == "bf16" else ref.astype(np.float64)
            self.case("set_rows", f"f32->{name}", (ne0, 4),
                      lambda dst=dst: ck.set_rows(dsrc[:, :ne0], dst, didx),
                      get, ref_v, 0.0)

    def check_set_rows_pair(self):
        """K and V rows of a layer stored by one launch (different widths, strided source)."""
        ck = self.ck
        idx = np.array([5, 1], dtype=np.int32)
        k = self.rng.standard_normal((2, 100)).astype(np.float32)
        v = self.rng.standard_normal((2, 48)).astype(np.float32)
        ck_init = np.zeros((8, 64), np.float16)
        cv_init = np.zeros((8, 48), np.float16)
        ref_k, ref_v = ck_init.copy(), cv_init.copy()
        ref_k[idx] = k[:, :64].astype(np.float16)
        ref_v[idx] = v.astype(np.float16)
        dk, dv, didx = self.dev(k), self.dev(v), self.dev(idx)
        ck_d, cv_d = self.dev(ck_init), self.dev(cv_init)
        self.case("set_rows", "f32->f16 pair k+v", (64 + 48, 2),
                  lambda: ck.set_rows(dk[:, :64], ck_d, didx, second=(dv, cv_d)),
                  lambda: np.concatenate([self.host(ck_d).reshape(-1), self.host(cv_d).reshape(-1)]).astype(np.float64),
                  np.concatenate([ref_k.reshape(-1), ref_v.reshape(-1)]).astype(np.float64), 0.0)

    def _kv(self, kvt, n_ctx, hkv, D):
        k = self.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
        v = self.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
        if kvt == "f16":
            ks, vs = k.astype(np.float16), v.astype(np.float16)
            return ks, vs, ks.astype(np.float64), vs.astype(np.float64)
        if kvt == "bf16":
            ks, vs = f32_to_bf16_bits(k), f32_to_bf16_bits(v)
            return (ks, vs, bf16_bits_to_f32(ks).astype(np.float64),
                    bf16_bits_to_f32(vs).astype(np.float64))
        return k, v, k.astype(np.float64), v.astype(np.float64)

    def check_attn_decode(self):
        ck = self.ck
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
            ks, vs, k64, v64 = self._kv(kvt, n_ctx, hkv, D)
            q = self.rng.standard_normal((T, H, D)).astype(np.float32)
            scale = 1.0 / math.sqrt(D)
            mask = None
            if masked:
                mask = np.where(self.rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
                mask[:, -1] = 0.0
            ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                                softcap, True, n_kv - T)
            dq, dk, dv = self.dev(q), self.dev(ks), self.dev(vs)
            dm = self.dev(mask) if mask is not None else None
            out = self.nan((T, H, D))
            self.case("attn_decode",
                      f"{kvt} G={H // hkv} splits={splits or 'auto'}"
                      + (" mask" if masked else "") + (" softcap" if softcap else ""),
                      (D, H, hkv, n_kv, T),
                      lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                      n_kv=n_kv, scale=scale, splits=splits, softcap=softcap:
                      ck.flash_attn_decode(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                           head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                           mask=dm, softcap=softcap, n_splits=splits),
                      lambda out=out: self.host(out), ref, 1e-4)

    def check_attn_prefill(self):
        ck = self.ck
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
            ks, vs, k64, v64 = self._kv(kvt, n_kv + 3, hkv, D)
            q = self.rng.standard_normal((T, H, D)).astype(np.float32)
            scale = 1.0 / math.sqrt(D)
            mask = None
            causal = not masked
            if masked:  # causal mask given explicitly instead of the causal flag
                j = np.arange(n_kv)[None, :]
                t = np.arange(T)[:, None]
                mask = np.where(j <= t + past, 0.0, -np.inf).astype(np.float32)
            ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                                0.0, causal, past)
            dq, dk, dv = self.dev(q), self.dev(ks), self.dev(vs)
            dm = self.dev(mask) if mask is not None else None
            out = self.nan((T, H, D))
            self.case("attn_prefill", f"{kvt} G={H // hkv}" + (" mask" if masked else " causal"),
                      (D, H, hkv, n_kv, T),
                      lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                      n_kv=n_kv, scale=scale, causal=causal:
                      ck.flash_attn_prefill(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                            head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                            mask=dm, causal=causal),
                      lambda out=out: self.host(out), ref, 1e-4)

    def check_binary(self):
        ck = self.ck
        a = self.rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
        da = self.dev(a)
        ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
        for bshape in ((5,), (4, 1), (1, 3, 1, 5), (2, 3, 4, 5), (1, 1, 2, 5)):
            b = self.rng.uniform(0.5, 2.0, bshape).astype(np.float32)
            db = self.dev(b)
            breps = tuple(s // bs for s, bs in zip(a.shape, (1,) * (4 - len(bshape)) + bshape))
            bfull = np.tile(b.reshape((1,) * (4 - len(bshape)) + bshape), breps)
            for op, fn in ops.items():
                out = self.nan(a.shape)
                ref = fn(a.astype(np.float64), bfull.astype(np.float64))
                self.case("binary", f"{op} b={bshape}", a.shape,
                          lambda op=op, db=db, out=out: ck.binary(op, da, db, out),
                          lambda out=out: self.host(out), ref, 1e-6)
        # non-contiguous a (transposed view), in place into a copy
        at = self.dev(a).transpose(0, 1, 3, 2)  # (2, 3, 5, 4) view
        b = self.rng.standard_normal(4).astype(np.float32)
        db = self.dev(b)
        out = self.nan(at.shape)
        ref = a.transpose(0, 1, 3, 2).astype(np.float64) * b
        self.case("binary", "mul strided-a", at.shape,
                  lambda: ck.mul(at, db, out), lambda: self.host(out), ref, 1e-6)

    def check_inplace_scale_fill(self):
        ck = self.ck
        n = 1000
        y0 = self.rng.standard_normal(n).astype(np.float32)
        x = self.rng.standard_normal(n).astype(np.float32)
        xb = f32_to_bf16_bits(x)
        yb = f32_to_bf16_bits(y0)
        dx, dxb = self.dev(x), self.dev(xb)
        dy0, dyb0 = self.dev(y0), self.dev(yb)
        cases = (
            ("f32+=f32", dy0, dx, lambda h: h, y0.astype(np.float64) + x, 1e-6),
            ("f32+=bf16", dy0, dxb, lambda h: h, y0.astype(np.float64) + bf16_bits_to_f32(xb),
             1e-6),
            ("bf16+=bf16", dyb0, dxb, bf16_bits_to_f32,
             bf16_bits_to_f32(f32_to_bf16_bits(bf16_bits_to_f32(yb) + bf16_bits_to_f32(xb))),
             0.0),
        )
        for label, y_init, xin, conv, ref, thr in cases:
            y = self.arrays.empty_like(y_init)

            def run(y=y, y_init=y_init, xin=xin):
                y[...] = y_init  # fresh accumulator for every launch (timing reruns it)
                ck.add_inplace(y, xin)

            self.case("add_inplace", label, (n,), run,
                      lambda y=y, conv=conv: conv(self.host(y)), ref, thr)
        out = self.nan(n)
        self.case("scale", "f32", (n,), lambda: ck.scale(dx, out, 0.125, 0.5),
                  lambda: self.host(out), x.astype(np.float64) * 0.125 + 0.5, 1e-6)
        out2 = self.nan(n)
        self.case("fill", "f32", (n,), lambda: ck.fill(out2, 0.0), lambda: self.host(out2),
                  np.zeros(n), 0.0)

    def check_activations(self):
        ck = self.ck
        rows, ne0 = 7, 300
        fused = self.rng.standard_normal((rows, 2 * ne0)).astype(np.float32) * 3
        df = self.dev(fused)
        g64, u64 = fused[:, :ne0].astype(np.float64), fused[:, ne0:].astype(np.float64)
        for name, fn, act in (("swiglu", ck.swiglu, _silu), ("geglu", ck.geglu, _gelu)):
            out = self.nan((rows, ne0))
            self.case(name, "f32 fused-halves", (ne0, rows),
                      lambda fn=fn, out=out: fn(df[:, :ne0], df[:, ne0:], out),
                      lambda out=out: self.host(out), act(g64) * u64, 1e-5)
        x = self.rng.standard_normal(777).astype(np.float32) * 4
        dx = self.dev(x)
        for name, fn, act in (("silu", ck.silu, _silu), ("gelu", ck.gelu, _gelu)):
            out = self.nan(777)
            self.case(name, "f32", (777,), lambda fn=fn, out=out: fn(dx, out),
                      lambda out=out: self.host(out), act(x.astype(np.float64)), 1e-5)

    def check_soft_max(self):
        ck = self.ck
        rows, ne0 = 6, 333
        x = self.rng.standard_normal((rows, ne0)).astype(np.float32) * 3
        mask = np.where(self.rng.random((3, ne0)) < 0.2, -np.inf, 0.0).astype(np.float32)
        dx, dm = self.dev(x), self.dev(mask)
        for masked, sc in ((False, 1.0), (True, 0.5)):
            z = x.astype(np.float64) * sc
            if masked:
                z = z + np.tile(mask, (2, 1))
            e = np.exp(z - z.max(axis=1, keepdims=True))
            ref = e / e.sum(axis=1, keepdims=True)
            out = self.nan((rows, ne0))
            self.case("soft_max", f"f32 mask={masked} scale={sc}", (ne0, rows),
                      lambda out=out, masked=masked, sc=sc: ck.soft_max(
                          dx, out, mask=dm if masked else None, scale=sc),
                      lambda out=out: self.host(out), ref, 1e-5)

    def check_argmax(self):
        ck = self.ck
        rows, ne0 = 9, 5000
        x = self.rng.standard_normal((rows, ne0)).astype(np.float32)
        x[1, 10] = x[1, 4000] = 50.0  # tie: first index wins
        x[2, :] = 1.0
        x[3, 4999] = 99.0
        dx = self.dev(x)
        out = self.arrays.full(rows, -1, np.int32)
        self.case("argmax", "f32", (ne0, rows), lambda: ck.argmax(dx, out),
                  lambda: self.host(out).astype(np.float64),
                  np.argmax(x, axis=1).astype(np.float64), 0.0,
                  err_fn=lambda o, r: 0.0 if np.array_equal(o, r) else math.inf)

    def check_get_rows(self):
        ck = self.ck
        n_src = 10
        idx = np.array([3, 0, 9, 3], dtype=np.int32)
        didx = self.dev(idx)
        for wt in ck.WEIGHT_TYPES:
            ne0 = 512
            raw, deq = make_weight(self.rng, wt, n_src, ne0)
            d_raw = self.dev(raw)
            out = self.nan((len(idx), ne0))
            self.case("get_rows", wt, (ne0, len(idx)),
                      lambda d_raw=d_raw, out=out, wt=wt: ck.get_rows(d_raw, wt, didx, out,
                                                                     ne0=ne0),
                      lambda out=out: self.host(out), deq[idx].astype(np.float64), 0.0)

    def check_copy(self):
        ck = self.ck
        x = self.rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
        conv = {
            "f32": (lambda a: a.astype(np.float32), lambda a: a.astype(np.float64)),
            "f16": (lambda a: a.astype(np.float16), lambda a: a.astype(np.float64)),
            "bf16": (f32_to_bf16_bits, lambda a: bf16_bits_to_f32(a).astype(np.float64)),
        }
        dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
        for s, d in (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"),
                     ("f32", "bf16"), ("bf16", "f32")):
            xs = conv[s][0](x)
            src = self.dev(xs).transpose(2, 0, 3, 1)  # strided view
            ref_src = conv[s][1](xs).transpose(2, 0, 3, 1)
            ref = conv[d][1](conv[d][0](ref_src.astype(np.float32)))
            dst = self.arrays.zeros(src.shape, dt[d])
            self.case("copy", f"{s}->{d} strided", src.shape,
                      lambda src=src, dst=dst: ck.copy(src, dst),
                      lambda dst=dst, d=d: conv[d][1](self.host(dst)), ref, 0.0)

    def check_bf16(self):
        ck = self.ck
        n = 4099
        x = (self.rng.standard_normal(n) * 10).astype(np.float32)
        x[:4] = [np.inf, -np.inf, 0.0, -0.0]
        dx = self.dev(x)
        out = self.arrays.zeros(n, np.uint16)
        self.case("f32_to_bf16", "f32->bf16", (n,), lambda: ck.f32_to_bf16(dx, out),
                  lambda: self.host(out).astype(np.float64),
                  f32_to_bf16_bits(x).astype(np.float64), 0.0)
        bits = f32_to_bf16_bits(x)
        db = self.dev(bits)
        outf = self.nan(n)
        self.case("bf16_to_f32", "bf16->f32", (n,), lambda: ck.bf16_to_f32(db, outf),
                  lambda: self.host(outf), bf16_bits_to_f32(bits).astype(np.float64), 0.0)

    # ------------------------------------------------------------------ fused / new kernels
    def check_matvec_fused(self):
        """matvec + residual add (per token, and a broadcast bias), gate/up + GLU."""
        ck = self.ck
        n_rows, ne0 = 45, 512
        for wt in ("q4_1", "q8_0", "q6_k", "f32"):
            raw, deq = make_weight(self.rng, wt, n_rows, ne0)
            d_raw = self.dev(raw)
            for nt in (1, 3):
                x = self.rng.standard_normal((nt, ne0)).astype(np.float32)
                res = self.rng.standard_normal((nt, n_rows)).astype(np.float32)
                ref = x.astype(np.float64) @ deq.astype(np.float64).T + res
                dx, dres = self.dev(x), self.dev(res)
                y = self.nan((nt, n_rows))
                self.case("matvec+add", wt, (n_rows, ne0, nt),
                          lambda d_raw=d_raw, dx=dx, y=y, dres=dres, wt=wt: ck.matvec(
                              d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows, add=dres),
                          lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(ne0))
            bias = self.rng.standard_normal(n_rows).astype(np.float32)
            x = self.rng.standard_normal((2, ne0)).astype(np.float32)
            ref = x.astype(np.float64) @ deq.astype(np.float64).T + bias
            dx, db = self.dev(x), self.dev(bias)
            y = self.nan((2, n_rows))
            self.case("matvec+bias", wt, (n_rows, ne0, 2),
                      lambda d_raw=d_raw, dx=dx, y=y, db=db, wt=wt: ck.matvec(
                          d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows, add=db, add_stride=0),
                      lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(ne0))
        for wt, act, fn in (("q4_1", "swiglu", _silu), ("q4_k", "geglu", _gelu),
                            ("f16", "swiglu", _silu)):
            ne0 = 256 if wt == "q4_k" else 576
            rg, dg = make_weight(self.rng, wt, n_rows, ne0)
            ru, du = make_weight(self.rng, wt, n_rows, ne0)
            x = self.rng.standard_normal(ne0).astype(np.float32)
            x64 = x.astype(np.float64)
            ref = fn(dg.astype(np.float64) @ x64) * (du.astype(np.float64) @ x64)
            drg, dru, dx = self.dev(rg), self.dev(ru), self.dev(x)
            y = self.nan(n_rows)
            self.case("matvec_glu", f"{wt} {act}", (n_rows, ne0),
                      lambda drg=drg, dru=dru, dx=dx, y=y, wt=wt, ne0=ne0, act=act: ck.matvec_glu(
                          drg, dru, wt, dx, y, ne0=ne0, n_rows=n_rows, act=act),
                      lambda y=y: self.host(y), ref, 1e-4)

    def check_matvec_multi(self):
        """q/k/v in one launch (3 weights, different row counts), with and without the RMS
        norm of x folded in; a single weight with the norm (the lm head after the final norm);
        gate/up + GLU with the norm."""
        ck = self.ck
        eps = 1e-5
        ne0 = 576
        x = self.rng.standard_normal(ne0).astype(np.float32) * 2
        nw = (1.0 + 0.1 * self.rng.standard_normal(ne0)).astype(np.float32)
        x64 = x.astype(np.float64)
        xn = x64 / np.sqrt((x64 * x64).mean() + eps) * nw
        dx, dnw = self.dev(x), self.dev(nw)
        for wt in ("q4_1", "q8_0", "f16"):
            rows = (576, 192, 192)
            ws = [make_weight(self.rng, wt, r, ne0) for r in rows]
            dws = [self.dev(raw) for raw, _ in ws]
            for norm in (False, True):
                xin = xn if norm else x64
                refs = [deq.astype(np.float64) @ xin for _, deq in ws]
                ys = [self.nan(r) for r in rows]
                jobs = [(dw, y, r, raw.shape[1]) for dw, y, r, (raw, _) in zip(dws, ys, rows, ws)]
                self.case("matvec_multi", f"{wt} qkv" + (" +rms_norm" if norm else ""), (ne0, rows),
                          lambda jobs=jobs, wt=wt, norm=norm: ck.matvec_multi(
                              jobs, wt, dx, ne0=ne0, norm_weight=dnw if norm else None,
                              eps=eps if norm else None),
                          lambda ys=ys: np.concatenate([self.host(y) for y in ys]),
                          np.concatenate(refs), 1e-5 * math.sqrt(ne0))
        raw, deq = make_weight(self.rng, "q8_0", 999, ne0)
        d_raw, y = self.dev(raw), self.nan(999)
        self.case("matvec_multi", "q8_0 one weight +rms_norm (lm head)", (ne0, 999),
                  lambda: ck.matvec_multi([(d_raw, y, 999, raw.shape[1])], "q8_0", dx, ne0=ne0,
                                          norm_weight=dnw, eps=eps),
                  lambda: self.host(y), deq.astype(np.float64) @ xn, 1e-5 * math.sqrt(ne0))
        rg, dg = make_weight(self.rng, "q4_1", 300, ne0)
        ru, du = make_weight(self.rng, "q4_1", 300, ne0)
        ref = _silu(dg.astype(np.float64) @ xn) * (du.astype(np.float64) @ xn)
        drg, dru, y = self.dev(rg), self.dev(ru), self.nan(300)
        self.case("matvec_glu", "q4_1 swiglu +rms_norm", (300, ne0),
                  lambda: ck.matvec_glu(drg, dru, "q4_1", dx, y, ne0=ne0, n_rows=300, act="swiglu",
                                        norm_weight=dnw, eps=eps),
                  lambda: self.host(y), ref, 1e-4)

    def check_matvec_id(self):
        """MUL_MAT_ID: per-token expert selection, x shared (n_b = 1) or per slot."""
        ck = self.ck
        n_exp, n_rows, ne0, n_used, T = 5, 24, 256, 2, 3
        for wt in ("q4_0", "q8_0", "f32"):
            raws, deqs = zip(*(make_weight(self.rng, wt, n_rows, ne0) for _ in range(n_exp)))
            raw = np.ascontiguousarray(np.stack(raws))
            expert_bytes = raw.shape[1] * raw.shape[2]
            ids = np.array([[0, 4], [2, 2], [3, 1]], dtype=np.int32)
            for n_b in (1, n_used):
                x = self.rng.standard_normal((T, n_b, ne0)).astype(np.float32)
                ref = np.zeros((T, n_used, n_rows))
                for t in range(T):
                    for u in range(n_used):
                        ref[t, u] = deqs[ids[t, u]].astype(np.float64) @ x[t, u % n_b].astype(np.float64)
                d_raw, dx, dids = self.dev(raw), self.dev(x), self.dev(ids)
                y = self.nan((T, n_used, n_rows))
                self.case("matvec_id", f"{wt} n_b={n_b}", (n_rows, ne0, n_used, T),
                          lambda d_raw=d_raw, dx=dx, y=y, dids=dids, wt=wt: ck.matvec_id(
                              d_raw, wt, dx, y, dids, ne0=ne0, n_rows=n_rows,
                              expert_bytes=expert_bytes),
                          lambda y=y: self.host(y), ref, 1e-5 * math.sqrt(ne0))

    def check_norm_sum_rows(self):
        """Layer norm, RMS norm on a strided 4-D view (per-head rows), SUM_ROWS."""
        ck = self.ck
        eps = 1e-5
        x = self.rng.standard_normal((2, 3, 5, 70)).astype(np.float32) + 0.5
        w = self.rng.standard_normal(64).astype(np.float32)
        xv = x[:, :, :, 3:67]
        x64 = xv.astype(np.float64)
        mu = x64.mean(axis=-1, keepdims=True)
        ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * w
        dx, dw = self.dev(x), self.dev(w)
        y = self.nan((2, 3, 5, 64))
        self.case("norm", "f32 strided 4-D", (64, 5, 3, 2),
                  lambda: ck.norm(dx[:, :, :, 3:67], y, eps=eps, weight=dw),
                  lambda: self.host(y), ref, 1e-5)
        ref = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
        y2 = self.nan((2, 3, 5, 64))
        self.case("rms_norm", "f32 strided 4-D", (64, 5, 3, 2),
                  lambda: ck.rms_norm(dx[:, :, :, 3:67], y2, eps=eps),
                  lambda: self.host(y2), ref, 1e-5)
        out = self.nan((2, 3, 5, 1))
        self.case("sum_rows", "f32 strided 4-D", (64, 5, 3, 2),
                  lambda: ck.sum_rows(dx[:, :, :, 3:67], out), lambda: self.host(out),
                  x64.sum(axis=-1, keepdims=True), 1e-5)

    def check_unary(self):
        ck = self.ck
        x = (self.rng.standard_normal((3, 4, 50)) * 4).astype(np.float32)
        x[0, 0, :3] = [-100.0, 100.0, 0.0]
        dx = self.dev(x)
        xv64 = x[:, :, 5:45].transpose(1, 0, 2).astype(np.float64)
        refs = {"sigmoid": 1.0 / (1.0 + np.exp(-xv64)), "softplus": np.logaddexp(0.0, xv64),
                "silu": _silu(xv64), "gelu": _gelu(xv64), "scale": xv64 * -0.5 + 2.0}
        for op, ref in refs.items():
            out = self.nan(xv64.shape)
            self.case("unary", f"{op} strided", xv64.shape,
                      lambda op=op, out=out: ck.unary(op, dx[:, :, 5:45].transpose(1, 0, 2), out,
                                                      -0.5, 2.0),
                      lambda out=out: self.host(out), ref, 1e-5)

    def check_top_k(self):
        ck = self.ck
        rows, ne0, k = 5, 60, 6
        x = self.rng.standard_normal((rows, ne0)).astype(np.float32)
        x[1, [3, 7, 50]] = 9.0                     # ties: lower index first
        x[2, :] = -np.inf                         # all -inf: indices in order
        x[3, [0, 1]] = np.nan                     # NaN goes last
        x[4, :10] = 0.0
        x[4, 10:] = -1.0
        ref = np.argsort(-x, axis=-1, kind="stable")[:, :k].astype(np.float64)
        dx = self.dev(x)
        out = self.arrays.full((rows, k), -1, np.int32)
        self.case("top_k", "f32", (ne0, rows), lambda: ck.top_k(dx, out, k),
                  lambda: self.host(out).astype(np.float64), ref, 0.0,
                  err_fn=lambda o, r: 0.0 if np.array_equal(o, r) else math.inf)

    def check_add_id(self):
        ck = self.ck
        T, n_used, ne0, n_exp = 3, 2, 40, 4
        a = self.rng.standard_normal((T, n_used, ne0)).astype(np.float32)
        b = self.rng.standard_normal((n_exp, ne0)).astype(np.float32)
        ids = np.array([[3, 0], [1, 1], [2, 3]], dtype=np.int32)
        ref = a.astype(np.float64) + b.astype(np.float64)[ids]
        da, db, dids = self.dev(a), self.dev(b), self.dev(ids)
        out = self.nan(a.shape)
        self.case("add_id", "f32", (ne0, n_used, T), lambda: ck.add_id(da, db, dids, out),
                  lambda: self.host(out), ref, 1e-6)

    def check_attn_kv_len(self):
        """kv_len in device memory: keys beyond it are never read (NaN there must not leak),
        and changing it needs no new launch arguments (what a CUDA graph replays)."""
        ck = self.ck
        D, H, hkv, n_kv = 64, 9, 3, 256
        ks, vs, k64, v64 = self._kv("f16", n_kv, hkv, D)
        ks[100:] = np.nan
        vs[100:] = np.nan
        for T, kernel in ((1, "decode"), (6, "prefill")):
            q = self.rng.standard_normal((T, H, D)).astype(np.float32)
            dq, dk, dv = self.dev(q), self.dev(ks), self.dev(vs)
            for used in (100, 37):
                mask = np.full((T, n_kv), -np.inf, dtype=np.float32)
                for t in range(T):
                    mask[t, : used - T + t + 1] = 0.0
                ref = ref_attention(q.astype(np.float64), k64[:used], v64[:used], 1 / 8.0,
                                    mask[:, :used], 0.0, False)
                dm = self.dev(mask)
                dlen = self.dev(np.array([used], dtype=np.int32))
                out = self.nan((T, H, D))
                fn = ck.flash_attn_decode if kernel == "decode" else ck.flash_attn_prefill
                self.case(f"attn_{kernel}", f"f16 kv_len={used}/{n_kv}", (D, H, hkv, n_kv, T),
                          lambda fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, dlen=dlen, out=out, T=T: fn(
                              dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T,
                              n_kv=n_kv, scale=1 / 8.0, mask=dm, causal=False, kv_len=dlen),
                          lambda out=out: self.host(out), ref, 1e-4)



def check_all_kernels(names=None, *, seed: int = 0, time_reps: int = 5,
                      emulate: bool = False) -> list[dict]:
    """Run the kernel checks (all, or the groups in ``names``); one dict per case.

    emulate: run the kernels on the CPU emulator (``cuda_kernels.use_emulator``) instead of
    a GPU (no timing)."""
    from metatp.backends import cuda_kernels as ck  # noqa: PLC0415

    names = list(CHECK_NAMES if names is None else names)
    for n in names:
        if n not in CHECK_NAMES:
            raise ValueError(f"unknown check {n!r}; known: {CHECK_NAMES}")
    ctx = ck.use_emulator() if emulate else contextlib.nullcontext()
    with ctx as emu:
        try:
            chk = _Checker(seed, time_reps, emu)
        except Exception as e:  # noqa: BLE001 - no cupy / no GPU
            return [{"name": "setup", "dtype": "-", "shape": "-", "max_rel_err": None,
                     "threshold": None, "pass": False, "time_us": None,
                     "error": f"{type(e).__name__}: {e}"}]
        for n in names:
            try:
                getattr(chk, f"check_{n}")()
            except Exception as e:  # noqa: BLE001 - a crashing group becomes a failed row
                chk.fail(n, e)
    return chk.results


def markdown_table(results: list[dict]) -> str:
    lines = ["| name | dtype | shape | max rel err | threshold | pass | time µs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        err = "-" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.2e}"
        thr = "-" if r.get("threshold") is None else f"{r['threshold']:.0e}"
        tus = "-" if r.get("time_us") is None else f"{r['time_us']:.1f}"
        ok = "yes" if r["pass"] else "**NO**"
        lines.append(f"| {r['name']} | {r['dtype']} | {r['shape']} | {err} | {thr} | {ok} "
                     f"| {tus} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"check groups (default all): {' '.join(CHECK_NAMES)}")
    ap.add_argument("--reps", type=int, default=5, help="timed launches per case (0: no timing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulate", action="store_true",
                    help="run on the CPU emulator (g++) instead of a GPU")
    args = ap.parse_args(argv)
    results = check_all_kernels(args.names or None, seed=args.seed, time_reps=args.reps,
                                emulate=args.emulate)
    print(markdown_table(results))
    bad = [r for r in results if not r["pass"]]
    for r in bad:
        if r.get("error"):
            print(f"\n{r['name']} [{r['dtype']}]: {r['error']}", file=sys.stderr)
            if r.get("traceback"):
                print(r["traceback"], file=sys.stderr)
    print(f"\n{len(results) - len(bad)}/{len(results)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
