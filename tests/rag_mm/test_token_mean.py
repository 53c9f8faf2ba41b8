"""The reader's step loss is the token mean of the global batch, whatever the layout: two
data-parallel gloo ranks and two accumulation micro-steps give one process's loss and gradients
on the same eight queries, whose answers differ in length.

Averaging the replicas' (or micro-steps') own token means as equals, DDP's convention, weighs the
half with the short answers above its share: the last test shows that convention misses, so the
batch below does tell the two apart.
"""

from __future__ import annotations

import torch

from rag_mm.config import compose
from rag_mm.data.documents import DocumentStore
from rag_mm.distributed.spread import SpreadRag
from rag_mm.model.factory import build_reader
from rag_mm.model.rag import RagModel
from tests.distributed import run_ranks
from tests.rag_mm.conftest import TINY_MODEL

VOCAB = 49408  # the bundled CLIP BPE tokenizer's
B = 8  # the global batch: queries 0-3 answer in one token, 4-7 in the longest answer


def _cfg(batch: int):
    return compose(["+experiment=demo", "retriever=none", f"data.batch_size={batch}", *TINY_MODEL])


def _global_batch(m) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(
        image=torch.randn(B, 3, m.image_size, m.image_size, generator=g),
        q_ids=torch.randint(0, VOCAB, (B, m.max_question), generator=g),
        q_len=torch.randint(2, m.max_question + 1, (B,), generator=g),
        a_ids=torch.randint(0, VOCAB, (B, m.max_answer), generator=g),
        a_len=torch.tensor([1] * (B // 2) + [m.max_answer] * (B // 2)),
        gold=torch.full((B,), -1),
    )


def _step(rank: int, world: int, parts: int, token_mean: bool) -> tuple[float, torch.Tensor]:
    """One optimizer step's loss and flat gradient on this rank: the global batch split over
    ``world`` data-parallel ranks, each rank's share over ``parts`` accumulation micro-steps
    (rank r takes rows r*B/world .. on, micro-step i the i-th part of them)."""
    n = B // world // parts
    cfg = _cfg(n)
    torch.manual_seed(0)
    reader = build_reader(cfg.model, VOCAB)
    rag = RagModel(
        reader, DocumentStore.empty(cfg.model.image_size, cfg.model.max_doc_text), cfg.retriever
    )
    spread = SpreadRag(rag, cfg, torch.device("cpu"))
    x = _global_batch(cfg.model)
    mine = range(rank * B // world, (rank + 1) * B // world)
    batches = [{k: v[list(mine)[i * n : (i + 1) * n]] for k, v in x.items()} for i in range(parts)]
    tokens = spread.step_answer_tokens(batches) if token_mean else None
    loss = 0.0
    for i, b in enumerate(batches):
        out = spread.train_step(b, scale=1 / parts, sync=i == parts - 1, answer_tokens=tokens)
        loss += float(out.loss) if token_mean else float(out.loss) / parts
    # a parameter the loss does not reach has no gradient in one process, zeros after a reduce
    grad = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for _, p in sorted(spread.named_parameters())
        ]
    )
    return loss, grad


def _one_process() -> tuple[float, torch.Tensor]:
    return _step(0, 1, 1, token_mean=True)


def _dp(rank: int, world: int, token_mean: bool) -> tuple[float, torch.Tensor]:
    return _step(rank, world, 1, token_mean)


def _close(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> bool:
    return abs(a[0] - b[0]) < 1e-5 * abs(a[0]) and torch.allclose(a[1], b[1], rtol=1e-4, atol=1e-7)


def test_accumulation_gives_one_process_step():
    ref = _one_process()
    got = _step(0, 1, 2, token_mean=True)
    assert _close(ref, got), (ref[0], got[0], (ref[1] - got[1]).abs().max())


def test_two_data_parallel_ranks_give_one_process_step():
    ref = _one_process()
    ranks = run_ranks(_dp, 2, True)
    for got in ranks:
        assert _close(ref, got), (ref[0], got[0], (ref[1] - got[1]).abs().max())


def test_replicas_averaged_as_equals_miss_the_global_token_mean():
    ref = _one_process()
    loss, grad = run_ranks(_dp, 2, False)[0]
    off = float((grad - ref[1]).norm() / ref[1].norm())
    assert off > 0.1 and abs(loss - ref[0]) > 1e-4 * abs(ref[0]), (off, loss, ref[0])
