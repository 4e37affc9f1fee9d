"""`metatp info`: metadata, hyper-parameters, tensor types and sizes of a GGUF model."""

from __future__ import annotations

from collections import Counter

__all__ = ["print_info"]


def _short(v) -> str:
    if isinstance(v, list):
        head = ", ".join(repr(x) for x in v[:4])
        return f"[{head}{', ...' if len(v) > 4 else ''}] (len {len(v)})"
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


def print_info(model: str | None) -> None:
    from metatp.ir.loader import load_model
    from metatp.models import resolve_model

    m = load_model(resolve_model(model))
    hp = m.hparams
    print(f"model: {m.path}")
    print(f"name: {m.name}   architecture: {m.arch}")
    print(f"layers {hp.n_layer}  n_embd {hp.n_embd}  heads {hp.n_head}  kv heads {hp.n_head_kv[0]}  "
          f"head_dim {hp.head_dim_k}  n_ff {hp.n_ff[0]}  vocab {hp.n_vocab}  trained ctx {hp.n_ctx_train}")
    print(f"rope: dims {hp.rope_dims}  base {hp.rope_freq_base:g}  norm eps {hp.norm_eps:g}")
    print("\nmetadata:")
    for k, v in m.metadata.items():
        print(f"  {k} = {_short(v)}")
    types = Counter(w.type.name for w in m.weights.values())
    total = m.weight_bytes()
    print(f"\ntensors: {len(m.weights)}  ({', '.join(f'{n} x {t}' for t, n in types.most_common())}), "
          f"{total / 2**20:.1f} MiB")
    for w in m.weights.values():
        print(f"  {w.name:40s} {w.type.name:6s} {str(list(w.ne)):22s} {w.n_bytes:>12,d} B")
