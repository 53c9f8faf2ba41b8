"""Which faiss index to build for a memory of a given size, and the search parameters that go with
it.

``default_factory`` picks the ``index_factory`` string and ``default_search_params`` its nprobe /
efSearch / re-ranking factor. The thresholds come from ``scripts/bench/index.py`` (figures in
benchmarks/index_cpu_2026-11-21.md).
"""

from __future__ import annotations

import math
import re

# Below this many documents exact search is the default: Flat needs no training, loses nothing,
# and costs 2*N*d FLOPs per query (51 MFLOP at 100k x 256), which a CPU answers faster than a
# training step asks. Above it, the approximate index pays for itself.
FLAT_MAX_DOCS = 100_000
# Fraction of the lists probed by default: nprobe = nlist/128 (32 at 1M) scans ~12k vectors per
# query (32 lists of ~244 plus 4096 centroids), 84x fewer dot products than Flat, at a recall@10
# far above 0.95 on the 1M x 256 benchmark. Memories whose clusters overlap more need more probes:
# measure yours with `scripts/bench/index.py --embeddings`. IVF-Flat rather than HNSW above Flat:
# HNSW has no GPU version and is rebuilt from scratch on refresh, where IVF keeps its centroids
# (DocumentIndex.rebuild(retrain=False)); it was also slower at equal recall on the benchmark.
NPROBE_FRACTION = 1 / 128
# Above this many documents the coarse quantizer itself (nlist x d) becomes slow to scan, so it is
# replaced by an HNSW graph over the centroids (faiss "IVFx_HNSW32" tier for 1M-10M+).
HNSW_QUANTIZER_MIN_DOCS = 2_000_000


# IVF lists: faiss's guideline is K ~ 4..16 * sqrt(N); 4*sqrt(N) rounded to a power of two gives
# 4096 lists of ~250 vectors at 1M. k-means wants >= 39 training points per list (faiss warns
# below), so nlist is capped by N/39.
def ivf_nlist(num_docs: int) -> int:
    """IVF list count for a memory: 4·sqrt(N) as a power of two, capped by N/39 and 2^18."""
    nlist = 2 ** round(math.log2(4 * math.sqrt(num_docs)))
    return int(max(16, min(nlist, 2 ** int(math.log2(max(num_docs // 39, 16))), 2**18)))


def default_factory(num_docs: int, dim: int, memory_budget_bytes: int | None = None) -> str:
    """The factory string to build for ``num_docs`` vectors of ``dim`` floats.

    Flat (exact) for small memories; IVF-Flat beyond ``FLAT_MAX_DOCS`` (recall@10 >= 0.95 at
    >= 10x Flat's speed on the 1M benchmark); an HNSW coarse quantizer from 2M documents. When the
    raw vectors (4 * dim bytes each) would not fit ``memory_budget_bytes``, IVF-PQ with
    dim/8 one-byte codes (32x smaller) -- at a large recall cost (0.57 recall@10 on the 1M
    benchmark; re-ranking with ",RFlat" recovers it but keeps the raw vectors).
    """
    if num_docs <= FLAT_MAX_DOCS and (
        memory_budget_bytes is None or 4 * dim * num_docs <= memory_budget_bytes
    ):
        return "Flat"
    nlist = ivf_nlist(num_docs)
    coarse = f"IVF{nlist}_HNSW32" if num_docs >= HNSW_QUANTIZER_MIN_DOCS else f"IVF{nlist}"
    if memory_budget_bytes is not None and 4 * dim * num_docs > memory_budget_bytes:
        m = max(1, dim // 8)
        while dim % m:  # PQ needs m to divide dim
            m -= 1
        # "np": no polysemous training, which costs ~20 s per 8 sub-quantizers and only helps
        # polysemous (Hamming-filtered) search, which this layer does not use.
        return f"{coarse},PQ{m}np"
    return f"{coarse},Flat"


def default_search_params(factory: str) -> dict[str, int]:
    """Search parameters that go with ``factory`` when the caller gives none."""
    params: dict[str, int] = {}
    ivf = re.search(r"IVF(\d+)", factory)
    if ivf:
        nlist = int(ivf.group(1))
        # At least 8 probes: with few lists a fixed fraction would probe only one or two.
        params["nprobe"] = min(nlist, max(8, round(nlist * NPROBE_FRACTION)))
    elif re.match(r"^(IDMap2?,)?HNSW", factory):
        # efSearch 128: HNSW32 reached recall@10 0.987 at 35x Flat's q/s on the 1M benchmark.
        params["ef_search"] = 128
    if "RFlat" in factory or factory.startswith("Refine"):
        # Re-rank 8k candidates exactly: on the 1M benchmark IVF4096,PQ32 + RFlat reached recall@10
        # 0.945 with k_factor 4 (the PQ shortlist misses neighbours) and 0.989 with 8.
        params["k_factor"] = 8
    return params
