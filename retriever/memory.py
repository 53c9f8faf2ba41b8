"""The document memory's embeddings and their faiss index, refreshed as the encoder trains.

``refresh`` re-embeds every document with the current document encoder and swaps a new index in
through ``retriever.serve.DocumentIndex.rebuild``. Synchronous refresh splits the embedding across
ranks (each rank embeds 1/W of every forward pass, then all-gather:
``retriever.sharded.embed_sharded``), as Atlas does; background refresh embeds a frozen copy of the
encoder on the rebuild thread while training goes on with the old index, the way REALM's
asynchronous index builder works.

With calibration ``queries`` the index is centred: queries (photos, another artist's drawing)
and documents (clean reference pictures) sit apart in the embedding space, a shared offset
between the two kinds (the "modality gap" of CLIP's two towers, Liang et al. 2022) that
every cosine carries and that compresses what tells one entity from another. Each refresh
embeds the documents and a fixed sample of training queries with the same encoder, and
scores ``cos(q - mean_q, d - mean_d)``: the index holds the centred documents, a search
and a rerank centre the query. The contrastive loss and its bank negatives keep the raw
embeddings.

With ``on_device`` the index is ``retriever.exact.TorchFlatIndex`` on the training device (exact
search, one matmul and a top-k) and the bank negatives live there too: a search takes the query
embeddings where they are and answers there, with no copy to the host. Otherwise faiss searches
on the host.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from retriever.encoders import DualEncoder
from retriever.errors import RefreshInterrupted
from retriever.exact import TorchFlatIndex
from retriever.index import FaissIndex
from retriever.replicas import Replicas
from retriever.serve import DocumentIndex
from retriever.sharded import embed_sharded

log = logging.getLogger(__name__)


class RetrievalMemory:
    def __init__(
        self,
        encoder,
        images: torch.Tensor,
        text_ids: torch.Tensor,
        text_len: torch.Tensor,
        doc_ids: torch.Tensor,
        *,
        factory: str = "Flat",
        batch_size: int = 256,
        device=None,
        corpus_hash: str = "",
        queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        on_device: bool = False,
    ) -> None:
        self.encoder = encoder  # DualEncoder; .embed_docs (and .embed_queries when centred)
        # (N, ...) on the host
        self.images, self.text_ids, self.text_len = (
            images,
            text_ids,
            text_len,
        )
        self.doc_ids = doc_ids.numpy().astype(np.int64)  # (N,) ids returned by searches
        self.factory = factory
        self.batch_size = batch_size
        self.device = device or torch.device("cpu")
        self.corpus_hash = corpus_hash
        self.index = DocumentIndex()
        self.refresh_seconds: list[
            float
        ] = []  # wall time of each refresh (embedding + index build)
        # (N, E) of the last refresh: the negatives bank
        self.embeddings: torch.Tensor | None = None
        # calibration queries (image (Q, 3, H, W), q_ids, q_len) on the host: their mean
        # embedding centres the query side (see the module's note); None: no centring
        self.queries = queries
        # (index, query mean (E,), document mean (E,)) of the last refresh, swapped together
        self._centred: tuple[FaissIndex, torch.Tensor, torch.Tensor] | None = None
        self._cancelled = False  # set by cancel(): a background refresh stops at its next batch
        # search by TorchFlatIndex on self.device (retriever.exact.search_on_device decides),
        # else by faiss on the host
        self.on_device = on_device
        self._ids_t = torch.from_numpy(self.doc_ids).to(self.device if on_device else "cpu")

    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def built(self) -> bool:
        """Whether an index has been built yet (the first refresh always runs synchronously)."""
        return self.index._current is not None

    # ------------------------------------------------------------------------------ embedding
    @property
    def centred(self) -> bool:
        return self.queries is not None

    @torch.no_grad()
    def embed(self, encoder=None, rows: range | None = None, queries: bool = False) -> torch.Tensor:
        """Embeddings (n, E) of ``rows`` (default all) with ``encoder`` (default the live one):
        of the documents, or with ``queries`` of the calibration queries (query tower)."""
        enc = encoder or self.encoder
        images, ids, lens = self.queries if queries else (self.images, self.text_ids, self.text_len)
        side = enc.embed_queries if queries else enc.embed_docs
        rows = rows if rows is not None else range(len(images))
        out = [torch.zeros(0, self._dim())]
        starts = range(rows.start, rows.stop, self.batch_size)
        for i, s in enumerate(starts):
            if (
                encoder is not None and self._cancelled
            ):  # the background refresh's copy: no collectives
                raise RefreshInterrupted(i, len(starts))
            idx = slice(s, min(rows.stop, s + self.batch_size))
            out.append(
                side(
                    images[idx].to(self.device), ids[idx].to(self.device), lens[idx].to(self.device)
                )
                .float()
                .cpu()
            )
        return torch.cat(out)

    def _dim(self) -> int:
        return int(self.encoder.cfg.embed_dim)

    # ------------------------------------------------------------------------------ refresh
    def refresh(
        self, background: bool = False, step: int = 0, stop: Callable[[], bool] | None = None
    ) -> None:
        """Re-embed the memory and swap the new index in (now, or when the worker finishes).
        ``stop()`` is asked before each forward pass of a synchronous refresh (every rank asks,
        so it may be a collective) and ends it with ``RefreshInterrupted`` when True; a
        background refresh is stopped by ``cancel()``. The previous index keeps serving."""
        background = background and self.built  # the first refresh always runs now
        if background and self.index.rebuilding:
            log.info("index refresh at step %d skipped: the previous one is still running", step)
            return
        # training changes the live weights
        frozen = _FrozenDocSide(self.encoder, self.centred) if background else None

        def side(queries: bool) -> torch.Tensor:
            if frozen is not None:  # no collectives off the main thread: this rank embeds it all
                return self.embed(encoder=frozen, queries=queries)
            # in passes of batch_size rows, as one process embeds them, each split over the ranks
            # with the encoder's batch statistics spanning them: in training mode the ResNet tower's
            # BatchNorm normalises each pass as one process does
            return embed_sharded(
                lambda rows: self.embed(rows=rows, queries=queries),
                len(self.queries[0]) if queries else len(self),
                self._dim(),
                chunk=self.batch_size,
                jointly=lambda: Replicas.world().spanning(self.encoder),
                should_stop=stop,
            )

        raw: dict[str, torch.Tensor] = {}

        def embed() -> torch.Tensor:  # called by rebuild, on its background thread if there is one
            raw["docs"] = side(queries=False)
            if not self.centred:
                return raw["docs"]
            raw["mean_q"], raw["mean_d"] = side(queries=True).mean(0), raw["docs"].mean(0)
            return F.normalize(raw["docs"] - raw["mean_d"], dim=-1)

        start = time.perf_counter()

        # the bank and the means live where the index searches: on the device, or the host
        home = self.device if self.on_device else torch.device("cpu")

        def keep(index: FaissIndex | TorchFlatIndex, _: torch.Tensor) -> None:
            # one reference assignment each: readers see the old or the new bank (and index)
            self.embeddings = raw["docs"].to(home)
            if self.centred:
                self._centred = (index, raw["mean_q"].to(home), raw["mean_d"].to(home))
            self.refresh_seconds.append(time.perf_counter() - start)

        build = None
        if self.on_device:
            build = lambda x, ids: TorchFlatIndex(x, ids, device=home)  # noqa: E731

        # factory None is "auto": build_index picks default_factory(N, E).
        self.index.rebuild(
            embed,
            self.doc_ids,
            background=background,
            on_swap=keep,
            factory=None if self.factory == "auto" else self.factory,
            metric="ip",
            search_params=None,
            encoder_hash=f"step{step}",
            corpus_hash=self.corpus_hash,
            build=build,
        )

    def wait(self) -> None:
        """Wait for a background refresh; raises what it raised (nothing when it was cancelled)."""
        try:
            self.index.wait()
        except RefreshInterrupted:
            if not self._cancelled:
                raise

    def cancel(self) -> None:
        """Stop a background refresh at its next batch (the process is about to stop)."""
        self._cancelled = True

    def close(self) -> None:
        self.wait()
        self.index.close()

    def negatives(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` memory rows drawn without replacement (all when n >= N), as (embeddings (n, E),
        document ids (n,)) from the last refresh: MoCo-style bank negatives (He et al. 2020),
        detached and as stale as the index, so they cost no encoder pass."""
        bank = self.embeddings
        if bank is None:
            raise RuntimeError("the memory has no embeddings yet: refresh() first")
        # drawn on the bank's device (a host draw copied to an accelerator waits for it), a given
        # generator on its own: on the CPU both searches (retriever.search) draw alike
        gen_dev = bank.device if generator is None else generator.device
        rows = (
            torch.randperm(len(bank), generator=generator, device=gen_dev)[:n]
            if n < len(bank)
            else torch.arange(len(bank), device=gen_dev)
        )
        rows = rows.to(bank.device)
        return bank[rows], self._ids_t[rows]

    @torch.no_grad()
    def neighbours(self, rows: torch.Tensor, chunk: int = 1 << 18) -> torch.Tensor:
        """The nearest other document of each memory row in ``rows`` (m,), by the inner product
        of the last refresh's raw embeddings (unit vectors: the cosine): (m,) rows, on ``rows``'
        device. Exact, in chunks of ``chunk`` documents, so an (m, N) score matrix of a large
        memory is never held whole."""
        bank = self.embeddings
        if bank is None:
            raise RuntimeError("the memory has no embeddings yet: refresh() first")
        if len(bank) < 2:
            raise ValueError("a memory of one document has no neighbours")
        r = rows.to(bank.device)
        anchors = bank[r]  # (m, E)
        best = torch.full((len(r),), -float("inf"), device=bank.device)
        arg = torch.zeros(len(r), dtype=torch.long, device=bank.device)
        for s in range(0, len(bank), chunk):
            sims = anchors @ bank[s : s + chunk].T  # (m, c)
            # a row is not its own neighbour: its column set to -inf where it lies in this chunk
            # (a scatter, not a boolean index, which would read the mask back to the host)
            c = sims.shape[1]
            own = ((r >= s) & (r < s + c))[:, None]  # (m, 1)
            col = (r - s).clamp(0, c - 1)[:, None]  # (m, 1)
            sims.scatter_(1, col, torch.where(own, -float("inf"), sims.gather(1, col)))
            top, at = sims.max(1)
            better = top > best
            best = torch.where(better, top, best)
            arg = torch.where(better, at + s, arg)
        return arg.to(rows.device)

    # ------------------------------------------------------------------------------ search
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (scores (B, k), document ids (B, k)) for unit query vectors (B, E): the inner
        product with the documents, or, centred, ``cos(q - mean_q, d - mean_d)``. On the device
        (``on_device``) the results are on the queries' device, else on the host."""
        q, index = queries.detach().float(), self.index
        q = q if self.on_device else q.cpu()
        if self.centred:
            if self._centred is None:
                raise RuntimeError("the memory has no index yet: refresh() first")
            index, mean_q, _ = self._centred  # on the index's side: q's device
            q = F.normalize(q - mean_q, dim=-1)
        if self.on_device:
            scores, ids = index.search(q, k)
            return scores.to(queries.device), ids.to(queries.device)
        scores, ids = index.search(q.numpy(), k)
        return torch.from_numpy(np.ascontiguousarray(scores)), torch.from_numpy(
            np.ascontiguousarray(ids)
        )

    def score(self, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """Scores (B, R) of queries (B, E) against their own documents (B, R, E) as a search
        scores them (centred with the last refresh's means, or the inner product)."""
        q, d = queries.float(), docs.float()
        if self.centred and self._centred is not None:
            _, mean_q, mean_d = self._centred
            q = F.normalize(q - mean_q.to(q.device), dim=-1)
            d = F.normalize(d - mean_d.to(d.device), dim=-1)
        return torch.einsum("be,bre->br", q, d)


class _FrozenDocSide:
    """A copy of a DualEncoder's document side (and its query side, shared or not, for the
    calibration queries of a centred memory), taken at refresh time, for background embedding."""

    # the same code, run on the copied weights
    embed_docs = DualEncoder.embed_docs
    embed_queries = DualEncoder.embed_queries

    def __init__(self, live: DualEncoder, queries: bool = False) -> None:
        self.doc, self.cfg = copy.deepcopy(live.doc), live.cfg
        if queries:
            self.query = self.doc if live.query is live.doc else copy.deepcopy(live.query)
