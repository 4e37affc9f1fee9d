"""Bit-identity snapshot for refactors: the logits of `score()`, greedy and seeded-sampled tokens and
completion logprobs on the default model, numpy exact and q8, N=1 and -sm tensor N=2 (under
`mpiexec -n 2 ... --mpi`: one rank a device). Take one before a change and one after, then compare:

    python -m scripts.logits_snapshot before.npz            # (and: mpiexec -n 2 python -m scripts.logits_snapshot b.npz --mpi)
    python -m scripts.logits_snapshot after.npz
    python -m scripts.logits_snapshot --compare before.npz after.npz
"""
import sys

import numpy as np


def compare(a_path: str, b_path: str) -> int:
    a, b = np.load(a_path), np.load(b_path)
    bad = [k for k in a.files if k not in b.files or a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    print(f"{len(a.files)} arrays; {len(bad)} differ: {bad}")
    return 1 if bad else 0


def snapshot(out_path: str, mpi: bool) -> None:
    from metatp import LLM, SamplingParams

    prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
    res = {}
    configs = ([("exact", 2, "tensor")] if mpi else
               [(n, d, s) for n in ("exact", "llamacpp") for d, s in ((1, None), (2, "tensor"))])
    for numerics, n_dev, sm in configs:
        kw = dict(n_ctx=512, backend="numpy", numerics=numerics)
        if not mpi:
            kw.update(n_devices=n_dev, split_mode=sm)
        else:
            kw.update(split_mode=sm)
        llm = LLM(**kw)
        tag = f"{numerics}-{n_dev}-{sm}"
        ids = llm.tokenize(prompts[1])
        res[f"{tag}/score"] = llm.score(ids)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))
        for i, o in enumerate(outs):
            res[f"{tag}/gen{i}"] = np.array(o.outputs[0].token_ids)
            res[f"{tag}/gen{i}_text"] = np.array(o.outputs[0].text)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, seed=3, top_k=20))
        for i, o in enumerate(outs):
            res[f"{tag}/samp{i}"] = np.array(o.outputs[0].token_ids)
        c = llm("The capital of France is", max_tokens=6, logprobs=3, temperature=0)
        res[f"{tag}/lp"] = np.array(c["choices"][0]["logprobs"]["token_logprobs"], dtype=np.float64)
        del llm
    if not mpi or __import__("mpi4py.MPI").MPI.COMM_WORLD.rank == 0:       # rank 0 writes
        np.savez(out_path, **res)
        print("saved", out_path, len(res))


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        raise SystemExit(compare(sys.argv[2], sys.argv[3]))
    snapshot(sys.argv[1], "--mpi" in sys.argv)
