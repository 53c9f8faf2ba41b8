"""A run with the device search (retriever.search=device, here on the CPU): the document store's
id lookup that runs on any device, and the same documents read and the same loss as with faiss."""

from __future__ import annotations

import pytest
import torch

from rag_mm.build import build_rag
from rag_mm.config import ConfigError, compose
from rag_mm.data.documents import DocumentStore
from rag_mm.model.rag import gold_hits
from tests.rag_mm.conftest import LEARNED_RUN, tiny_overrides


def test_store_rows_on_any_device_and_unknown_ids():
    store = DocumentStore(
        torch.tensor([30, 10, 20]),
        torch.arange(3.0)[:, None, None, None].expand(3, 3, 2, 2),
        torch.tensor([[3], [1], [2]]),
        torch.tensor([1, 1, 1]),
        ["c", "a", "b"],
        {},
    )
    moved = store.to("cpu")
    assert moved.rows(torch.tensor([[10, 30], [20, 20]])).tolist() == [[1, 0], [2, 2]]
    got = moved.fetch(torch.tensor([[20, 30]]))
    assert got["doc_ids"].tolist() == [[[2], [3]]] and got["doc_image"][0, :, 0, 0, 0].tolist() == [
        2.0,
        0.0,
    ]
    with pytest.raises(KeyError, match="25"):
        store.rows(torch.tensor([10, 25]))
    with pytest.raises(KeyError, match="99"):
        store.rows(torch.tensor([99]))  # past the largest id
    with pytest.raises(KeyError):
        DocumentStore.empty(2, 1).rows(torch.tensor([0]))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
def test_a_run_reads_the_same_documents_with_either_search(tiny_world, tmp_path, bf16):
    """build_rag with retriever.search=device (on the CPU) against faiss: the same retrieved
    documents, reranked, and the same loss; under the trainer's bf16 autocast
    (``optim.precision=bf16``) too, where the device search still ranks by fp32 scores."""
    outs = []
    for search in ("faiss", "device"):
        over = tiny_overrides(tiny_world, tmp_path, *LEARNED_RUN, "retriever.rerank=4")
        torch.manual_seed(0)
        parts = build_rag(compose([*over, f"retriever.search={search}"]), torch.device("cpu"))
        assert parts.memory.on_device is (search == "device")
        parts.memory.refresh()
        g = torch.Generator().manual_seed(5)
        cfg = parts.rag.rcfg
        B, size = 6, parts.store.images.shape[-1]
        batch = dict(
            image=torch.randn(B, 3, size, size, generator=g),
            q_ids=torch.randint(1, 100, (B, 8), generator=g),
            q_len=torch.full((B,), 8),
            a_ids=torch.randint(1, 100, (B, 4), generator=g),
            a_len=torch.full((B,), 4),
            gold=parts.store.ids[:B],
        )
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = parts.rag.eval()(**batch, search_k=cfg.rerank)
        outs.append(out)
        parts.memory.close()
    assert torch.equal(outs[0].doc_ids, outs[1].doc_ids)
    torch.testing.assert_close(outs[0].loss, outs[1].loss)
    with pytest.raises(ConfigError, match="exact search"):
        build_rag(
            compose(
                tiny_overrides(
                    tiny_world,
                    tmp_path,
                    *LEARNED_RUN,
                    "retriever.search=device",
                    "retriever.index_factory='IVF4,Flat'",
                )
            ),
            torch.device("cpu"),
        )


def test_gold_hits_count_the_queries_naming_their_document():
    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [-1, 9]])  # (B, k) retrieved
    # found, names none (its -1 would match the unfilled slot of row 3), missed, names none
    gold = torch.tensor([2, -1, 7, -1])
    hits, named = gold_hits(ids, gold)
    assert (int(hits), int(named)) == (1, 2)
    hits, named = gold_hits(ids, torch.tensor([1, 4, 6, 9]))
    assert (int(hits), int(named)) == (4, 4)
