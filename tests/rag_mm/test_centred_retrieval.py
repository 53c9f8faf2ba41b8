"""retriever.centre in the app: the memory's calibration queries are the training split's first
queries as evaluation reads them, the same in every process that builds the run, and the
index the trainer and the evaluation search is centred with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rag_mm.build import build_rag, make_stream
from rag_mm.config import compose
from rag_mm.data.pipeline import DataError
from tests.rag_mm.conftest import LEARNED_RUN, tiny_overrides


def test_centred_memory_calibrates_on_the_training_queries(tiny_world, tmp_path):
    cfg = compose(tiny_overrides(tiny_world, tmp_path, *LEARNED_RUN, "retriever.centre=true"))
    parts = build_rag(cfg, torch.device("cpu"))
    images, q_ids, q_len = parts.memory.queries
    # the tiny world's 72 training queries (18 entities seen in training, 4 each), fewer than the
    # 512 a calibration takes
    first = list(make_stream(cfg, "train", train=False))
    assert len(q_len) == sum(len(b["q_len"]) for b in first) == 72
    torch.testing.assert_close(images, torch.cat([b["image"] for b in first]))
    torch.testing.assert_close(q_len, torch.cat([b["q_len"] for b in first]))
    rows = [row[:n] for b in first for row, n in zip(b["q_ids"], b["q_len"], strict=True)]
    assert all(torch.equal(q_ids[i, :n], r) for i, (n, r) in enumerate(zip(q_len, rows)))
    # another process building the run takes the same sample
    again = build_rag(cfg, torch.device("cpu")).memory.queries
    assert all(torch.equal(a, b) for a, b in zip(parts.memory.queries, again, strict=True))
    # the index the run searches is centred with them
    rag, mem = parts.rag.eval(), parts.memory
    mem.refresh()
    with torch.no_grad():
        cal = rag.retriever.embed_queries(images, q_ids, q_len)
        q = cal[:8]
    d = mem.embed()
    want = F.normalize(q - cal.mean(0), dim=-1) @ F.normalize(d - d.mean(0), dim=-1).T
    scores, ids = mem.search(q, 2)
    top = want.topk(2, dim=1)
    assert ids.tolist() == torch.from_numpy(mem.doc_ids)[top.indices].tolist()
    torch.testing.assert_close(scores, top.values, atol=1e-5, rtol=1e-5)
    mem.close()
    # off (the default): no calibration read, the inner product
    plain = build_rag(
        compose(tiny_overrides(tiny_world, tmp_path, *LEARNED_RUN)), torch.device("cpu")
    )
    assert plain.memory.queries is None


def test_centred_memory_without_training_queries_says_why_it_needs_them(tiny_world, tmp_path):
    over = [*LEARNED_RUN, "retriever.centre=true", "data.train='gone/train-{000000..000001}.tar'"]
    with pytest.raises(DataError, match=r"retriever.centre centres queries .* no readable sample"):
        build_rag(compose(tiny_overrides(tiny_world, tmp_path, *over)), torch.device("cpu"))
