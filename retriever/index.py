"""A thin layer over faiss: build, search, save and load a document index, and swap it safely.

Three faces:

- ``FaissIndex``: one faiss index built from an ``index_factory`` string ("Flat", "IVF4096,Flat",
  "HNSW32", "IVF4096,PQ32,RFlat", ...) with metric "ip" or "l2", the document ids of its rows,
  search parameters (nprobe, efSearch, refine factor) and an ``IndexMetadata`` record that travels
  with it on disk. ``search`` takes numpy or torch queries and answers in kind.
- ``DocumentIndex``: the index that serves searches during training, with ``rebuild`` (one call,
  synchronous or in a background thread) that builds a new index from fresh embeddings while the
  old one keeps serving, then swaps it in atomically.
- ``default_factory`` / ``default_search_params``: what to build for a memory of a given size,
  chosen from ``scripts/bench/index.py`` (numbers in BENCHMARKS.md, "Retrieval index").

Score convention: higher is better for both metrics. "ip" returns inner products, "l2" returns
minus the squared L2 distance, so shards and callers merge and rank with one rule. Within a
result row, ties are broken by ascending document id; missing results (fewer than k documents)
have id -1 and score -inf.

File format (one file, so an index and its metadata can never be separated):

    b"RAGMMIDX" | u32 format version | u64 header length | header JSON (utf-8)
    | faiss bytes (faiss.serialize_index) | document ids (int64 LE, absent when ids are 0..N-1)
    | sha256 of everything before it (32 bytes)

The header holds ``IndexMetadata`` and the two payload lengths. ``load`` checks the length
(truncation), the checksum (bit flips), then the metadata against what the caller expects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from retriever.errors import CorruptIndexError, IndexMismatchError

log = logging.getLogger(__name__)

METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
MAGIC = b"RAGMMIDX"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, format version, header length
_DIGEST_BYTES = 32  # sha256

# Our names for search parameters -> faiss ParameterSpace names.
_PARAM_NAMES = {"nprobe": "nprobe", "ef_search": "efSearch", "k_factor": "k_factor_rf"}


# ---------------------------------------------------------------------------------------------
# Choosing an index
# ---------------------------------------------------------------------------------------------

# Below this many documents exact search is the default: Flat needs no training, loses nothing,
# and costs 2*N*d FLOPs per query -- 51 MFLOP at 100k x 256, ~4,000 queries/s on this machine's
# 2 idle cores (it answers ~370 q/s at 1M) -- more than a training step asks for. Above it, the
# approximate index pays for itself.
FLAT_MAX_DOCS = 100_000
# IVF lists: faiss's guideline is K ~ 4..16 * sqrt(N); 4*sqrt(N) rounded to a power of two gives
# 4096 lists of ~250 vectors at 1M. k-means wants >= 39 training points per list (faiss warns
# below), so nlist is capped by N/39.
# Fraction of the lists probed by default. 1M x 256 benchmark (BENCHMARKS.md, "Retrieval index"):
# IVF4096,Flat reached recall@10 0.994 / 0.998 / 0.9994 at nprobe 8 / 32 / 64, i.e. 128x / 43x /
# 23x Flat's queries/s (a repeat run: 295x / 64x / 36x). We take nprobe = nlist/128 (32 at 1M):
# recall stays far above 0.95, and it scans ~12k vectors per query (32 lists of ~244 plus 4096
# centroids), 84x fewer dot products than Flat, so it keeps > 10x even on an idle machine where
# Flat's BLAS runs at full speed (the benchmark machine was loaded). Memories whose clusters
# overlap more need more probes (at 100k, ~50 vectors per cluster, the same generator needed
# 1/32 of the lists for 0.96): measure yours with `scripts/bench/index.py --embeddings`. HNSW32
# was slower at equal recall (0.973 at 54x, 0.987 at 35x), took 3.3x longer to build (318 s vs
# 97 s), has no GPU version and is rebuilt from scratch on refresh, whereas IVF keeps its
# centroids (DocumentIndex.rebuild(retrain=False)). So IVF-Flat is the default above Flat.
NPROBE_FRACTION = 1 / 128
# Above this many documents the coarse quantizer itself (nlist x d) becomes slow to scan, so it is
# replaced by an HNSW graph over the centroids (faiss "IVFx_HNSW32" tier for 1M-10M+).
HNSW_QUANTIZER_MIN_DOCS = 2_000_000


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


# ---------------------------------------------------------------------------------------------
# Metadata and hashing
# ---------------------------------------------------------------------------------------------


@dataclass
class IndexMetadata:
    """What an index was built from; saved in the file header and checked on load."""

    dim: int  # embedding width; queries must match it
    metric: str  # "ip" or "l2"
    factory: str  # faiss index_factory string
    num_docs: int = 0  # vectors in the index
    encoder_hash: str = ""  # fingerprint of the document-encoder checkpoint that made the vectors
    corpus_hash: str = ""  # fingerprint of the documents (and their order, which fixes the ids)
    search_params: dict = field(default_factory=dict)  # nprobe / ef_search / k_factor in force
    faiss_version: str = faiss.__version__  # the faiss that wrote the file
    created: str = ""  # UTC time of save, ISO 8601
    format_version: int = FORMAT_VERSION  # layout of the file


def fingerprint(*parts: Any) -> str:
    """A sha256 hex digest of strings, bytes, numpy arrays, torch tensors or state dicts.

    Use it for ``encoder_hash`` (pass the encoder's ``state_dict()``) and ``corpus_hash`` (pass
    the document keys in memory order). Tensors are hashed by dtype, shape and bytes.
    """
    h = hashlib.sha256()

    def feed(p: Any) -> None:
        if isinstance(p, dict):
            for k in sorted(p):
                feed(str(k))
                feed(p[k])
        elif isinstance(p, (list, tuple)):
            for q in p:
                feed(q)
        elif isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-d tensors too
        elif isinstance(p, np.ndarray):
            h.update(f"{p.dtype}{p.shape}".encode())
            h.update(np.ascontiguousarray(p).tobytes())
        elif isinstance(p, (bytes, bytearray, memoryview)):
            h.update(bytes(p))
        else:
            h.update(str(p).encode())
        h.update(b"\x00")

    for p in parts:
        feed(p)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# GPU gate
# ---------------------------------------------------------------------------------------------

_logged_reasons: set[str] = set()
_gpu_resources = None


def _log_once(msg: str) -> None:
    if msg not in _logged_reasons:
        _logged_reasons.add(msg)
        log.info(msg)


def gpu_unavailable_reason(factory: str = "") -> str | None:
    """Why this index cannot move to a GPU, or None when it can."""
    if not hasattr(faiss, "StandardGpuResources"):
        return "faiss was built without GPU support (faiss-cpu); install the faiss-gpu wheel"
    if faiss.get_num_gpus() == 0:
        return "faiss sees no GPU (faiss.get_num_gpus() == 0)"
    if "HNSW" in factory.split(",")[0] and not factory.startswith("IVF"):
        return f"faiss has no GPU version of {factory!r} (HNSW graphs search on the CPU)"
    return None


# ---------------------------------------------------------------------------------------------
# One index
# ---------------------------------------------------------------------------------------------


def _as_f32(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-d (n, dim) array, got shape {x.shape}")
    return x


class FaissIndex:
    """One faiss index, the document ids of its rows, and its metadata."""

    def __init__(
        self,
        dim: int,
        factory: str = "Flat",
        metric: str = "ip",
        *,
        search_params: dict | None = None,
        encoder_hash: str = "",
        corpus_hash: str = "",
        _index: faiss.Index | None = None,
    ):
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
        self.meta = IndexMetadata(
            dim=dim,
            metric=metric,
            factory=factory,
            encoder_hash=encoder_hash,
            corpus_hash=corpus_hash,
        )
        self.index = (
            _index if _index is not None else faiss.index_factory(dim, factory, METRICS[metric])
        )
        self._ids: np.ndarray | None = None  # (ntotal,) int64 row -> doc id; None means row == id
        self.on_gpu = False
        self.set_search_params(**{**default_search_params(factory), **(search_params or {})})

    # -- properties --------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.meta.dim

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self.index.is_trained)

    def __repr__(self) -> str:
        where = "gpu" if self.on_gpu else "cpu"
        return f"FaissIndex({self.meta.factory!r}, dim={self.dim}, metric={self.meta.metric!r}, ntotal={self.ntotal}, {where}, {self.meta.search_params})"

    # -- build -------------------------------------------------------------------------------

    def train(self, x: Any, max_points: int | None = None, seed: int = 0) -> FaissIndex:
        """Train the quantizers (k-means / PQ codebooks) on ``x``; a no-op for Flat and HNSW.

        ``max_points`` trains on a fixed random subset (k-means cost grows with the sample).
        """
        if self.is_trained:
            return self
        x = _as_f32(x)
        self._check_dim(x)
        if max_points is not None and len(x) > max_points:
            x = x[np.sort(np.random.default_rng(seed).choice(len(x), max_points, replace=False))]
        t = time.perf_counter()
        self.index.train(x)
        log.info(
            "trained %s on %d vectors in %.1fs", self.meta.factory, len(x), time.perf_counter() - t
        )
        return self

    def add(self, x: Any, ids: Any = None) -> FaissIndex:
        """Append vectors; ``ids`` are their document ids (default: the next row numbers)."""
        if not self.is_trained:
            raise RuntimeError(
                f"index {self.meta.factory!r} must be trained before add(); call train() first"
            )
        x = _as_f32(x)
        self._check_dim(x)
        n0 = self.ntotal
        if ids is not None:
            ids = np.asarray(
                ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64
            ).reshape(-1)
            if len(ids) != len(x):
                raise ValueError(f"got {len(x)} vectors but {len(ids)} ids")
            if len(ids) and ids.min() < 0:
                raise ValueError("document ids must be >= 0 (-1 marks a missing result)")
        if (
            ids is not None
            and self._ids is None
            and not np.array_equal(ids, np.arange(n0, n0 + len(x)))
        ):
            self._ids = np.arange(n0, dtype=np.int64)
        if self._ids is not None:
            new = ids if ids is not None else np.arange(n0, n0 + len(x), dtype=np.int64)
            self._ids = np.concatenate([self._ids, new])
        self.index.add(x)
        self.meta.num_docs = self.ntotal
        return self

    def reset(self) -> FaissIndex:
        """Drop every vector but keep what training learned (IVF centroids, PQ codebooks)."""
        self.index.reset()
        self._ids = None
        self.meta.num_docs = 0
        return self

    def empty_like(self) -> FaissIndex:
        """A new index with the same trained quantizers and settings, holding no vectors.

        Refreshing with it skips k-means: Atlas's ``reset()`` + ``add()`` pattern, minus the
        retraining. Good while the embedding distribution drifts slowly.
        """
        cpu = faiss.index_gpu_to_cpu(self.index) if self.on_gpu else self.index
        clone = faiss.clone_index(cpu)
        clone.reset()
        out = FaissIndex(
            self.dim,
            self.meta.factory,
            self.meta.metric,
            search_params=self.meta.search_params,
            _index=clone,
        )
        return out

    # -- search ------------------------------------------------------------------------------

    def set_search_params(
        self, nprobe: int | None = None, ef_search: int | None = None, k_factor: int | None = None
    ) -> FaissIndex:
        """Set IVF ``nprobe``, HNSW ``ef_search``, or the re-ranking ``k_factor`` of ",RFlat"."""
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        for name, value in (("nprobe", nprobe), ("ef_search", ef_search), ("k_factor", k_factor)):
            if value is None:
                continue
            try:
                space.set_index_parameter(self.index, _PARAM_NAMES[name], float(value))
            except RuntimeError as e:
                raise ValueError(f"{name} does not apply to index {self.meta.factory!r}") from e
            self.meta.search_params[name] = int(value)
        return self

    def search(self, queries: Any, k: int) -> tuple[Any, Any]:
        """Top-``k`` documents per query: ``(scores, ids)``, each (nq, k), best first.

        Torch queries give torch results on the queries' device; numpy gives numpy.
        """
        q = _as_f32(queries)
        self._check_dim(q)
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        # One extra result shows whether the k-th place is tied; faiss keeps an arbitrary one of
        # equal scores there, so tied rows are searched wider and the lowest ids kept. That makes
        # results deterministic and lets shards merge to exactly one index's answer.
        scores, ids = self._search_ids(q, k + 1)
        tied = np.flatnonzero((ids[:, k] >= 0) & (scores[:, k] == scores[:, k - 1]))
        scores, ids = sort_rows(scores, ids, k)
        width = k + 1
        while len(tied) and width < self.ntotal:
            width = min(2 * width, self.ntotal)
            s_w, i_w = self._search_ids(q[tied], width)
            scores[tied], ids[tied] = sort_rows(s_w, i_w, k)
            tied = tied[(i_w[:, -1] >= 0) & (s_w[:, -1] == scores[tied, k - 1])]
        if isinstance(queries, torch.Tensor):
            dev = queries.device
            return torch.from_numpy(scores).to(dev), torch.from_numpy(ids).to(dev)
        return scores, ids

    def _search_ids(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss search mapped to our conventions, sorted: (scores, doc ids), each (nq, k)."""
        dist, rows = self.index.search(q, k)  # (nq, k) each
        scores = -dist if self.meta.metric == "l2" else dist
        missing = rows < 0
        scores[missing] = -np.inf
        ids = (
            rows if self._ids is None else np.where(missing, -1, self._ids[np.clip(rows, 0, None)])
        )
        return sort_rows(scores, ids)

    # -- devices -----------------------------------------------------------------------------

    def to_gpu(self, device: int = 0) -> FaissIndex:
        """Move the index to GPU ``device`` when faiss can; otherwise log why and stay on CPU."""
        if self.on_gpu:
            return self
        reason = gpu_unavailable_reason(self.meta.factory)
        if reason is None:
            global _gpu_resources
            try:
                if _gpu_resources is None:
                    _gpu_resources = faiss.StandardGpuResources()
                gpu = faiss.index_cpu_to_gpu(_gpu_resources, device, self.index)
            except RuntimeError as e:  # e.g. a refine wrapper or PQ size faiss-gpu lacks
                reason = (
                    f"faiss could not move {self.meta.factory!r} to GPU: {str(e).splitlines()[0]}"
                )
            else:
                self.index, self.on_gpu = gpu, True
                self.set_search_params(**self.meta.search_params)
                return self
        _log_once(f"index {self.meta.factory!r} stays on CPU: {reason}")
        return self

    def to_cpu(self) -> FaissIndex:
        if self.on_gpu:
            self.index, self.on_gpu = faiss.index_gpu_to_cpu(self.index), False
            self.set_search_params(**self.meta.search_params)
        return self

    # -- save / load -------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write header + faiss bytes + ids + sha256 to ``path`` atomically (temp file + rename)."""
        path = Path(path)
        cpu = faiss.index_gpu_to_cpu(self.index) if self.on_gpu else self.index
        blob = faiss.serialize_index(cpu)  # (nbytes,) uint8
        ids = b"" if self._ids is None else self._ids.astype("<i8").tobytes()
        self.meta.num_docs = self.ntotal
        self.meta.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        header = json.dumps(
            {
                "metadata": dataclasses.asdict(self.meta),
                "faiss_bytes": int(blob.nbytes),
                "ids_bytes": len(ids),
            },
            sort_keys=True,
        ).encode()
        h = hashlib.sha256()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            for part in (
                _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)),
                header,
                memoryview(blob),
                ids,
            ):
                h.update(part)
                f.write(part)
            f.write(h.digest())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        dim: int | None = None,
        metric: str | None = None,
        factory: str | None = None,
        encoder_hash: str | None = None,
        corpus_hash: str | None = None,
        num_docs: int | None = None,
    ) -> FaissIndex:
        """Read an index written by ``save``; every keyword given must match the saved metadata.

        Raises ``CorruptIndexError`` for a truncated, altered or foreign file and
        ``IndexMismatchError`` (listing each field, expected vs found) for a stale one.
        """
        path = Path(path)
        data, meta, header_end, faiss_n, ids_n = _read_verified(path)
        expected = {
            "dim": dim,
            "metric": metric,
            "factory": factory,
            "encoder_hash": encoder_hash,
            "corpus_hash": corpus_hash,
            "num_docs": num_docs,
        }
        check_metadata(meta, path, **expected)
        if meta.faiss_version != faiss.__version__:
            _log_once(
                f"index {path} was written by faiss {meta.faiss_version}; reading with {faiss.__version__}"
            )
        buf = np.frombuffer(data, dtype=np.uint8, count=faiss_n, offset=header_end)
        try:
            index = faiss.deserialize_index(buf)
        except RuntimeError as e:
            raise CorruptIndexError(
                f"{path}: faiss could not read the index payload: {str(e).splitlines()[0]}"
            ) from e
        if (
            index.d != meta.dim
            or index.ntotal != meta.num_docs
            or index.metric_type != METRICS[meta.metric]
        ):
            raise CorruptIndexError(
                f"{path}: header says dim={meta.dim}, num_docs={meta.num_docs}, metric={meta.metric!r} "
                f"but the faiss payload holds dim={index.d}, ntotal={index.ntotal}, metric_type={index.metric_type}"
            )
        out = cls(
            meta.dim, meta.factory, meta.metric, search_params=meta.search_params, _index=index
        )
        out.meta = meta
        if ids_n:
            out._ids = np.frombuffer(
                data, dtype="<i8", count=ids_n // 8, offset=header_end + faiss_n
            ).astype(np.int64)
        return out

    def _check_dim(self, x: np.ndarray) -> None:
        if x.shape[1] != self.dim:
            raise ValueError(
                f"index {self.meta.factory!r} holds {self.dim}-d vectors, got {x.shape[1]}-d input"
            )


def sort_rows(
    scores: np.ndarray, ids: np.ndarray, k: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Order each row by score descending, then id ascending (missing -1 / -inf last); keep k."""
    # np.lexsort sorts by the last key first: score descending, then id ascending for ties.
    order = np.lexsort((ids, -scores), axis=-1)[:, :k]
    return np.take_along_axis(scores, order, -1), np.take_along_axis(ids, order, -1)


def build_index(
    x: Any,
    ids: Any = None,
    *,
    factory: str | None = None,
    metric: str = "ip",
    search_params: dict | None = None,
    train_size: int | None = None,
    encoder_hash: str = "",
    corpus_hash: str = "",
    like: FaissIndex | None = None,
) -> FaissIndex:
    """Train and fill a new index from embeddings ``x`` (n, dim) in one call.

    ``factory`` defaults to ``default_factory(n, dim)``. With ``like``, reuse that index's trained
    quantizers and settings instead of training (see ``FaissIndex.empty_like``).
    """
    x = _as_f32(x)
    if like is not None:
        index = like.empty_like()
        if search_params:
            index.set_search_params(**search_params)
    else:
        factory = factory or default_factory(len(x), x.shape[1])
        index = FaissIndex(x.shape[1], factory, metric, search_params=search_params)
        index.train(x, max_points=train_size)
    index.meta.encoder_hash, index.meta.corpus_hash = encoder_hash, corpus_hash
    return index.add(x, ids)


# ---------------------------------------------------------------------------------------------
# File checks
# ---------------------------------------------------------------------------------------------


def _parse_prefix(path: Path, head: bytes, size: int) -> tuple[dict, int]:
    if len(head) < _PREFIX.size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes, too short to be a rag_mm index (truncated?)"
        )
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptIndexError(
            f"{path}: not a rag_mm index file (starts with {magic!r}, expected {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise CorruptIndexError(
            f"{path}: index format version {version}, this code reads version {FORMAT_VERSION}"
        )
    header_end = _PREFIX.size + header_len
    if header_end + _DIGEST_BYTES > size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes but its header alone claims {header_end} (truncated?)"
        )
    try:
        header = json.loads(head[_PREFIX.size : header_end].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptIndexError(
            f"{path}: index header is not valid JSON ({e}); the file is damaged"
        ) from e
    return header, header_end


def _metadata_from(path: Path, header: dict) -> IndexMetadata:
    try:
        known = {f.name for f in dataclasses.fields(IndexMetadata)}
        return IndexMetadata(**{k: v for k, v in header["metadata"].items() if k in known})
    except (KeyError, TypeError) as e:
        raise CorruptIndexError(f"{path}: index header lacks metadata ({e})") from e


def read_metadata(path: str | os.PathLike) -> IndexMetadata:
    """The metadata of a saved index, reading only the header (``load`` verifies the checksum)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        if len(head) == _PREFIX.size:
            head += f.read(_PREFIX.unpack_from(head)[2])
    header, _ = _parse_prefix(path, head, size)
    return _metadata_from(path, header)


def _read_verified(path: Path) -> tuple[bytes, IndexMetadata, int, int, int]:
    data = path.read_bytes()
    size = len(data)
    header, header_end = _parse_prefix(path, data, size)
    try:
        faiss_n, ids_n = int(header["faiss_bytes"]), int(header["ids_bytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptIndexError(f"{path}: index header lacks payload sizes ({e})") from e
    expected_size = header_end + faiss_n + ids_n + _DIGEST_BYTES
    if size != expected_size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes, its header says {expected_size} (truncated or appended to)"
        )
    body = memoryview(data)[: size - _DIGEST_BYTES]
    if hashlib.sha256(body).digest() != data[size - _DIGEST_BYTES :]:
        raise CorruptIndexError(
            f"{path}: sha256 checksum mismatch; the file was altered or damaged after it was written"
        )
    return data, _metadata_from(path, header), header_end, faiss_n, ids_n


def check_metadata(
    meta: IndexMetadata, path: str | os.PathLike = "<index>", **expected: Any
) -> None:
    """Raise ``IndexMismatchError`` naming each field whose expected value (not None) differs."""
    bad = {
        k: (v, getattr(meta, k))
        for k, v in expected.items()
        if v is not None and getattr(meta, k) != v
    }
    if bad:
        raise IndexMismatchError(str(path), bad)


# ---------------------------------------------------------------------------------------------
# The serving holder
# ---------------------------------------------------------------------------------------------


class DocumentIndex:
    """The index that answers searches, replaced atomically by ``rebuild``.

    Searches read ``self.current`` once (one attribute read, atomic in CPython), so a search that
    started on the old index finishes on it while the new one is swapped in. Rebuilds run one at a
    time, on a single background thread when ``background=True``; faiss releases the GIL while it
    trains, adds and searches, so serving continues at full speed on the other core(s).
    """

    def __init__(self, index: FaissIndex | None = None):
        self._current = index
        self._swap_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.version = 0 if index is None else 1  # bumps on every swap

    @property
    def current(self) -> FaissIndex:
        index = self._current
        if index is None:
            raise RuntimeError("DocumentIndex is empty: call rebuild() or swap() first")
        return index

    def search(self, queries: Any, k: int) -> tuple[Any, Any]:
        return self.current.search(queries, k)

    def swap(self, index: FaissIndex) -> FaissIndex | None:
        """Serve ``index`` from now on; returns the one it replaced."""
        with self._swap_lock:
            old, self._current = self._current, index
            self.version += 1
        return old

    def rebuild(
        self,
        embeddings: Any,
        ids: Any = None,
        *,
        background: bool = False,
        retrain: bool = True,
        **build_kwargs: Any,
    ) -> FaissIndex | Future:
        """Build an index from fresh ``embeddings`` and swap it in: one call.

        ``retrain=False`` reuses the current index's trained quantizers (no k-means). Other keywords
        go to ``build_index`` (factory, metric, train_size, encoder_hash, corpus_hash, ...); by
        default the current index's factory, metric and search params carry over. With
        ``background=True`` returns a ``Future`` of the new index; the caller must not modify
        ``embeddings`` until it completes.
        """
        old = self._current
        if old is not None:
            build_kwargs.setdefault("factory", old.meta.factory)
            build_kwargs.setdefault("metric", old.meta.metric)
            build_kwargs.setdefault("search_params", dict(old.meta.search_params))
            if not retrain:
                build_kwargs["like"] = old

        def job() -> FaissIndex:
            t = time.perf_counter()
            new = build_index(embeddings, ids, **build_kwargs)
            self.swap(new)
            log.info("rebuilt %r in %.1fs (version %d)", new, time.perf_counter() - t, self.version)
            return new

        if not background:
            return job()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-rebuild")
        return self._pool.submit(job)

    def close(self) -> None:
        """Wait for a pending background rebuild and stop its thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
