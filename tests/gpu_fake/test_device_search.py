"""The device search on fake CUDA (retriever.search=device): a learned-mode read (the query
encoded, the memory searched, the candidates reranked with the live document tower, the top-k
documents fetched from the store, the reader's prior) with no host sync and no CPU tensor; the
gold-document counts of the step stay on the device too."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rag_mm.model.rag import gold_hits
from tests.gpu_fake.fake_cuda import audited, fake_cuda
from tests.gpu_fake.learned import learned_rag
from tests.gpu_fake.test_fake_cuda import CUDA, _assert_clean, _cfg, _inputs, _reader

N = 12  # documents


# the memory turns its (real) id tensor into numpy inside the fake mode, which fakes the detach
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_search_rerank_and_fetch_on_fake_cuda():
    cfg = _cfg("retriever.rerank=8", "retriever.centre=true")
    r, m = cfg.retriever, cfg.model
    ids = torch.arange(N) * 7 + 3
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(m, mode)
    with fake_cuda(mode):
        # the memory is built and embedded once (a refresh, not the step)
        rag = learned_rag(cfg, mode, reader, ids)
        x = _inputs(m, 0)
        q = {k: x[k] for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
        gold = torch.randint(0, N, (len(x["image"]),), device=CUDA) * 7 + 3
        with audited() as audit:
            read, got, _ = rag.reader_inputs(q, grad=False)
            hits, named = gold_hits(got[:, : r.top_k], gold)
    assert got.device.type == "cuda" and got.shape == (len(x["image"]), r.top_k)
    assert read["doc_image"].device.type == "cuda"
    assert read["doc_image"].shape[:2] == (len(x["image"]), r.top_k)
    assert hits.device.type == named.device.type == "cuda" and hits.shape == ()
    _assert_clean(audit, "the device search's read")
