"""A thin layer over faiss: build, search, save and load one document index.

``FaissIndex`` is one faiss index built from an ``index_factory`` string ("Flat", "IVF4096,Flat",
"HNSW32", "IVF4096,PQ32,RFlat", ...) with metric "ip" or "l2", the document ids of its rows,
search parameters (nprobe, efSearch, refine factor) and an ``IndexMetadata`` record that travels
with it on disk. ``search`` takes numpy or torch queries and answers in kind; ``to_gpu`` moves it
to a GPU when the gate ``gpu_unavailable_reason`` allows, and logs once why not otherwise.
``build_index`` trains and fills one in a single call.

Around it, one concern per file:

- retriever/index_choice.py: what to build for a memory of a given size (``default_factory``,
  ``default_search_params``);
- retriever/index_io.py: the file format, its metadata and the hashes it carries (``save`` and
  ``load`` write and read through it);
- retriever/serve.py: ``DocumentIndex``, the index that serves searches while a new one is built.

The functions and records callers use from the first two are importable from here too;
``DocumentIndex`` is imported from retriever.serve, which builds on this module.

Score convention: higher is better for both metrics. "ip" returns inner products, "l2" returns
minus the squared L2 distance, so shards and callers merge and rank with one rule. Within a
result row, ties are broken by ascending document id; missing results (fewer than k documents)
have id -1 and score -inf.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from retriever.errors import CorruptIndexError
from retriever.index_choice import default_factory, default_search_params, ivf_nlist
from retriever.index_io import (
    IndexMetadata,
    check_metadata,
    fingerprint,
    read_index_file,
    read_metadata,
    write_index_file,
)

__all__ = [  # with the names callers take from index_choice.py and index_io.py
    "METRICS",
    "FaissIndex",
    "IndexMetadata",
    "build_index",
    "check_metadata",
    "default_factory",
    "default_search_params",
    "fingerprint",
    "gpu_unavailable_reason",
    "ivf_nlist",
    "read_metadata",
    "sort_rows",
]

log = logging.getLogger(__name__)

METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}

# Our names for search parameters -> faiss ParameterSpace names.
_PARAM_NAMES = {"nprobe": "nprobe", "ef_search": "efSearch", "k_factor": "k_factor_rf"}


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
        return (
            f"FaissIndex({self.meta.factory!r}, dim={self.dim}, metric={self.meta.metric!r}, "
            f"ntotal={self.ntotal}, {where}, {self.meta.search_params})"
        )

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

    def empty_like(self) -> FaissIndex:
        """A new index with the same trained quantizers and settings, holding no vectors.

        Refreshing with it skips k-means: Atlas's reset-then-add pattern, minus the
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

    # -- save / load -------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the index, its ids and metadata to one checksummed file (retriever/index_io.py)."""
        cpu = faiss.index_gpu_to_cpu(self.index) if self.on_gpu else self.index
        blob = faiss.serialize_index(cpu)  # (nbytes,) uint8
        ids = b"" if self._ids is None else self._ids.astype("<i8").tobytes()
        self.meta.num_docs = self.ntotal
        self.meta.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return write_index_file(Path(path), self.meta, blob, ids)

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
        meta, blob, ids = read_index_file(path)
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
                f"index {path} was written by faiss {meta.faiss_version}; reading with "
                f"{faiss.__version__}"
            )
        try:
            index = faiss.deserialize_index(blob)
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
                f"{path}: header says dim={meta.dim}, num_docs={meta.num_docs}, "
                f"metric={meta.metric!r} but the faiss payload holds dim={index.d}, "
                f"ntotal={index.ntotal}, metric_type={index.metric_type}"
            )
        out = cls(
            meta.dim, meta.factory, meta.metric, search_params=meta.search_params, _index=index
        )
        out.meta = meta
        out._ids = ids
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
