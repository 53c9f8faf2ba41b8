"""Exact memory search, torch against faiss: ``retriever.exact.TorchFlatIndex`` (one matmul and a
top-k on the tensors' device, ``retriever.search=device``) against faiss's ``Flat`` index on the
host (``retriever.search=faiss``), over memory sizes and embedding widths. Best of ``--reps``
searches of ``--queries`` unit queries, top ``--k``; on a GPU the faiss row includes the copies of
the queries to the host and of the ids back. One JSON line per size, and whether both found the
same documents.

    python scripts/bench/search.py                       # the CPU
    python scripts/bench/search.py --device cuda --docs 100000 1000000
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


def best_ms(fn, device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after 3 untimed ones, in ms (device work in)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--docs", type=int, nargs="+", default=[1000, 10_000, 30_000, 100_000])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    print(json.dumps({"device": str(dev), "threads": torch.get_num_threads(), "k": a.k}))
    for n in a.docs:
        for dim in a.dims:
            x = F.normalize(torch.randn(n, dim, generator=g), dim=-1)  # (N, E)
            q = F.normalize(torch.randn(a.queries, dim, generator=g), dim=-1).to(dev)  # (B, E)
            ours, flat = TorchFlatIndex(x, device=dev), build_index(x.numpy(), factory="Flat")

            def via_host():
                return torch.from_numpy(flat.search(q.cpu().numpy(), a.k)[1]).to(dev)

            t_ours = best_ms(lambda: ours.search(q, a.k), dev, a.reps)
            t_faiss = best_ms(via_host, dev, a.reps)
            same = torch.equal(ours.search(q, a.k)[1].cpu(), via_host().cpu())
            row = {"docs": n, "dim": dim, "queries": a.queries, "torch_ms": round(t_ours, 3)}
            row |= {"faiss_ms": round(t_faiss, 3), "faiss_over_torch": round(t_faiss / t_ours, 2)}
            print(json.dumps(row | {"same_ids": same}), flush=True)


if __name__ == "__main__":
    main()
