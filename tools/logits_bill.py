"""What reading a step's logits moves between processes, per sampled row, for `metatp dump`.

Under a vocabulary split (-sm tensor, one process per device) rank 0 samples, and what it
samples from crosses between processes (backends/logits_read.py, backends/candidates.py): the
whole row (an Allgatherv of every device's slice) for full logits and the requests sampled
from the whole vocabulary; 3 float64 per device for a greedy token; 2k + 5 float64 per device
for top-k / min-p sampling and logprobs from k candidates (only where that is fewer bytes than
the row, `candidates_pay`). Bytes one process receives per row, from the plan's split.
"""

from __future__ import annotations

from metatp.passes.plan import Plan

__all__ = ["logits_bill", "bill_lines", "CANDIDATE_KS"]

# the candidates per device of top_k 40 with logprobs (41) and of a min-p request (65): metatp.sampling
CANDIDATE_KS = (41, 65)
_LOGITS_ITEMSIZE = 4     # float32 logits on the host


def logits_bill(plan: Plan, ks: tuple[int, ...] = CANDIDATE_KS) -> dict | None:
    """{n_vocab, n_devices, gathered, argmax, candidates: {k: bytes or None (gathered instead)}}:
    bytes the busiest process receives per sampled row; None where the logits are not split
    along the vocabulary (nothing to save: one process reads them whole)."""
    t = plan.graph.meta.get("logits")
    if t is None or plan.n_devices < 2:
        return None
    st = plan.of(t).sync_state
    if st.is_mirrored or st.is_partial or st.axis != 0:
        return None
    n, n_vocab = plan.n_devices, int(t.ne[0])
    sizes = [0] * n
    for j, _, _, length in st.chunks():
        sizes[j] += length
    cand = {}
    for k in ks:
        width = 8 * (2 * k + 5)
        cand[k] = width * (n - 1) if width * n < _LOGITS_ITEMSIZE * n_vocab else None
    return {"n_vocab": n_vocab, "n_devices": n, "gathered": _LOGITS_ITEMSIZE * (n_vocab - min(sizes)),
            "argmax": 24 * (n - 1), "candidates": cand}


def bill_lines(b: dict | None) -> list[str]:
    """The dump's text lines for `logits_bill`."""
    if b is None:
        return []
    cand = ", ".join(f"k={k} {v} B" if v is not None else f"k={k} gathered" for k, v in b["candidates"].items())
    return ["", f"logits read per sampled row (vocabulary {b['n_vocab']} over {b['n_devices']} processes, "
                "bytes the busiest receives)",
            f"  whole row (score, full logits, sampling over the whole vocabulary): {b['gathered']} B;"
            f" greedy: {b['argmax']} B; candidates: {cand}"]
