"""Retrieval + reading in one module, so data parallel wraps a single forward.

``RagModel.forward`` takes a batch of queries and, by ``retriever.mode``:

* ``none``: the reader answers closed-book;
* ``oracle``: the reader gets each query's gold document;
* ``learned``: the query encoder embeds the query, faiss returns the top-k documents, the reader
  reads them jointly, and the retriever is trained by the reader (Atlas' losses) plus, during
  warm-up, in-batch contrastive learning against the gold documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from rag_mm.data.documents import DocumentStore
from rag_mm.data.pipeline import MEAN, STD
from rag_mm.model.anonymize import anonymize_answers
from rag_mm.model.reader import Reader, ReaderOutput
from rag_mm.model.reading_order import shuffled_reads, unranked_prior
from retriever import losses
from retriever.augment import (
    VIEW_STYLES,
    photo_views,
    random_jpeg,
    random_restyle,
    random_surface,
    random_tone,
    random_views,
)
from retriever.encoders import DualEncoder
from retriever.memory import RetrievalMemory
from retriever.replicas import Replicas


@dataclass
class RagOutput:
    loss: torch.Tensor  # () reader NLL + lambda * retriever loss
    reader: ReaderOutput  # the joint read over the top-k documents
    retriever_loss: torch.Tensor | None  # () the retriever's part (before lambda)
    # (B, max(k, search_k)) retrieved ids, nearest first; the reader read the first k
    doc_ids: torch.Tensor | None
    # (B, k) retriever scores (temperature-scaled) of the k documents read
    scores: torch.Tensor | None


class RagModel(nn.Module):
    def __init__(
        self,
        reader: Reader,
        store: DocumentStore,
        rcfg,
        retriever: DualEncoder | None = None,
        memory: RetrievalMemory | None = None,
        gold_queries: bool = True,
    ) -> None:
        super().__init__()
        self.reader = reader
        self.retriever = retriever
        self.rcfg = rcfg
        # tensors, not parameters: on the host, or on the device with the device search
        # (retriever.search)
        self.store = store
        self.memory = memory
        # whether the training queries name their gold documents (json doc_id, as
        # rag_mm.checks.gold finds the data): without them the contrastive terms use pseudo-queries
        # alone
        self.gold_queries = gold_queries
        # the data-parallel replicas the contrastive loss spans: one process until the parallel
        # layout is applied (rag_mm.distributed.spread.SpreadRag)
        self.replicas = Replicas()

    @property
    def needs_doc_nll(self) -> bool:
        """Whether the retriever loss reads the reader's answer NLL with each document alone
        (pdist / emdr over more than one document)."""
        r = self.rcfg
        return r.mode == "learned" and r.loss in ("pdist", "emdr") and r.top_k > 1

    @property
    def whole_reader(self) -> bool:
        """This process holds the whole reader (``SpreadRag`` says so only for unsharded
        layouts)."""
        return True

    def _docs(self, ids: torch.Tensor, device) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in self.store.fetch(ids).items()}

    def forward(
        self,
        image,
        q_ids,
        q_len,
        a_ids,
        a_len,
        gold=None,
        retriever_loss: bool = True,
        search_k: int = 0,
        contrastive: bool = True,
    ) -> RagOutput:
        """Queries (B, ...) -> RagOutput. ``gold`` (B,) are gold document ids (oracle,
        contrastive). ``contrastive``: whether the retriever loss takes its contrastive terms this
        step (``retriever.contrastive_steps``)."""
        q = dict(image=image, q_ids=q_ids, q_len=q_len, a_ids=a_ids, a_len=a_len)
        x, ids, ret = self.reader_inputs(q, gold, search_k=search_k)
        out = self.reader(**x)
        if ret is None:
            return RagOutput(out.loss, out, None, ids, None)
        q_emb, top, docs, sims = ret
        if not retriever_loss:
            return RagOutput(out.loss, out, None, ids, self.index_scores(sims))
        nll = self._per_document_nll(q, docs) if self.needs_doc_nll else None
        r_loss, scores = self.retriever_loss(
            q, q_emb, top, docs, gold, nll, out.doc_attention, contrastive
        )
        return RagOutput(
            out.loss + self.rcfg.loss_weight * r_loss, out, r_loss.detach(), ids, scores.detach()
        )

    def reader_inputs(self, q: dict, gold=None, search_k: int = 0, grad: bool = True):
        """What the reader reads for queries ``q`` (image, q_ids, q_len, a_ids, a_len), by
        ``retriever.mode``: (reader inputs, retrieved ids (B, max(k, search_k)) or None, and in
        learned mode (query embeddings, top-k ids, their documents, the index's similarities) for
        the retriever loss, else None). ``grad``: the query embeddings keep their graph
        (training)."""
        mode, dev = self.rcfg.mode, q["image"].device
        if mode == "none":
            return self._anonymized(dict(q), grad), None, None
        if mode == "oracle":
            if gold is None or bool((gold < 0).any()):
                raise ValueError("retriever.mode=oracle needs a doc_id in every query's json")
            ids = gold[:, None].cpu()
            return self._anonymized({**q, **self._docs(ids, dev)}, grad), ids, None
        k = self.rcfg.top_k
        with (
            torch.set_grad_enabled(grad and torch.is_grad_enabled()),
            self.replicas.spanning(self.retriever),
        ):
            q_emb = self.retriever.embed_queries(q["image"], q["q_ids"], q["q_len"])  # (B, E)
        # (B, n) nearest first
        sims, ids = self.memory.search(q_emb.detach(), max(k, search_k, self.rcfg.rerank))
        if self.rcfg.rerank:
            sims, ids, ranked = self.rerank(q_emb.detach(), sims, ids, dev)
            docs = {name: v[:, :k] for name, v in ranked.items()}  # fetched once, for the rerank
        sims, ids = sims[:, : max(k, search_k)], ids[:, : max(k, search_k)]
        top, blind = ids[:, :k], None
        if not self.rcfg.rerank:
            docs = self._docs(top, dev)
        if grad and self.training and self.rcfg.reader_shuffle > 0:
            # a share of the queries read their k documents shuffled, the prior hidden
            # (rag_mm/model/reading_order.py); the retriever's loss sees the same order
            order, blind = shuffled_reads(top, self.rcfg.reader_shuffle)  # (B, k), (B,)
            top = top.gather(1, order)
            sims = torch.cat([sims[:, :k].gather(1, order), sims[:, k:]], 1)
            rows, cols = torch.arange(len(order), device=dev)[:, None], order.to(dev)
            docs = {name: v[rows, cols] for name, v in docs.items()}
        x = {**q, **docs}
        prior = self.doc_prior(sims, dev)
        if prior is not None:
            x["doc_prior"] = prior if blind is None else unranked_prior(prior, blind)
        return self._anonymized(x, grad), ids, (q_emb, top, docs, sims)

    @torch.no_grad()
    def rerank(
        self, q_emb: torch.Tensor, sims: torch.Tensor, ids: torch.Tensor, dev
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Over-retrieve, then rerank (Atlas): the index's first ``retriever.rerank`` candidates
        (B, R) re-embedded by the document tower as it is now (the index holds the embeddings of
        the last refresh) and re-sorted by their fresh similarity to the queries (B, E); returns
        (similarities, ids) in the new order, the candidates past R after them as the index had
        them, and the R candidates' documents in the new order. Ids the index could not fill (-1)
        stay last."""
        R = self.rcfg.rerank
        cand = ids[:, :R]  # (B, R)
        B = cand.shape[0]
        # an unfilled slot fetches the nearest (then ranks last)
        docs = self._docs(torch.where(cand < 0, cand[:, :1], cand), dev)
        d = self.retriever.embed_docs(
            docs["doc_image"].flatten(0, 1),
            docs["doc_ids"].flatten(0, 1),
            docs["doc_len"].flatten(0, 1),
        ).view(B, R, -1)  # (B, R, E)
        fresh = self.memory.score(q_emb, d).to(ids.device)  # (B, R) as the index scores them
        fresh = fresh.masked_fill(cand < 0, float("-inf"))
        order = fresh.argsort(dim=1, descending=True, stable=True)  # (B, R)
        rows, cols = torch.arange(B, device=dev)[:, None], order.to(dev)
        return (
            torch.cat([fresh.gather(1, order).to(sims.dtype), sims[:, R:]], 1),
            torch.cat([cand.gather(1, order), ids[:, R:]], 1),
            {name: v[rows, cols] for name, v in docs.items()},
        )

    def _anonymized(self, x: dict, grad: bool) -> dict:
        """The reader's training inputs with a share (``model.copy_anonymize``) of the answers
        renamed to random tokens wherever the example shows them (rag_mm/model/anonymize.py); the
        retriever, which embedded the query and documents before, never sees the renaming."""
        share = self.reader.cfg.copy_anonymize
        if not (grad and self.training and share > 0):
            return x
        return anonymize_answers(x, share, self.reader.vocab_size)

    def index_scores(self, sims: torch.Tensor) -> torch.Tensor:
        """The index's similarities of the k documents read (B, k), scaled as the retriever scores
        them: the scores a forward without the retriever loss reports."""
        return self.retriever.scale().detach().to(sims.device) * sims[:, : self.rcfg.top_k]

    def doc_prior(self, sims: torch.Tensor, dev) -> torch.Tensor | None:
        """log p(d | q) over the top-k documents (B, k), a constant for the reader; None when
        ``retriever.reader_prior`` is off. ``sims``: the index's similarities, nearest first."""
        if not self.rcfg.reader_prior:
            return None
        return torch.log_softmax(
            self.retriever.scale().detach() * sims[:, : self.rcfg.top_k].to(dev), -1
        )

    def retriever_loss(
        self,
        q: dict,
        q_emb,
        top,
        docs: dict,
        gold,
        doc_nll: torch.Tensor | None = None,
        doc_attention=None,
        contrastive: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the retriever's loss, its scores (B, k)) for queries ``q`` whose top-k documents
        ``docs`` (ids ``top``) the reader read; ``doc_nll`` (B, k) is the reader's answer NLL with
        each document alone, for pdist / emdr (``needs_doc_nll``); ``doc_attention`` (B, k) the
        reader's copy attention per document, for adist; ``contrastive``: the contrastive terms
        against the gold documents join the loss. The spread reader
        (rag_mm/distributed/spread.py) calls this too, with both read over its stages."""
        cfg, enc, dev = self.rcfg, self.retriever, q_emb.device
        B, k = top.shape
        # scores of the retrieved documents, differentiable through both towers (Atlas re-embeds
        # them)
        with self.replicas.spanning(enc):
            d_emb = enc.embed_docs(
                docs["doc_image"].flatten(0, 1),
                docs["doc_ids"].flatten(0, 1),
                docs["doc_len"].flatten(0, 1),
            ).view(B, k, -1)  # (B, k, E)
        scores = enc.scale() * torch.einsum("be,bke->bk", q_emb, d_emb)  # (B, k)
        r_loss = scores.new_zeros(())
        if cfg.loss in ("pdist", "emdr") and k > 1:
            if doc_nll is None:
                raise ValueError(f"retriever.loss={cfg.loss} needs the per-document NLL (doc_nll)")
            nll = doc_nll  # (B, k)
            if cfg.loss == "pdist":
                r_loss = losses.perplexity_distillation(scores, nll, cfg.gold_temperature)
            else:
                # mean NLL -> summed log-likelihood
                loglik = -nll * (q["a_len"].to(nll.dtype)[:, None])
                r_loss = losses.emdr2(scores, loglik)
        elif cfg.loss == "adist" and k > 1 and doc_attention is not None:
            r_loss = losses.attention_distillation(scores, doc_attention)
        else:
            # keeps every retriever parameter in the graph (DDP)
            r_loss = r_loss + 0.0 * scores.sum()
        if contrastive and gold is not None and cfg.contrastive_weight > 0 and self._has_rows():
            # the retrieved documents are the hardest negatives there are (same colours, other
            # shape)
            r_loss = r_loss + cfg.contrastive_weight * self._contrastive(
                *self._labelled(q_emb, gold), d_emb.flatten(0, 1), top.flatten().to(dev)
            )
        return r_loss, scores

    def retriever_warmup(
        self, image, q_ids, q_len, gold, **_unused
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Retriever-only contrastive loss of a batch, no reader (the warm-up phase): returns the
        loss () and ``gold_hits`` of the index's top-k. Queries naming no gold document take no
        part; when no training query names one (``gold_queries`` off) the pseudo-queries alone
        make the loss, as Contriever trains without labels, and the queries are not even
        embedded."""
        if not self._has_rows():
            raise ValueError(
                "the retriever warm-up needs gold documents (json doc_id) or "
                "retriever.pseudo_queries > 0"
            )
        if not self.gold_queries:
            q_emb = torch.zeros(0, self.retriever.cfg.embed_dim, device=image.device)  # (0, E)
            none = torch.zeros((), dtype=torch.long)
            return self._contrastive(q_emb, gold[:0]), (none, none)
        with self.replicas.spanning(self.retriever):
            q_emb = self.retriever.embed_queries(image, q_ids, q_len)  # (B, E)
        _, ids = self.memory.search(q_emb, self.rcfg.top_k)  # (B, k) for the logged recall only
        return self._contrastive(*self._labelled(q_emb, gold)), gold_hits(ids, gold)

    def _labelled(
        self, q_emb: torch.Tensor, gold: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training queries (B, E) and their gold ids (B,) that the contrastive terms read:
        all of them, the loss leaving out those naming no gold document (id -1) by a mask (fixed
        shapes: selecting them would read their count back from the device); none when no
        training query names one (``gold_queries`` off)."""
        return (q_emb, gold) if self.gold_queries else (q_emb[:0], gold[:0])

    def _has_rows(self) -> bool:
        """Whether the contrastive terms have queries: gold-labelled ones or pseudo-queries."""
        return self.gold_queries or self.rcfg.pseudo_queries > 0

    def _contrastive(self, q_emb, gold, hard=None, hard_ids=None) -> torch.Tensor:
        """In-batch InfoNCE against the batch's gold documents, plus ``hard`` negatives (N, E) with
        ids (N,) and ``retriever.bank_negatives`` memory rows of the last refresh; with
        ``retriever.pseudo_queries``, random views of memory pictures join the queries. Queries
        whose gold id is -1 take no part (``losses.contrastive``'s mask). Over every data-parallel
        replica (``self.replicas``): the rows of all of them are gathered, so each query meets the
        whole global batch's documents, as in one process, and the towers' batch statistics span
        them too."""
        enc, dev, rep = self.retriever, q_emb.device, self.replicas
        with rep.spanning(enc):
            q_emb, gold, g_emb = self._contrastive_rows(q_emb, gold)
        q_emb, g_emb, gold = rep.gather(q_emb, g_emb, gold)  # (replicas * n, ...)
        if len(gold) == 0:  # no rows at all (no labelled queries, no pseudo-queries)
            return 0.0 * enc.scale()
        extra, extra_ids = [], []
        if hard is not None:
            hard, hard_ids = rep.gather(hard, hard_ids.to(dev))
            extra.append(hard)
            extra_ids.append(hard_ids)
        if self.rcfg.bank_negatives > 0 and self.memory.embeddings is not None:
            # (n, E), (n,) detached
            bank, bank_ids = self.memory.negatives(self.rcfg.bank_negatives)
            extra.append(bank.to(dev, q_emb.dtype))
            extra_ids.append(bank_ids.to(dev))
        return losses.contrastive(
            q_emb,
            g_emb,
            gold,
            enc.scale(),
            torch.cat(extra) if extra else None,
            torch.cat(extra_ids) if extra else None,
            valid=gold >= 0,
        )

    def _contrastive_rows(self, q_emb, gold) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This replica's contrastive rows: (query embeddings (n, E), their gold ids (n,), the gold
        documents' embeddings (n, E)), the queries followed by this replica's share of the
        pseudo-queries when ``retriever.pseudo_queries`` is on. Every replica returns the same n
        (``Replicas.gather``): a share shorter than the longest is padded with rows of gold id -1,
        which the loss leaves out. The gold documents of queries naming none (-1) are embedded as
        a stand-in (the store's first document), left out too."""
        enc, dev, rep, store = self.retriever, q_emb.device, self.replicas, self.store
        gold = gold.to(dev)
        # (n,) rows of the store: the gold documents, a stand-in where there is none
        g_rows = store.rows(torch.where(gold >= 0, gold, store.ids[:1].to(dev)))
        pad = 0
        if self.rcfg.pseudo_queries > 0:
            # random views of memory pictures, each querying its own document: one draw of the
            # configured count, alike on replicas whose generators agree; each embeds its share
            n_draw = self.rcfg.pseudo_queries
            rows = self._pseudo_rows(n_draw)
            # every replica draws the views of the whole draw (the random augmentations then
            # agree with one process's) and embeds its share
            views = self._pseudo_views(store.images[rows].to(dev)).to(q_emb.dtype)
            part = rep.share(n_draw)
            pad = -(-n_draw // rep.size) - (part.stop - part.start)  # to the longest share
            rows, views = rows[part], views[part]
            n = len(rows)  # an empty question: the picture is the whole query
            no_text = (
                torch.zeros(n, 1, dtype=torch.long, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev),
            )
            q_emb = torch.cat([q_emb, enc.embed_queries(views, *no_text)])
            gold = torch.cat([gold, store.ids[rows].to(dev)])
            g_rows = torch.cat([g_rows, rows.to(g_rows.device)])
        # (n, E), one pass over every row's gold document
        g_emb = enc.embed_docs(
            store.images[g_rows].to(dev),
            store.text_ids[g_rows].to(dev),
            store.text_len[g_rows].to(dev),
        )
        if pad:
            q_emb = torch.cat([q_emb, q_emb.new_zeros(pad, q_emb.shape[1])])
            g_emb = torch.cat([g_emb, g_emb.new_zeros(pad, g_emb.shape[1])])
            gold = torch.cat([gold, gold.new_full((pad,), -1)])
        return q_emb, gold, g_emb

    def _pseudo_rows(self, n: int) -> torch.Tensor:
        """The memory rows (n,) whose pictures become pseudo-queries, on the store's device: at
        random, or with ``retriever.pseudo_neighbours`` that share as pairs (m random rows, then
        each one's nearest other document by the last refresh) ahead of the random rest. Before
        the first refresh, or in a memory of one document, all at random."""
        store = self.store
        # drawn on the store's device: a host draw copied to an accelerator waits for it
        rows = torch.randint(0, len(store), (n,), device=store.device)
        m = int(n * self.rcfg.pseudo_neighbours) // 2  # pairs
        if m == 0 or self.memory is None or self.memory.embeddings is None or len(store) < 2:
            return rows
        pairs = torch.cat([rows[:m], self.memory.neighbours(rows[:m])])  # (2m,)
        return torch.cat([pairs, rows[2 * m :]])

    def _pseudo_views(self, pics: torch.Tensor) -> torch.Tensor:
        """Photo-like random views of memory pictures (n, 3, H, W), as ``retriever.pseudo_view``,
        ``pseudo_surface``, ``pseudo_restyle``, ``pseudo_tone`` and ``pseudo_jpeg`` say (the
        surface after the view, whose background swap finds the memory picture's plain ground
        before any light falls on it; the compression last, as a photo is saved after it was
        taken)."""
        style = self.rcfg.pseudo_view
        views = random_views(pics) if style == "jitter" else photo_views(pics, VIEW_STYLES[style])
        if self.rcfg.pseudo_surface > 0:
            views = random_surface(views, self.rcfg.pseudo_surface)
        if self.rcfg.pseudo_restyle > 0:
            views = random_restyle(views, self.rcfg.pseudo_restyle)
        if self.rcfg.pseudo_tone > 0:
            views = random_tone(views, self.rcfg.pseudo_tone)
        if self.rcfg.pseudo_jpeg > 0:
            views = random_jpeg(views, self.rcfg.pseudo_jpeg, MEAN, STD)
        return views

    @torch.no_grad()
    def _per_document_nll(self, q: dict, docs: dict) -> torch.Tensor:
        """The reader's answer NLL with each retrieved document alone: (B, k) (Atlas' gold
        score)."""
        B, k = docs["doc_ids"].shape[:2]
        return self.reader(**one_document_inputs(q, docs)).nll.view(B, k)


def gold_hits(ids: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the queries naming their gold document (``gold`` (B,) >= 0), how many have it among
    their retrieved ``ids`` (B, k), and how many there are: two () counts on ``ids``' device
    (the device search's: not read back, which would be a host sync in the step)."""
    g = gold.to(ids.device)
    named = g >= 0
    return ((ids == g[:, None]).any(1) & named).sum(), named.sum()


def one_document_inputs(q: dict, docs: dict) -> dict:
    """Reader inputs that pair each query with each of its k documents alone: query tensors (B, ...)
    repeated to (B*k, ...), document tensors (B, k, ...) -> (B*k, 1, ...); row b*k + j is query b
    with its j-th document."""
    k = docs["doc_ids"].shape[1]
    rep = {name: t.repeat_interleave(k, 0) for name, t in q.items()}
    return rep | {name: t.flatten(0, 1)[:, None] for name, t in docs.items()}
