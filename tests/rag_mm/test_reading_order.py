"""``retriever.reader_shuffle``: a share of the training queries read their retrieved documents in
a random order with a uniform prior; evaluation reads the retriever's order and prior."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from rag_mm.model.reading_order import shuffled_reads, unranked_prior
from retriever.config import RetrieverConfig, validate
from tests.retriever.test_replicas import SMALL, _rag

K = 4  # documents read per query


def test_the_draw_shuffles_a_share_of_the_rows_the_same_way_every_time():
    top = torch.randint(0, 1000, (400, K), generator=torch.Generator().manual_seed(0))
    order, blind = shuffled_reads(top, 0.0)
    assert not blind.any() and (order == torch.arange(K)).all()
    order, blind = shuffled_reads(top, 1.0)
    assert blind.all()
    assert (order.sort(1).values == torch.arange(K)).all()  # each row a permutation
    # every one of the 24 orders about equally often (expected 16.7 each, 400 rows)
    counts = torch.unique(order, dim=0, return_counts=True)[1]
    assert len(counts) == 24 and counts.min() >= 5 and counts.max() <= 32, counts
    again, _ = shuffled_reads(top, 1.0)
    assert (again == order).all()  # a function of the retrieved ids: every rank draws alike
    _, half = shuffled_reads(top, 0.5)
    assert 0.4 < half.float().mean() < 0.6
    prior = torch.log_softmax(torch.randn(400, K), -1)
    flat = unranked_prior(prior, half)
    assert torch.allclose(flat[half], torch.full((int(half.sum()), K), -math.log(K)))
    assert torch.equal(flat[~half], prior[~half])
    assert "retriever.reader_shuffle" in " ".join(validate(RetrieverConfig(reader_shuffle=1.5)))


def _reads(share: float, training: bool):
    rcfg = RetrieverConfig(**SMALL, mode="learned", top_k=K, reader_shuffle=share)
    rag = _rag(rcfg)
    rag.reader = SimpleNamespace(cfg=SimpleNamespace(copy_anonymize=0.0))
    rag.train(training)
    g = torch.Generator().manual_seed(3)
    q = dict(
        image=torch.randn(16, 3, 32, 32, generator=g),
        q_ids=torch.randint(1, 100, (16, 5), generator=g),
        q_len=torch.full((16,), 5),
        a_ids=torch.randint(1, 100, (16, 3), generator=g),
        a_len=torch.full((16,), 3),
    )
    x, ids, (_, top, docs, _) = rag.reader_inputs(q, grad=training)
    # the documents in the index's order, as the reader reads them unshuffled
    ranked = rag._docs(ids[:, :K], "cpu")["doc_ids"]
    return x, ids, top, docs, ranked


def test_training_reads_a_share_shuffled_and_unranked_evaluation_never():
    x, ids, top, docs, ranked = _reads(1.0, training=True)
    assert not torch.equal(x["doc_ids"], ranked)  # another order ...
    assert torch.equal(top.sort(1).values, ids[:, :K].sort(1).values)  # ... of the same documents
    # the reader and the retriever's loss read one order: the index's documents rearranged
    assert torch.equal(x["doc_ids"], docs["doc_ids"])
    assert torch.equal(docs["doc_ids"], _docs_in(top, ids, ranked))
    assert torch.allclose(x["doc_prior"], torch.full_like(x["doc_prior"], -math.log(K)))
    for share, training in [(1.0, False), (0.0, True)]:
        x, ids, top, _, ranked = _reads(share, training)
        assert torch.equal(x["doc_ids"], ranked) and torch.equal(top, ids[:, :K])
        assert not torch.allclose(x["doc_prior"], torch.full_like(x["doc_prior"], -math.log(K)))


def _docs_in(top: torch.Tensor, ids: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """The index-ordered documents ``ranked`` (B, K, L) of ``ids`` rearranged to ``top``'s order."""
    col = (top[:, :, None] == ids[:, None, :K]).to(torch.int8).argmax(-1)  # (B, K)
    return ranked.gather(1, col[..., None].expand_as(ranked))
