"""The contrastive loss over data-parallel replicas: gathered, it gives one process's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rag_mm.data.documents import DocumentStore
from rag_mm.model.rag import RagModel
from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from retriever.memory import RetrievalMemory
from retriever.replicas import Replicas
from tests.distributed import run_ranks

SMALL = dict(
    embed_dim=16,
    vision_width=32,
    vision_layers=1,
    vision_head_width=16,
    text_width=32,
    text_layers=1,
    text_heads=2,
    context_length=16,
)
N_DOCS, B, K = 24, 6, 2  # memory documents; global batch of queries; hard negatives per query


def test_shares_cover_a_draw_in_rank_order():
    for n, size in [(5, 2), (7, 3), (2, 4), (8, 4)]:
        parts = [Replicas(None, r, size).share(n) for r in range(size)]
        assert [i for p in parts for i in range(n)[p]] == list(range(n))
        assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1


def _rag(rcfg: RetrieverConfig) -> RagModel:
    torch.manual_seed(0)  # the same documents and retriever on every rank
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(100, 100 + N_DOCS)
    images, text = (
        torch.randn(N_DOCS, 3, 32, 32, generator=g),
        torch.randint(1, 100, (N_DOCS, 6), generator=g),
    )
    text_len = torch.full((N_DOCS,), 6)
    store = DocumentStore(ids, images, text, text_len, [""] * N_DOCS, {})
    enc = DualEncoder(rcfg, 32)
    memory = RetrievalMemory(enc, images, text, text_len, ids, factory="Flat", batch_size=8)
    memory.refresh()  # bank negatives come from the last refresh
    return RagModel(None, store, rcfg, enc, memory)


def _loss_and_grads(rag: RagModel, rows: slice) -> tuple[float, torch.Tensor]:
    """The contrastive term of queries ``rows`` of one fixed global batch, with their retrieved
    documents as hard negatives: (loss, the retriever's flattened gradient)."""
    g = torch.Generator().manual_seed(1)
    image, q_ids = (
        torch.randn(B, 3, 32, 32, generator=g),
        torch.randint(1, 100, (B, 5), generator=g),
    )
    gold = 100 + torch.randint(0, N_DOCS, (B,), generator=g)
    hard_ids = 100 + torch.randint(0, N_DOCS, (B, K), generator=g)
    enc = rag.retriever
    enc.zero_grad(set_to_none=True)
    # the pseudo-query and bank draws, alike on every rank and in the reference
    torch.manual_seed(2)
    with rag.replicas.spanning(enc):  # the RagModel's own passes span the replicas themselves
        q_emb = enc.embed_queries(image[rows], q_ids[rows], torch.full((B,), 5)[rows])
        h = rag._docs(hard_ids[rows].flatten()[:, None], "cpu")
        hard = enc.embed_docs(h["doc_image"][:, 0], h["doc_ids"][:, 0], h["doc_len"][:, 0])
    loss = rag._contrastive(q_emb, gold[rows], hard, hard_ids[rows].flatten())
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in enc.parameters() if p.grad is not None])
    # BatchNorm's running ones
    stats = torch.cat([b.reshape(-1).float() for b in enc.buffers() if b.is_floating_point()])
    return loss.item(), grad, stats


def _replicated_vs_one_process(rank: int, world: int, pseudo: int, tower: str) -> dict:
    # resnet_sides: one shared tower whose batch norms keep statistics per side (side_norm)
    sides = dict(shared_towers=True, side_norm=True) if tower == "resnet_sides" else {}
    rcfg = RetrieverConfig(
        **SMALL,
        **sides,
        vision_tower=tower.removesuffix("_sides"),
        mode="learned",
        pseudo_queries=pseudo,
        bank_negatives=10,
    )
    rag = _rag(rcfg)
    start = {n: b.clone() for n, b in rag.retriever.named_buffers()}
    # one process, the whole batch
    ref_loss, ref_grad, ref_stats = _loss_and_grads(rag, slice(None))
    for n, b in rag.retriever.named_buffers():  # the running statistics as they were
        b.copy_(start[n])
    rag.replicas = Replicas(dist.group.WORLD, rank, world)
    loss, grad, stats = _loss_and_grads(rag, rag.replicas.share(B))
    dist.all_reduce(grad)  # data parallel's mean over the replicas
    try:  # rows of another count on each replica: refused, the counts named
        rag.replicas.gather(torch.zeros(rank + 1, 2))
        refused = ""
    except ValueError as e:
        refused = str(e)
    # tensors cross pickled by value: 4 bytes an entry (a list of 13.5 M Python floats is 430 MB)
    return dict(
        ref_loss=ref_loss,
        ref_grad=ref_grad,
        ref_stats=ref_stats,
        loss=loss,
        refused=refused,
        grad=grad / world,
        stats=stats,
    )


@pytest.mark.multirank
# 5: shares of 3 and 2, uneven: the shorter padded with rows the loss leaves out
@pytest.mark.parametrize(
    "pseudo,tower", [(0, "vit"), (5, "vit"), (5, "resnet"), (5, "resnet_sides")]
)
def test_gathered_contrastive_gives_one_process_gradient(pseudo, tower):
    """Two replicas, each embedding half the batch (and its share of the pseudo-queries), give the
    one-process loss on every rank and, averaged, its gradient (each replica scoring only its own
    rows, with a quarter of the negatives missing, has a loss some 25% lower). With the ResNet
    tower, its BatchNorm normalises over both replicas' rows, and its running statistics move as
    one process's do (each replica normalising its own 3 rows, the loss is 6% off); with
    statistics kept per side (``side_norm``), each side's."""
    for out in run_ranks(_replicated_vs_one_process, 2, pseudo, tower):
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
        assert "[1, 2]" in out["refused"]
        # atol 5e-5: the replicas sum the ResNet's conv gradients in another order than one process;
        # on an AVX-512 host one of the 13.5 M entries, near zero, lands 2.1e-5 away (1e-5 held on
        # AVX2)
        torch.testing.assert_close(out["grad"], out["ref_grad"], rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(out["stats"], out["ref_stats"], rtol=1e-4, atol=1e-6)


def _refresh_vs_one_process(rank: int, world: int) -> dict:
    rcfg = RetrieverConfig(**SMALL, vision_tower="resnet", mode="learned")
    rag = _rag(rcfg)  # memory batch_size 8: three passes of 8 documents
    memory, enc = rag.memory, rag.retriever
    start = {n: b.clone() for n, b in enc.named_buffers()}
    ref = memory.embed()  # one process, training mode: each pass normalised by its own 8 rows
    ref_stats = torch.cat([b.reshape(-1).float() for b in enc.buffers() if b.is_floating_point()])
    for n, b in enc.named_buffers():
        b.copy_(start[n])
    memory.refresh()  # split over the ranks, 4 rows of each pass on each
    stats = torch.cat([b.reshape(-1).float() for b in enc.buffers() if b.is_floating_point()])
    return dict(
        ref=ref.tolist(),
        got=memory.embeddings.tolist(),
        ref_stats=ref_stats.tolist(),
        stats=stats.tolist(),
    )


@pytest.mark.multirank
def test_sharded_refresh_embeds_as_one_process():
    """The index refresh split over 2 ranks, the encoder in training mode (the ResNet tower's
    BatchNorm normalising by batch statistics), gives the embeddings and running statistics of one
    process embedding the memory in its passes (each rank normalising its own half moves the
    embeddings by up to 0.36)."""
    for out in run_ranks(_refresh_vs_one_process, 2):
        torch.testing.assert_close(
            torch.tensor(out["got"]), torch.tensor(out["ref"]), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            torch.tensor(out["stats"]), torch.tensor(out["ref_stats"]), rtol=1e-4, atol=1e-6
        )


def test_pseudo_queries_are_restyled_when_asked():
    """``retriever.pseudo_restyle`` reaches the pseudo-queries: the same draws give another loss
    and gradient with every view restyled, and the one-process loss is unchanged at share 0."""

    def loss(share: float) -> float:
        rcfg = RetrieverConfig(
            **SMALL, mode="learned", pseudo_queries=5, pseudo_restyle=share, bank_negatives=10
        )
        return _loss_and_grads(_rag(rcfg), slice(None))[0]

    assert loss(0.0) == loss(0.0)
    assert abs(loss(1.0) - loss(0.0)) > 1e-4


def test_pseudo_queries_take_a_tone_curve_when_asked():
    """``retriever.pseudo_tone`` reaches the pseudo-queries: the same draws give another loss."""

    def loss(amount: float) -> float:
        rcfg = RetrieverConfig(
            **SMALL, mode="learned", pseudo_queries=5, pseudo_tone=amount, bank_negatives=10
        )
        return _loss_and_grads(_rag(rcfg), slice(None))[0]

    assert loss(0.0) == loss(0.0)
    assert abs(loss(1.0) - loss(0.0)) > 1e-4


def test_pseudo_queries_lie_on_a_surface_when_asked():
    """``retriever.pseudo_surface`` reaches the pseudo-queries: the same draws give another loss
    (what the surface does: test_retriever's ``random_surface`` test)."""

    def loss(amount: float) -> float:
        rcfg = RetrieverConfig(
            **SMALL, mode="learned", pseudo_queries=5, pseudo_surface=amount, bank_negatives=10
        )
        return _loss_and_grads(_rag(rcfg), slice(None))[0]

    assert loss(0.0) == loss(0.0)
    assert abs(loss(1.0) - loss(0.0)) > 1e-4


def test_pseudo_queries_are_compressed_when_asked():
    """``retriever.pseudo_jpeg`` reaches the pseudo-queries: the loss changes with every view
    compressed (what the compression does: test_retriever's ``random_jpeg`` test)."""

    def loss(share: float) -> float:
        rcfg = RetrieverConfig(
            **SMALL, mode="learned", pseudo_queries=5, pseudo_jpeg=share, bank_negatives=10
        )
        return _loss_and_grads(_rag(rcfg), slice(None))[0]

    assert loss(0.0) == loss(0.0)
    assert abs(loss(1.0) - loss(0.0)) > 1e-4


def test_neighbours_are_the_nearest_other_document():
    """``RetrievalMemory.neighbours``: each row's nearest other row by the bank's cosine, never
    itself, the same in chunks smaller than the memory as in one."""
    rcfg = RetrieverConfig(**SMALL, mode="learned")
    rag = _rag(rcfg)
    bank = rag.memory.embeddings
    rows = torch.tensor([0, 5, 23, 5, 11])
    sims = bank @ bank.T
    sims.fill_diagonal_(-float("inf"))
    want = sims.argmax(1)[rows]
    for chunk in (N_DOCS, 7, 1):
        got = rag.memory.neighbours(rows, chunk=chunk)
        assert torch.equal(got, want), chunk
        assert not (got == rows).any()


def test_pseudo_queries_come_in_look_alike_pairs_when_asked():
    """``retriever.pseudo_neighbours``: that share of the draw is pairs (random rows, then each
    one's nearest other document), the rest at random; at share 0, and before the memory's
    first refresh, every row is random."""
    bank_rcfg = dict(**SMALL, mode="learned", pseudo_queries=10, bank_negatives=10)
    rag = _rag(RetrieverConfig(**bank_rcfg, pseudo_neighbours=0.8))
    torch.manual_seed(3)
    rows = rag._pseudo_rows(10)
    assert len(rows) == 10
    assert torch.equal(rows[4:8], rag.memory.neighbours(rows[:4]))
    plain = _rag(RetrieverConfig(**bank_rcfg))
    torch.manual_seed(3)
    assert torch.equal(plain._pseudo_rows(10)[:4], rows[:4])  # the same random anchors
    # the draw reaches the loss: with pairs the same seed gives another loss
    torch.manual_seed(5)
    base = _loss_and_grads(plain, slice(None))[0]
    torch.manual_seed(5)
    assert abs(_loss_and_grads(rag, slice(None))[0] - base) > 1e-4
    rag.memory.embeddings = None  # before the first refresh: all at random
    torch.manual_seed(3)
    got = rag._pseudo_rows(10)
    torch.manual_seed(3)
    assert torch.equal(got, torch.randint(0, N_DOCS, (10,)))
