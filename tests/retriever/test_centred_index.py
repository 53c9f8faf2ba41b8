"""A centred memory (retriever.centre): the index scores cos(q - mean_q, d - mean_d), the means
taken at each refresh from the documents and from calibration queries embedded by the query
tower as it is then."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from retriever.memory import RetrievalMemory
from tests.retriever.test_retriever import SMALL

N, Q = 24, 20  # documents, calibration queries


def _pictures(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 3, 32, 32, generator=g),
        torch.randint(1, 100, (n, 6), generator=g),
        torch.full((n,), 6),
    )


def _centred_memory() -> tuple[DualEncoder, RetrievalMemory]:
    torch.manual_seed(0)
    # separate towers: the calibration queries must go through the query tower
    enc = DualEncoder(RetrieverConfig(**SMALL, shared_towers=False), 32)
    mem = RetrievalMemory(
        enc, *_pictures(N, 1), torch.arange(100, 100 + N), batch_size=8, queries=_pictures(Q, 2)
    )
    return enc, mem


def _by_hand(enc: DualEncoder, mem: RetrievalMemory, q: torch.Tensor) -> torch.Tensor:
    """(B, N) cos(q - mean_q, d - mean_d) from the live towers."""
    with torch.no_grad():
        d = enc.embed_docs(mem.images, mem.text_ids, mem.text_len)
        cal = enc.embed_queries(*mem.queries)
    return F.normalize(q - cal.mean(0), dim=-1) @ F.normalize(d - d.mean(0), dim=-1).T


def test_centred_search_scores_the_offset_free_cosine():
    enc, mem = _centred_memory()
    enc.eval()
    mem.refresh()
    with torch.no_grad():
        q = enc.embed_queries(*_pictures(6, 3))
    want = _by_hand(enc, mem, q)
    scores, ids = mem.search(q, 5)
    top = want.topk(5, dim=1)
    assert (ids - 100).tolist() == top.indices.tolist()
    torch.testing.assert_close(scores, top.values, atol=1e-5, rtol=1e-5)
    # a rerank scores its candidates as the search does
    d = mem.embed()[ids - 100]  # (B, 5, E)
    torch.testing.assert_close(mem.score(q, d), top.values, atol=1e-5, rtol=1e-5)
    # the bank negatives stay raw: the contrastive loss scores raw embeddings
    torch.testing.assert_close(mem.embeddings, mem.embed())
    # the query tower moves; a background refresh takes its mean from a snapshot of it
    with torch.no_grad():
        for p in enc.query.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mem.refresh(background=True, step=1)
    mem.wait()
    scores, ids = mem.search(q, 5)
    top = _by_hand(enc, mem, q).topk(5, dim=1)
    assert (ids - 100).tolist() == top.indices.tolist()
    torch.testing.assert_close(scores, top.values, atol=1e-5, rtol=1e-5)
    mem.close()


class _OffsetEncoder:
    """Stand-in towers with a known geometry: entity i is direction e_i; a document is e_i plus a
    small offset, a query a weaker e_i plus a large offset of its own kind (a photo beside a
    reference picture)."""

    def __init__(self, dim: int = 32, n: int = 40) -> None:
        g = torch.Generator().manual_seed(0)
        self.e = F.normalize(torch.randn(n, dim, generator=g), dim=-1)
        self.doc_offset = 0.5 * F.normalize(torch.randn(dim, generator=g), dim=0)
        self.query_offset = 3.0 * F.normalize(torch.randn(dim, generator=g), dim=0)
        self.noise = 0.05 * torch.randn(4 * n, dim, generator=g)
        self.cfg = RetrieverConfig(embed_dim=dim)

    def embed_docs(self, entity, _ids, _len):
        return F.normalize(self.e[entity[:, 0, 0, 0].long()] + self.doc_offset, dim=-1)

    def embed_queries(self, entity, _ids, _len):
        rows = entity[:, 0, 0, 0].long()
        x = 0.5 * self.e[rows % len(self.e)] + self.query_offset + self.noise[rows]
        return F.normalize(x, dim=-1)


def _entities(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pictures that carry their row number (what the stand-in towers read)."""
    return rows.float().view(-1, 1, 1, 1).expand(-1, 3, 2, 2).contiguous(), rows[:, None], rows


def test_centring_finds_what_a_shared_offset_hides():
    enc, n = _OffsetEncoder(), 40
    queries = _entities(torch.arange(n, 4 * n))  # calibration: other queries of every entity
    test = torch.arange(n)  # query i asks for entity i
    recall = {}
    for centred in (False, True):
        mem = RetrievalMemory(
            enc, *_entities(torch.arange(n)), torch.arange(n), queries=queries if centred else None
        )
        mem.refresh()
        _, ids = mem.search(enc.embed_queries(*_entities(test)), 1)
        recall[centred] = (ids[:, 0] == test).float().mean().item()
        mem.close()
    # raw: the query offset dominates every cosine, the document nearest it wins for most queries
    assert recall[False] < 0.5, recall
    assert recall[True] == 1.0, recall
