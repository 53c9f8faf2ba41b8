"""The index that serves searches during training, rebuilt from fresh embeddings and swapped in.

``DocumentIndex.rebuild`` is the one place an index is rebuilt, synchronously or on a single
background thread: it builds a new index (``retriever.index.build_index``) while the old one keeps
serving, then swaps it in atomically. ``retriever.memory.RetrievalMemory.refresh`` rebuilds
through it, handing it a function that embeds the memory so the embedding runs on the background
thread too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from retriever.index import FaissIndex, build_index

log = logging.getLogger(__name__)


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
        self._pending: Future | None = None  # the last background rebuild
        self.version = 0 if index is None else 1  # bumps on every swap

    @property
    def current(self) -> FaissIndex:
        index = self._current
        if index is None:
            raise RuntimeError("DocumentIndex is empty: call rebuild() or swap() first")
        return index

    @property
    def rebuilding(self) -> bool:
        """Whether a background rebuild is still running."""
        return self._pending is not None and not self._pending.done()

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
        on_swap: Callable[[FaissIndex, Any], None] | None = None,
        build: Callable[[Any, Any], Any] | None = None,
        **build_kwargs: Any,
    ) -> FaissIndex | Future:
        """Build an index from fresh ``embeddings`` and swap it in: one call.

        ``embeddings`` is an (n, dim) array or tensor, or a function that returns one; it is called
        on the rebuilding thread, so a background rebuild embeds there too. ``on_swap(new_index,
        embeddings)`` runs on that thread right after the swap. ``retrain=False`` reuses the
        current index's trained quantizers (no k-means). Other keywords go to ``build_index``
        (factory, metric, train_size, encoder_hash, corpus_hash, ...); by default the current
        index's factory, metric and search params carry over. ``build(embeddings, ids)`` makes
        the index instead of ``build_index`` (``retriever.exact.TorchFlatIndex``: anything with a
        ``search``); the keywords are then unused. With ``background=True`` returns a ``Future``
        of the new index; the caller must not modify ``embeddings`` until it completes.
        """
        old = self._current
        if old is not None and build is None:
            build_kwargs.setdefault("factory", old.meta.factory)
            build_kwargs.setdefault("metric", old.meta.metric)
            build_kwargs.setdefault("search_params", dict(old.meta.search_params))
            if not retrain:
                build_kwargs["like"] = old

        def job() -> FaissIndex:
            t = time.perf_counter()
            x = embeddings() if callable(embeddings) else embeddings
            new = build(x, ids) if build is not None else build_index(x, ids, **build_kwargs)
            self.swap(new)
            log.info("rebuilt %r in %.1fs (version %d)", new, time.perf_counter() - t, self.version)
            if on_swap is not None:
                on_swap(new, x)
            return new

        if not background:
            return job()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-rebuild")
        self._pending = self._pool.submit(job)
        return self._pending

    def wait(self) -> None:
        """Wait for the last background rebuild; raises what it raised."""
        if self._pending is not None:
            self._pending.result()

    def close(self) -> None:
        """Wait for a pending background rebuild and stop its thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
