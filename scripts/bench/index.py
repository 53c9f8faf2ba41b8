"""Benchmark the retrieval index: build time, queries/s and recall@10 per faiss index family.

    python scripts/bench/index.py                          # 1M x 256 generated vectors, ~15 min
    python scripts/bench/index.py --n 100000 --nq 1000     # a quick look
    python scripts/bench/index.py --embeddings mem.npy [--queries q.npy]   # a real memory

Data: 1M unit vectors in 256-d drawn from a mixture of overlapping Gaussian clusters living near
a 32-d subspace (real embeddings have a low intrinsic dimension), plus isotropic noise. Clusters
overlap, so a query's neighbours straddle IVF cells: IVF with nprobe=1 stays well below recall 1
and the benchmark reports by how much. Queries come from the same distribution, ground truth
from exact (Flat) search. Metric: inner product, as the retriever uses.

Reports per index and setting: build seconds (train + add), queries/s over ``--nq`` queries
searched in batches of ``--batch``, recall@10 (fraction of the true 10 nearest found in the
returned 10), and the speed-up over Flat. faiss runs on ``--threads`` OpenMP threads. JSON goes
to ``--out`` (default runs/bench/index.json) and a table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)
from retriever.index import FaissIndex, default_factory, default_search_params, ivf_nlist  # noqa: E402

K = 10  # recall@10


def generate(
    n: int, nq: int, dim: int, seed: int, clusters: int, latent: int, spread: float, noise: float
):
    """(n, dim) database and (nq, dim) queries, float32 unit rows, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    # (latent, dim)
    basis = np.linalg.qr(rng.standard_normal((dim, latent)))[0].T.astype(np.float32)
    centres = rng.standard_normal((clusters, latent)).astype(np.float32)  # (C, latent)

    def draw(m: int, r: np.random.Generator) -> np.ndarray:
        out = np.empty((m, dim), np.float32)
        for s in range(0, m, 100_000):  # chunks bound the temporaries
            b = min(100_000, m - s)
            z = centres[r.integers(0, clusters, b)] + spread * r.standard_normal(
                (b, latent), dtype=np.float32
            )
            x = z @ basis + noise * r.standard_normal((b, dim), dtype=np.float32)  # (b, dim)
            out[s : s + b] = x / np.linalg.norm(x, axis=1, keepdims=True)
        return out

    return draw(n, np.random.default_rng(seed + 1)), draw(nq, np.random.default_rng(seed + 2))


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(np.intersect1d(f, t, assume_unique=True)) for f, t in zip(found, truth))
    return hits / truth.size


def timed_search(index: FaissIndex, q: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    index.search(q[: min(32, len(q))], K)  # warm-up: page in lists, allocate scratch
    t = time.perf_counter()
    ids = np.concatenate([index.search(q[s : s + batch], K)[1] for s in range(0, len(q), batch)])
    return ids, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1_000_000, help="generated database vectors")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--nq", type=int, default=2000, help="queries (Flat at ~370 q/s: 5 s over 1M)")
    p.add_argument("--batch", type=int, default=1000, help="queries per search call")
    p.add_argument("--threads", type=int, default=2, help="faiss OpenMP threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clusters", type=int, default=2000, help="mixture components")
    p.add_argument("--latent", type=int, default=32, help="intrinsic dimension")
    p.add_argument(
        "--spread", type=float, default=0.7, help="within-cluster std (centres ~ N(0,1)): overlap"
    )
    p.add_argument("--noise", type=float, default=0.1, help="isotropic noise std per coordinate")
    p.add_argument(
        "--embeddings", type=Path, help="(N, d) .npy memory to benchmark instead of generated data"
    )
    p.add_argument(
        "--queries",
        type=Path,
        help="(nq, d) .npy queries for --embeddings (default: held-out rows)",
    )
    p.add_argument("--nlist", type=int, help="IVF lists (default: as default_factory picks for N)")
    p.add_argument(
        "--train-per-list",
        type=int,
        default=40,
        help="k-means sample = this x nlist (faiss wants >= 39)",
    )
    p.add_argument(
        "--only",
        default="flat,ivf_flat,hnsw,ivf_pq",
        help="families: flat,ivf_flat,ivf_hnsw,hnsw,ivf_pq",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench/index.json"))
    args = p.parse_args()
    faiss.omp_set_num_threads(args.threads)
    families = set(args.only.split(","))

    t0 = time.perf_counter()
    if args.embeddings is not None:
        x = np.load(args.embeddings).astype(np.float32)
        if args.queries is not None:
            q = np.load(args.queries).astype(np.float32)
        else:  # hold out rows as queries: each has its true neighbours in the rest of the memory
            held = np.random.default_rng(args.seed).choice(
                len(x), min(args.nq, len(x) // 10), replace=False
            )
            q, x = x[held], np.delete(x, held, axis=0)
        source = {
            "embeddings": str(args.embeddings),
            "queries": str(args.queries or "held-out rows"),
        }
    else:
        x, q = generate(
            args.n,
            args.nq,
            args.dim,
            args.seed,
            args.clusters,
            args.latent,
            args.spread,
            args.noise,
        )
        source = {k: getattr(args, k) for k in ("seed", "clusters", "latent", "spread", "noise")}
        source["generator"] = "overlapping Gaussian mixture near a latent subspace, unit-normalised"
    n, dim = x.shape
    print(f"data: {n} x {dim}, {len(q)} queries ({time.perf_counter() - t0:.1f}s)", flush=True)
    nlist = args.nlist or ivf_nlist(n)
    train = x[
        np.random.default_rng(args.seed).choice(
            n, min(n, args.train_per_list * nlist), replace=False
        )
    ]

    rows: list[dict] = []

    def record(
        name: str, family: str, params: dict, build_s: float, ids: np.ndarray, search_s: float
    ) -> None:
        row = {
            "index": name,
            "family": family,
            "params": params,
            "build_s": round(build_s, 2),
            "qps": round(len(q) / search_s, 1),
            "recall_at_10": round(recall_at_k(ids, truth), 4),
        }
        row["speedup_vs_flat"] = round(row["qps"] / flat_qps, 2)
        rows.append(row)
        print(
            f"{name:24s} {strict_dumps(params):34s} build {row['build_s']:7.1f}s  "
            f"{row['qps']:9.1f} q/s  R@10 {row['recall_at_10']:.4f}  x{row['speedup_vs_flat']:.1f}",
            flush=True,
        )

    def build(
        factory: str, trained: FaissIndex | None = None
    ) -> tuple[FaissIndex, float, FaissIndex]:
        """Train (unless ``trained`` is given) and add all of x; returns an empty trained copy
        too."""
        t = time.perf_counter()
        index = (
            trained.empty_like()
            if trained is not None
            else FaissIndex(dim, factory, "ip").train(train)
        )
        empty = index.empty_like()
        index.add(x)
        return index, time.perf_counter() - t, empty

    # Flat: the exact answer (ground truth) and the speed every other index is compared with.
    t = time.perf_counter()
    flat = FaissIndex(dim, "Flat", "ip").add(x)
    flat_build = time.perf_counter() - t
    truth, flat_s = timed_search(flat, q, args.batch)
    flat_qps = len(q) / flat_s
    del flat
    gc.collect()
    record("Flat", "flat", {}, flat_build, truth, flat_s)

    ivf = f"IVF{nlist},Flat"
    if "ivf_flat" in families:
        index, build_s, _ = build(ivf)
        for nprobe in (1, 8, 16, 32, 64, 128):
            index.set_search_params(nprobe=nprobe)
            record(
                ivf, "ivf_flat", {"nprobe": nprobe}, build_s, *timed_search(index, q, args.batch)
            )
        del index
        gc.collect()

    if "ivf_hnsw" in families:
        name = f"IVF{nlist}_HNSW32,Flat"
        index, build_s, _ = build(name)
        for nprobe in (32, 64):
            index.set_search_params(nprobe=nprobe)
            record(
                name, "ivf_flat", {"nprobe": nprobe}, build_s, *timed_search(index, q, args.batch)
            )
        del index
        gc.collect()

    if "hnsw" in families:
        index, build_s, _ = build("HNSW32")
        for ef in (16, 32, 64, 128, 256):
            index.set_search_params(ef_search=ef)
            record(
                "HNSW32", "hnsw", {"ef_search": ef}, build_s, *timed_search(index, q, args.batch)
            )
        del index
        gc.collect()

    if "ivf_pq" in families and n < 256 * 39:
        print(
            f"skipping IVF-PQ: {n} vectors are too few to train 256-centroid PQ codebooks",
            flush=True,
        )
    elif "ivf_pq" in families:
        m = dim // 8  # 32 one-byte codes for 256-d: 32x smaller than the raw floats
        name = f"IVF{nlist},PQ{m}np"
        t = time.perf_counter()
        trained = FaissIndex(dim, name, "ip").train(train)
        train_s = time.perf_counter() - t
        index, add_s, _ = build(name, trained)
        for nprobe in (16, 64):
            index.set_search_params(nprobe=nprobe)
            record(
                name,
                "ivf_pq",
                {"nprobe": nprobe},
                train_s + add_s,
                *timed_search(index, q, args.batch),
            )
        del index
        gc.collect()
        # Re-ranking: the same trained IVF-PQ inside IndexRefineFlat, which keeps the raw vectors
        # and re-scores the k_factor*k PQ candidates exactly (factory suffix ",RFlat").
        t = time.perf_counter()
        refine = faiss.IndexRefineFlat(trained.empty_like().index)
        index = FaissIndex(dim, name + ",RFlat", "ip", _index=refine).add(x)
        build_s = train_s + time.perf_counter() - t
        for nprobe, k_factor in ((16, 4), (32, 4), (64, 4), (64, 8)):
            index.set_search_params(nprobe=nprobe, k_factor=k_factor)
            record(
                name + ",RFlat",
                "ivf_pq_refine",
                {"nprobe": nprobe, "k_factor": k_factor},
                build_s,
                *timed_search(index, q, args.batch),
            )
        del index
        gc.collect()

    # Flat again at the end (on a subset of the queries): on a shared machine the load drifts
    # during the run, and the two Flat figures bound how far the speed-ups can be trusted.
    flat = FaissIndex(dim, "Flat", "ip").add(x)
    sub = q[: max(1, len(q) // 4)]
    _, s_end = timed_search(flat, sub, args.batch)
    flat_qps_end = len(sub) / s_end
    del flat
    print(f"Flat again at the end: {flat_qps_end:.1f} q/s (start: {flat_qps:.1f})", flush=True)

    ivf1 = next(
        (
            r["recall_at_10"]
            for r in rows
            if r["family"] == "ivf_flat" and r["params"] == {"nprobe": 1}
        ),
        None,
    )
    if ivf1 is not None and ivf1 >= 1.0:
        print(
            "warning: IVF nprobe=1 already reaches recall 1; the data is too easy to rank indexes",
            flush=True,
        )
    chosen = default_factory(n, dim)
    report = {
        "benchmark": "retrieval index",
        "machine": {
            "cpus": os.cpu_count(),
            "faiss_threads": args.threads,
            "faiss": faiss.__version__,
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "data": {
            "n": n,
            "dim": dim,
            "nq": len(q),
            "batch": args.batch,
            "metric": "ip",
            "ivf_nprobe1_recall_at_10": ivf1,
            **source,
        },
        "default": {"factory": chosen, "search_params": default_search_params(chosen)},
        "flat_qps": round(flat_qps, 1),
        "flat_qps_end": round(flat_qps_end, 1),
        "results": rows,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_dumps(report, indent=2))
    print(
        f"default for {n} docs: {chosen} {default_search_params(chosen)}; wrote {args.out} "
        f"({report['total_s']}s)"
    )


if __name__ == "__main__":
    main()
