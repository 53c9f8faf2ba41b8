"""The document memory's embeddings and their faiss index, refreshed as the encoder trains.

``refresh`` re-embeds every document with the current document encoder and swaps a new index in
(``retriever.index.DocumentIndex``). Synchronous refresh splits the embedding across ranks (each
rank embeds 1/W of the documents, then all-gather), as Atlas does; background refresh embeds a
frozen copy of the encoder on a worker thread while training goes on with the old index, the way
REALM's asynchronous index builder works.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from retriever.encoders import DualEncoder
from retriever.index import DocumentIndex, build_index, default_factory

log = logging.getLogger(__name__)


class RetrievalMemory:
    def __init__(self, encoder, images: torch.Tensor, text_ids: torch.Tensor, text_len: torch.Tensor,
                 doc_ids: torch.Tensor, *, factory: str = "Flat", batch_size: int = 256, device=None,
                 corpus_hash: str = "") -> None:
        self.encoder = encoder  # DualEncoder; only .embed_docs is used
        self.images, self.text_ids, self.text_len = images, text_ids, text_len  # (N, ...) on the host
        self.doc_ids = doc_ids.numpy().astype(np.int64)  # (N,) ids returned by searches
        self.factory = factory
        self.batch_size = batch_size
        self.device = device or torch.device("cpu")
        self.corpus_hash = corpus_hash
        self.index = DocumentIndex()
        self.refresh_seconds: list[float] = []  # wall time of each refresh (embedding + index build)
        self.embeddings: torch.Tensor | None = None  # (N, E) of the last refresh: the negatives bank
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def built(self) -> bool:
        """Whether an index has been built yet (the first refresh always runs synchronously)."""
        return self.index._current is not None

    # ------------------------------------------------------------------------------ embedding
    @torch.no_grad()
    def embed(self, encoder=None, rows: range | None = None) -> torch.Tensor:
        """Embeddings (n, E) of ``rows`` (default all) with ``encoder`` (default the live one)."""
        enc = encoder or self.encoder
        rows = rows if rows is not None else range(len(self))
        out = [torch.zeros(0, self._dim())]
        for s in range(rows.start, rows.stop, self.batch_size):
            idx = slice(s, min(rows.stop, s + self.batch_size))
            out.append(enc.embed_docs(self.images[idx].to(self.device), self.text_ids[idx].to(self.device),
                                      self.text_len[idx].to(self.device)).float().cpu())
        return torch.cat(out)

    def _embed_sharded(self) -> torch.Tensor:
        """Each rank embeds a contiguous 1/W of the memory; all-gather assembles the whole."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.embed()
        W, r, N = dist.get_world_size(), dist.get_rank(), len(self)
        per = -(-N // W)
        mine = self.embed(rows=range(min(N, r * per), min(N, (r + 1) * per)))
        buf = torch.zeros(per, self._dim())
        buf[: len(mine)] = mine
        parts = [torch.zeros_like(buf) for _ in range(W)]
        dist.all_gather(parts, buf)
        return torch.cat(parts)[:N]

    def _dim(self) -> int:
        return int(self.encoder.cfg.embed_dim)

    def _build(self, emb: torch.Tensor, encoder_hash: str):
        factory = default_factory(len(emb), emb.shape[1]) if self.factory == "auto" else self.factory
        return build_index(emb.numpy(), self.doc_ids, factory=factory, metric="ip",
                           encoder_hash=encoder_hash, corpus_hash=self.corpus_hash)

    # ------------------------------------------------------------------------------ refresh
    def refresh(self, background: bool = False, step: int = 0) -> None:
        """Re-embed the memory and swap the new index in (now, or when the worker finishes)."""
        if not background or not self.built:
            t = time.perf_counter()
            emb = self._embed_sharded()
            self.index.swap(self._build(emb, f"step{step}"))
            self.embeddings = emb
            self.refresh_seconds.append(time.perf_counter() - t)
            return
        if self._pending is not None and not self._pending.done():
            log.info("index refresh at step %d skipped: the previous one is still running", step)
            return
        frozen = _FrozenDocSide(self.encoder)  # training keeps changing the live weights
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-refresh")

        def job() -> None:
            t = time.perf_counter()
            emb = self.embed(encoder=frozen)
            self.index.swap(self._build(emb, f"step{step}"))
            self.embeddings = emb  # one reference assignment: readers see the old or the new bank
            self.refresh_seconds.append(time.perf_counter() - t)

        self._pending = self._pool.submit(job)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.index.close()

    def negatives(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` memory rows drawn without replacement (all when n >= N), as (embeddings (n, E),
        document ids (n,)) from the last refresh: MoCo-style bank negatives (He et al. 2020),
        detached and as stale as the index, so they cost no encoder pass."""
        bank = self.embeddings
        if bank is None:
            raise RuntimeError("the memory has no embeddings yet: refresh() first")
        rows = torch.randperm(len(bank), generator=generator)[:n] if n < len(bank) else torch.arange(len(bank))
        return bank[rows], torch.from_numpy(self.doc_ids)[rows]

    # ------------------------------------------------------------------------------ search
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (scores (B, k), document ids (B, k)) for unit query vectors (B, E)."""
        scores, ids = self.index.search(queries.detach().float().cpu().numpy(), k)
        return torch.from_numpy(np.ascontiguousarray(scores)), torch.from_numpy(np.ascontiguousarray(ids))



class _FrozenDocSide:
    """A copy of a DualEncoder's document side, taken at refresh time, for background embedding."""

    embed_docs = DualEncoder.embed_docs  # the same code, run on the copied weights

    def __init__(self, live: DualEncoder) -> None:
        self.doc, self.cfg = copy.deepcopy(live.doc), live.cfg
