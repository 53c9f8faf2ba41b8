"""Exact memory search, torch against faiss: ``retriever.exact.TorchFlatIndex`` (one matmul and a
top-k, ``retriever.search=device``) against faiss's ``Flat`` index (``retriever.search=faiss``),
on the CPU, over memory sizes and embedding widths. Best of ``--reps`` searches of ``--queries``
unit queries, top ``--k``. One JSON line per size, and whether both found the same documents.
The GPU's comparison (the faiss path copying the queries to the host and the ids back) is
``scripts/gpu_verify.py``'s ``search`` step.

    python scripts/bench/search.py
    python scripts/bench/search.py --docs 100000 --dims 768
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retriever.exact import TorchFlatIndex  # noqa: E402
from retriever.index import build_index  # noqa: E402


def best_ms(fn, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after 3 untimed ones, in ms."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1000, 10_000, 30_000, 100_000])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(json.dumps({"threads": torch.get_num_threads(), "k": a.k}))
    for n in a.docs:
        for dim in a.dims:
            x = F.normalize(torch.randn(n, dim, generator=g), dim=-1)  # (N, E)
            q = F.normalize(torch.randn(a.queries, dim, generator=g), dim=-1)  # (B, E)
            ours, flat = TorchFlatIndex(x), build_index(x.numpy(), factory="Flat")
            t_ours = best_ms(lambda: ours.search(q, a.k), a.reps)
            t_faiss = best_ms(lambda: flat.search(q.numpy(), a.k), a.reps)
            theirs = torch.from_numpy(flat.search(q.numpy(), a.k)[1])
            same = torch.equal(ours.search(q, a.k)[1], theirs)
            row = {"docs": n, "dim": dim, "queries": a.queries, "torch_ms": round(t_ours, 3)}
            row |= {"faiss_ms": round(t_faiss, 3), "faiss_over_torch": round(t_faiss / t_ours, 2)}
            print(json.dumps(row | {"same_ids": same}), flush=True)


if __name__ == "__main__":
    main()
