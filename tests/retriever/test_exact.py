"""Exact search on the device (retriever.search=device): ``TorchFlatIndex`` answers as faiss's Flat
index does, row for row and tie for tie; the memory built with it searches as with faiss; the
gate says where the search runs and refuses an approximate index. The run built with it:
tests/rag_mm/test_search_device.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from retriever.exact import TorchFlatIndex, search_on_device
from retriever.index import build_index
from retriever.memory import RetrievalMemory
from tests.retriever.test_retriever import SMALL


def _vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_torch_flat_index_answers_as_faiss_flat_ties_and_padding_included():
    x = _vectors(300, 16, 0)
    # tied rows: three documents with one embedding, a query equal to it and one opposite
    x[5] = x[7]
    x[100] = x[7]
    x[42] = 0.0  # a zero row scores 0 (and -0.0) against every query
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1)) * 3 + 11  # unsorted
    q = torch.cat([x[:4], x[7:8], -x[7:8], _vectors(6, 16, 2)])
    ours, theirs = TorchFlatIndex(x, ids), build_index(x.numpy(), ids.numpy(), factory="Flat")
    for k in (1, 2, 3, 10, 300, 305):  # 305: more than the index holds, padded with -1 / -inf
        s1, i1 = ours.search(q, k)
        s2, i2 = theirs.search(q, k)
        assert torch.equal(i1, i2), f"k={k}"
        assert torch.equal(s1.isinf(), s2.isinf())
        torch.testing.assert_close(s1[~s1.isinf()], s2[~s2.isinf()], atol=1e-5, rtol=0)
    # the tie at the top of query 4 (x[7] itself) goes to the lowest of the three ids
    tied = sorted(int(ids[r]) for r in (5, 7, 100))
    assert ours.search(q[4:5], 3)[1][0].tolist() == tied
    with pytest.raises(ValueError, match="dim"):
        ours.search(torch.zeros(2, 8), 1)


def test_the_search_under_autocast_ranks_by_fp32_scores():
    # the trainer searches inside its bf16 autocast: the scores stay fp32 (a bf16 matmul would
    # round them, and the ranking key reads their bits as int32)
    x, q = _vectors(1024, 64, 3), _vectors(8, 64, 4)
    index = TorchFlatIndex(x)
    want = index.search(q, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = index.search(q, 4)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_the_gate_says_where_the_search_runs(caplog):
    with caplog.at_level(logging.INFO, logger="retriever.exact"):
        assert search_on_device("auto", "Flat", 1000, 64, "cpu")
        assert search_on_device("auto", "Flat", 1000, 64, "cuda")
        assert search_on_device("auto", "auto", 1000, 64, "cuda")  # auto builds Flat here
        assert not search_on_device("auto", "IVF64,Flat", 1000, 64, "cuda")
        assert not search_on_device("faiss", "Flat", 1000, 64, "cuda")
        assert search_on_device("device", "Flat", 1000, 64, "cpu")
    assert "faiss on the host (the index is approximate (IVF64,Flat))" in caplog.text
    assert "matmul + top-k on cpu (retriever.search=device, an exact index)" in caplog.text
    assert "faiss on the host (retriever.search=faiss)" in caplog.text
    with pytest.raises(ValueError, match="retriever.search=device is exact search"):
        search_on_device("device", "auto", 10**6, 64, "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        search_on_device("gpu", "Flat", 10, 64, "cpu")


def _memory(on_device: bool, centred: bool) -> RetrievalMemory:
    torch.manual_seed(0)
    enc = DualEncoder(RetrieverConfig(**SMALL, shared_towers=False), 32)
    g = torch.Generator().manual_seed(1)
    pics = lambda n: (  # noqa: E731
        torch.randn(n, 3, 32, 32, generator=g),
        torch.randint(1, 100, (n, 6), generator=g),
        torch.full((n,), 6),
    )
    docs, queries = pics(24), pics(10)
    return RetrievalMemory(
        enc,
        *docs,
        torch.arange(200, 176, -1),  # ids not in row order
        batch_size=8,
        queries=queries if centred else None,
        on_device=on_device,
    )


@pytest.mark.parametrize("centred", [False, True])
def test_the_memory_searches_the_same_on_the_device(centred):
    host, dev = _memory(False, centred), _memory(True, centred)
    host.refresh()
    dev.refresh()
    assert isinstance(dev.index.current, TorchFlatIndex) and not dev._ids_t.is_cuda
    q = F.normalize(
        torch.randn(6, SMALL["embed_dim"], generator=torch.Generator().manual_seed(3)), dim=-1
    )
    (s1, i1), (s2, i2) = host.search(q, 5), dev.search(q, 5)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=0)
    # the bank negatives: the same draw, the same rows
    (b1, n1), (b2, n2) = (m.negatives(7, torch.Generator().manual_seed(4)) for m in (host, dev))
    assert torch.equal(n1, n2) and torch.equal(b1, b2)
    host.close()
    dev.close()
